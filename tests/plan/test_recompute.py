"""Recomputation is a lever of the DRAM-budget fit: chosen where it is the fastest way to fit, with the fewest
blocks that keep the budget, its time in the predicted iteration and its saving in the plan's account; blocks the
profile found it cannot recompute are left out, with why."""

from dataclasses import replace

import pytest

from hetero.errors import USAGE, HeteroError
from hetero.plan import backward, fit, footprint, recompute
from hetero.plan.sections.recompute import gradients_of
from hetero.plan.solve import PlanOptions, plan
from hetero.schema import files
from hetero.schema.plan import Trial, UpdateInBackward
from hetero.schema.profile import Block, Memory, Profile
from tests.plan.test_fit import refused, saving

MiB = 2**20
PLAIN, RETURNED = 900 * MiB, 700 * MiB


@pytest.fixture
def cpu(repo) -> Profile:
    profile = files.load(repo / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)
    profile.memory = Memory(dram_peak_bytes=PLAIN, dram_peak_returned_bytes=RETURNED,
                            returned_step_s=profile.training.iteration_s * 1.25,
                            default_step_s=profile.training.iteration_s)
    profile.blocks = [Block(name=f"h.{i}", input_bytes=MiB, recomputable=True) for i in range(4)]
    return profile


def budget(peak: int) -> PlanOptions:
    return PlanOptions(dram_budget_bytes=fit.budget_for(peak))


def test_a_blocks_saving_is_what_its_layers_save_beyond_its_inputs_and_its_cost_its_forward(cpu):
    units, refused = recompute.units(cpu)
    assert sorted(u.name for u in units) == ["h.0", "h.1", "h.2", "h.3"] and refused == {}
    h1 = next(u for u in units if u.name == "h.1")
    inside = [x for x in cpu.layers if x.name.startswith("h.1.")]
    assert h1.saved_bytes == sum(x.saved_bytes for x in inside) and h1.saving_bytes == h1.saved_bytes - MiB
    before = cpu.layers[cpu.layers.index(inside[0]) - 1]
    assert h1.forward_s == pytest.approx(inside[-1].fp_end_s - before.fp_end_s)
    rates = [u.saving_bytes / u.forward_s for u in units]
    assert rates == sorted(rates, reverse=True)  # the most bytes per second first


def test_the_fit_recomputes_the_fewest_blocks_that_keep_the_budget_and_counts_them(cpu):
    p = plan(cpu, budget(650 * MiB))  # freed memory returned (700MiB), the states on NVMe (32MiB), 18MiB more
    assert p.recompute is not None and len(p.recompute.blocks) == 3 and p.allocator is not None
    units = {u.name: u for u in recompute.units(cpu)[0]}
    chosen = [units[name] for name in p.recompute.blocks]
    # backward rebuilds one block at a time, on top of the gradients made by then: less than every block's saving
    # but the largest is taken off the peak
    drop = p.predicted.dram_saved[footprint.RECOMPUTED]
    assert drop == backward.drop_bytes(cpu.layers, {u.name: u.kept_bytes for u in chosen},
                                       base=gradients_of(cpu, p))
    assert 0.8 < drop / (sum(u.saving_bytes for u in chosen) - max(u.saving_bytes for u in chosen)) < 1
    assert p.predicted.peak_bytes["dram"] <= 650 * MiB
    fewer = plan(cpu, budget(640 * MiB))
    assert len(fewer.recompute.blocks) == 4
    assert fewer.predicted.iteration_s - p.predicted.iteration_s == pytest.approx(
        units[next(b for b in fewer.recompute.blocks if b not in p.recompute.blocks)].forward_s, rel=1e-6)
    assert saving(p.budget.why, "recompute") is not None
    assert p.recompute.blocks == sorted(p.recompute.blocks)  # in forward order


def test_blocks_that_cannot_be_recomputed_are_left_out_with_why(cpu):
    cpu.blocks[1] = Block(name="h.1", input_bytes=MiB, recomputable=False, why="its forward changes its buffers")
    why = recompute.section(cpu).why  # the block left out, with the profile's reason
    assert "h.1" in why and cpu.blocks[1].why in why
    for b in cpu.blocks:
        b.recomputable, b.why = False, "randomness it cannot replay"
    p = plan(cpu, budget(860 * MiB))
    assert p.recompute is None
    reason = refused(p.budget.why, "recompute")
    assert reason == recompute.refused_text(cpu) and "h.0" in reason and cpu.blocks[0].why in reason
    cpu.blocks = []
    assert refused(plan(cpu, budget(860 * MiB)).budget.why, "recompute") == recompute.refused_text(cpu) != ""


def test_recomputing_saves_nothing_below_what_the_optimizer_step_holds(cpu):
    for x in cpu.layers:  # a third of the tiny GPT's activations: recomputed, below its gradients and temporaries
        x.saved_bytes //= 3
    params, largest = (sum(x.params_bytes for x in cpu.layers),
                       max(b for x in cpu.layers for b in x.params.values()))
    plain = backward.peak_bytes(cpu.layers, backward.Held(step=True))
    assert plain > params + 2 * largest
    assert recompute.peak_drop(cpu, recompute.section(cpu)) == plain - (params + 2 * largest)
    # with the gradients gone to NVMe as they are made, the step no longer hides the activations
    gone = backward.Held(gone_grads=frozenset(x.name for x in cpu.layers), step=True)
    assert recompute.peak_drop(cpu, recompute.section(cpu), gone) > plain - (params + 2 * largest)
    assert recompute.fewest(lambda k: k >= 3, 4) == 3 and recompute.fewest(lambda k: True, 4) == 1


def test_recompute_forces_every_recomputable_block_and_is_refused_where_none_is(cpu):
    p = plan(cpu, PlanOptions(recompute=True))
    assert p.recompute.blocks == ["h.0", "h.1", "h.2", "h.3"] and p.budget.dram_budget_bytes is None
    assert p.allocator is not None  # what the rebuilds free is returned: with malloc's defaults the heap keeps it
    assert p.predicted.iteration_s == pytest.approx(plan(cpu, PlanOptions()).predicted.iteration_s +
                                                    recompute.cost_s(cpu, p.recompute) + fit.allocator_cost_s(cpu),
                                                    rel=1e-6)
    assert p.predicted.peak_bytes["dram"] == RETURNED - recompute.peak_drop(cpu, p.recompute)
    under = plan(cpu, PlanOptions(recompute=True, dram_budget_bytes=2 * PLAIN))  # fits plain, recomputes anyway
    assert under.recompute.blocks == p.recompute.blocks
    cpu.blocks = []
    with pytest.raises(HeteroError) as e:
        plan(cpu, PlanOptions(recompute=True))
    assert e.value.exit_code == USAGE and e.value.message.startswith("--recompute")


def test_where_blocks_can_be_recomputed_tiering_is_left_out_and_says_why(cpu):
    p = plan(cpu, budget(RETURNED - 60 * MiB))
    assert p.activations is None and p.recompute is not None
    assert refused(p.budget.why, "tiering") == fit.TIERING_LEFT_OUT


def test_recomputing_is_counted_with_the_plans_own_gradients(cpu):
    p = plan(cpu, budget(650 * MiB))
    assert gradients_of(cpu, p) == backward.Held(step=True)  # the script's optimizer's gradients, all held
    in_backward = replace(p, update_in_backward=UpdateInBackward(kind="adamw"))
    assert gradients_of(cpu, in_backward) == backward.Held(in_backward=True)
    nvme = replace(p.optimizer, nvme=replace(p.optimizer.nvme, grads=True),
                   states=[replace(s, tier="nvme") for s in p.optimizer.states])
    gone = gradients_of(cpu, replace(p, optimizer=nvme))
    assert gone.gone_grads == {x.name for x in cpu.layers if x.params} and gone.step


def test_a_trial_of_fewer_blocks_that_did_not_fit_has_the_planner_recompute_more(cpu):
    options = budget(650 * MiB)
    first = plan(cpu, options)
    k = len(first.recompute.blocks)
    over = Trial(levers=sorted(fit.levers_of(cpu, first)), blocks=k, predicted_bytes=first.predicted.peak_bytes["dram"],
                 peaks_bytes=[660 * MiB] * 3, stopped=0, stop_bytes=650 * MiB, mapped_bytes=0, step_s=1.0, step_range_s=0.0,
                 mmap_threshold_bytes=first.allocator.mmap_threshold_bytes)
    second = plan(cpu, replace(options, trials=(over,)))
    assert second.recompute is not None and len(second.recompute.blocks) > k  # the trial's error added


@pytest.mark.parametrize("kernel_s", [1e-6, 100.0])
def test_a_higher_rung_is_tried_only_where_its_page_faults_could_pay_for_its_blocks(cpu, kernel_s):
    """A rung recomputes every block; it saves at most the kernel time the trial measured."""
    options = replace(budget(650 * MiB), measuring=True)
    first = plan(cpu, options)
    k = len(first.recompute.blocks)
    fits = Trial(levers=sorted(fit.levers_of(cpu, first)), blocks=k, predicted_bytes=first.predicted.peak_bytes["dram"],
                 peaks_bytes=[600 * MiB] * 3, stopped=0, stop_bytes=650 * MiB, mapped_bytes=0, step_s=1.0,
                 step_range_s=0.0, mmap_threshold_bytes=first.allocator.mmap_threshold_bytes, system_s=kernel_s)
    second = plan(cpu, replace(options, trials=(fits,)))
    if kernel_s < 1:
        assert len(second.recompute.blocks) == k and second.allocator.mmap_threshold_bytes == 128 << 10
    else:
        assert second.allocator.mmap_threshold_bytes == 1 << 20 and len(second.recompute.blocks) > k
