"""The peak and step time with freed memory returned come from a few steps the profile runs after its measured ones
with glibc's thresholds set as the runtime sets them for the plan's `allocator` section; a script that ends too soon
gives none. Under a budget the machine's buffers fit the room the training leaves."""

from hetero.profile import returned
from hetero.profile.profiler import ProfileOptions, measure_script
from hetero.run import process_memory
from tests.profile import scripts


def test_the_profile_measures_the_returned_peak_and_step_in_steps_after_the_measured_ones(tmp_path):
    script = scripts.write(tmp_path, scripts.LOOP)
    run = measure_script(script, ["--steps", "12"], ProfileOptions(steps=2, warmup=1))
    memory = run.memory
    assert 50 * 2**20 < memory.dram_peak_returned_bytes <= process_memory.dram_peak_bytes()
    assert memory.returned_step_s > 0 and memory.default_step_s == run.training.iteration_s


def test_a_script_that_ends_before_the_returned_steps_gives_nothing(tmp_path):
    script = scripts.write(tmp_path, scripts.LOOP)
    run = measure_script(script, ["--steps", "4"], ProfileOptions(steps=2, warmup=1))  # one step after the measured
    assert run.memory.dram_peak_returned_bytes is None and run.memory.returned_step_s is None


def test_the_returned_steps_time_all_but_the_first_and_give_back_mallocs_defaults():
    steps = returned.ReturnedSteps()
    assert steps.start()
    try:
        assert [steps.step_ended() for _ in range(steps.STEPS)] == [False] * (steps.STEPS - 1) + [True]
        peak, step_s = steps.result
        assert peak > 0 and step_s >= 0
    finally:
        steps.close()
    assert not steps.applied


def test_under_a_budget_the_bandwidth_copy_fits_the_room_left():
    from hetero.profile.machine import copy_size

    MiB = 2**20
    assert copy_size(None) == 256 * MiB  # no budget: as before
    assert copy_size(300 * MiB) == 75 * MiB  # two buffers in half the room
    assert copy_size(10 * MiB) == 16 * MiB and copy_size(8 << 30) == 256 * MiB


def test_under_a_budget_no_machine_buffer_takes_more_than_an_eighth_of_the_room():
    from hetero.profile.machine import largest_buffer, update_sizes
    from hetero.profile.updates import UPDATE_SIZES

    MiB = 2**20
    assert largest_buffer(None) == 64 * MiB and update_sizes(64 * MiB) == UPDATE_SIZES  # no budget: as before
    assert largest_buffer(300 * MiB) == 32 * MiB and largest_buffer(10 * MiB) == 4 * MiB
    small, large = update_sizes(4 * MiB)
    assert small == UPDATE_SIZES[0] and 16 * large <= 4 * MiB and large > small
