"""The peak and step time with freed memory returned come from a fresh process that runs the script as the
runtime would run it under the plan's `allocator` section; a script that ends too soon gives none."""

from hetero.profile import returned
from tests.profile import scripts


def test_a_fresh_process_measures_the_returned_peak_and_step(tmp_path):
    script = scripts.write(tmp_path, scripts.LOOP)
    found = returned.measure(script, ["--steps", "6"], warmup=1)
    assert found is not None and found.peak_bytes > 50 * 2**20 and found.step_s > 0 and found.default_step_s > 0
    assert found.default_peak_bytes > 50 * 2**20 and 3 <= found.default_steps <= 6  # settled, or the script ended
    runs = found.default_peaks_bytes  # plain's peak: the middle of two (their mean) or three fresh processes
    if len(runs) == returned.DEFAULT_RUNS == 2:
        assert found.default_peak_bytes == sum(runs) // 2
    else:  # the first two disagreed
        assert len(runs) == returned.MOST_RUNS == 3 and found.default_peak_bytes == sorted(runs)[1]


def test_a_third_process_decides_where_two_disagree_by_more_than_mallocs_spread():
    from hetero.profile.fresh import Run

    def runs(*mib):
        return [Run(peak_bytes=m << 20, step_s=1.0, steps=4) for m in mib]

    assert returned.more_needed(runs()) and returned.more_needed(runs(1000))
    assert not returned.more_needed(runs(1000, 1050))  # within `AGREE`: their mean
    assert returned.more_needed(runs(1060, 1180))  # heldout_lm 8 x 256's two, 11% apart
    assert not returned.more_needed(runs(1060, 1180, 1100))  # at most three


def test_a_script_that_ends_before_the_timed_steps_gives_nothing(tmp_path):
    script = scripts.write(tmp_path, scripts.LOOP)
    assert returned.measure(script, ["--steps", "2"], warmup=1) is None


def test_under_a_budget_the_bandwidth_copy_fits_the_room_left():
    from hetero.profile.machine import copy_size

    MiB = 2**20
    assert copy_size(None) == 256 * MiB  # no budget: as before
    assert copy_size(300 * MiB) == 75 * MiB  # two buffers in half the room
    assert copy_size(10 * MiB) == 16 * MiB and copy_size(8 << 30) == 256 * MiB


def test_a_run_stops_once_its_peak_has_settled_or_at_the_most_steps():
    MiB = 2**20
    assert not returned.settled([100 * MiB, 120 * MiB], least_steps=3)
    assert not returned.settled([100 * MiB, 120 * MiB, 130 * MiB, 131 * MiB], least_steps=3)  # 11 MiB in two steps
    assert returned.settled([100 * MiB, 120 * MiB, 130 * MiB, 131 * MiB, 131 * MiB], least_steps=3)
    assert not returned.settled([1] * 4, least_steps=5)  # the warm-up and timed steps first
    rising = [k * 10 * MiB for k in range(1, returned.MAX_STEPS + 1)]
    assert returned.settled(rising, least_steps=3) and not returned.settled(rising[:-1], least_steps=3)


def test_under_a_budget_no_machine_buffer_takes_more_than_an_eighth_of_the_room():
    from hetero.profile.machine import largest_buffer, update_sizes
    from hetero.profile.updates import UPDATE_SIZES

    MiB = 2**20
    assert largest_buffer(None) == 64 * MiB and update_sizes(64 * MiB) == UPDATE_SIZES  # no budget: as before
    assert largest_buffer(300 * MiB) == 32 * MiB and largest_buffer(10 * MiB) == 4 * MiB
    small, large = update_sizes(4 * MiB)
    assert small == UPDATE_SIZES[0] and 16 * large <= 4 * MiB and large > small
