"""Recomputation is a lever of the DRAM-budget fit: chosen where it is the fastest way to fit, with the fewest
blocks that keep the budget, its time in the predicted iteration and its saving in the plan's account; blocks the
profile found it cannot recompute are left out, with why."""

from dataclasses import replace

import pytest

from hetero.errors import USAGE, HeteroError
from hetero.plan import alone, backward, fit, footprint, recompute
from hetero.plan.sections.recompute import gradients_of
from hetero.plan.sections import plain_of
from hetero.plan.solve import PlanOptions, plan, predict
from hetero.schema import files
from hetero.schema.plan import UpdateInBackward
from hetero.schema.profile import Block, MeasuredAlone, Memory, Profile

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
    assert "recomputing blocks in backward saves" in p.budget.why
    assert p.recompute.blocks == sorted(p.recompute.blocks)  # in forward order


def test_blocks_that_cannot_be_recomputed_are_left_out_with_why(cpu):
    cpu.blocks[1] = Block(name="h.1", input_bytes=MiB, recomputable=False, why="its forward changes its buffers")
    assert "not h.1: its forward changes its buffers" in recompute.section(cpu).why
    for b in cpu.blocks:
        b.recomputable, b.why = False, "randomness it cannot replay"
    p = plan(cpu, budget(860 * MiB))
    assert p.recompute is None
    assert "not recomputing blocks in backward: no block can be recomputed (h.0: randomness it cannot replay)" \
        in p.budget.why
    cpu.blocks = []
    assert "found no repeated blocks" in plan(cpu, budget(860 * MiB)).budget.why


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
    assert e.value.exit_code == USAGE and e.value.message.startswith("--recompute: the profile found no repeated")


def test_where_blocks_can_be_recomputed_tiering_is_left_out_and_says_why(cpu):
    p = plan(cpu, budget(RETURNED - 60 * MiB))
    assert p.activations is None and p.recompute is not None
    assert f"not evicting saved activations: {fit.TIERING_LEFT_OUT}" in p.budget.why


def test_recomputing_is_counted_with_the_plans_own_gradients(cpu):
    p = plan(cpu, budget(650 * MiB))
    assert gradients_of(cpu, p) == backward.Held(step=True)  # the script's optimizer's gradients, all held
    in_backward = replace(p, update_in_backward=UpdateInBackward(kind="adamw"))
    assert gradients_of(cpu, in_backward) == backward.Held(in_backward=True)
    nvme = replace(p.optimizer, nvme=replace(p.optimizer.nvme, grads=True),
                   states=[replace(s, tier="nvme") for s in p.optimizer.states])
    gone = gradients_of(cpu, replace(p, optimizer=nvme))
    assert gone.gone_grads == {x.name for x in cpu.layers if x.params} and gone.step


def _anchored(profile: Profile, p) -> float:
    """`p`'s simulated iteration on plain training's measured step (hetero.plan.plain.anchored_iteration_s)."""
    return profile.training.iteration_s + predict(profile, p).iteration_s - predict(profile, plain_of(p)).iteration_s


def test_every_block_recomputed_with_mallocs_defaults_is_planned_at_its_peak_and_step_measured_alone(cpu):
    """Under a limit plain's own peak did not settle under, the profile measured every block recomputed with
    malloc's defaults alone: that is a candidate at its measured peak and step, chosen where it is the faster fit."""
    step = cpu.training.iteration_s
    lean = MeasuredAlone(levers=["recompute"], peak_bytes=RETURNED - 80 * MiB, step_s=0.5 * step)
    cpu.memory = Memory(dram_peak_bytes=RETURNED, dram_peak_estimated=True, dram_peak_returned_bytes=RETURNED,
                        returned_step_s=step, measured_alone=[lean])
    p = plan(cpu, budget(RETURNED))
    assert p.allocator is None and p.update_in_backward is None and p.optimizer is None
    assert p.recompute.blocks == ["h.0", "h.1", "h.2", "h.3"]  # every block: the measured plan, not fewer
    assert p.predicted.dram == {footprint.MEASURED_ALONE: RETURNED - 80 * MiB}
    # its simulated iteration (the profile's steps returned freed memory), less what the measured step saves, less the
    # margin a plan that recomputes must beat memory returned by
    saved = 0.5 - alone.RECOMPUTE_MARGIN
    assert p.predicted.iteration_s == pytest.approx(_anchored(cpu, p) - saved * step, rel=1e-6)
    assert "every block, with malloc's defaults, measured alone" in p.budget.why
    # slower than returning freed memory, or faster by less than the margin: not chosen where that fits; above the
    # room: not a candidate
    for slower in (1.1, 1 - alone.RECOMPUTE_MARGIN / 2):
        lean.step_s = slower * step
        assert plan(cpu, budget(RETURNED)).allocator is not None
    lean.step_s, lean.peak_bytes = 0.5 * step, RETURNED + 50 * MiB
    assert plan(cpu, budget(RETURNED)).allocator is not None
    # a plan edited to recompute fewer blocks is predicted as the profile's layers count it, not as measured
    edited = replace(p, recompute=replace(p.recompute, blocks=p.recompute.blocks[1:]))
    assert alone.measured(cpu, edited) is None


def test_updates_in_backward_measured_alone_are_planned_before_recomputation(cpu):
    """Updates in backward cost no time: measured alone under the room, they are the plan, with no block
    recomputed; the planner takes the measured peak, not plain's estimate less the gradients."""
    step = cpu.training.iteration_s
    cpu.memory = Memory(dram_peak_bytes=RETURNED, dram_peak_estimated=True, dram_peak_returned_bytes=RETURNED,
                        returned_step_s=step, measured_alone=[
                            MeasuredAlone(levers=["in_backward"], peak_bytes=RETURNED - 80 * MiB, step_s=0.7 * step),
                            MeasuredAlone(levers=["in_backward", "recompute"], peak_bytes=RETURNED // 2,
                                          step_s=0.8 * step)])
    p = plan(cpu, budget(RETURNED))
    assert p.allocator is None and p.recompute is None and p.update_in_backward is not None
    assert p.predicted.dram == {footprint.MEASURED_ALONE: RETURNED - 80 * MiB}
    assert p.predicted.iteration_s == pytest.approx(_anchored(cpu, p) - 0.3 * step, rel=1e-6)
    assert "updating each parameter in backward" in p.budget.why and "measured alone" in p.budget.why
    # measured slower than plain with freed memory returned, one process each: still the plan, at no cost, before
    # returning memory (as fast by the prediction, which cannot count its page faults here); no NVMe to move to
    lean = replace(cpu, machine=replace(cpu.machine, tiers=[t for t in cpu.machine.tiers if t.kind != "nvme"]))
    first = lean.memory.measured_alone[0]
    first.step_s, first.peak_bytes, lean.memory.measured_alone[1].step_s = 1.1 * step, RETURNED + 10 * MiB, 1.2 * step
    p = plan(lean, budget(fit.with_spread(first.peak_bytes)))  # its peak above the one predicted with memory returned
    assert p.allocator is None and p.recompute is None and p.update_in_backward is not None
    assert p.predicted.iteration_s == pytest.approx(_anchored(lean, p), rel=1e-6)
    assert "taken as no slower" in p.budget.why
    first.step_s, first.peak_bytes, cpu.memory.measured_alone[1].step_s = 0.7 * step, RETURNED - 80 * MiB, 0.8 * step
    # where only the leaner of the two fits, it is the plan
    p = plan(cpu, PlanOptions(dram_budget_bytes=fit.budget_for(fit.with_spread(RETURNED // 2))))
    assert p.allocator is None and p.recompute is not None and p.update_in_backward is not None
    assert p.predicted.dram == {footprint.MEASURED_ALONE: RETURNED // 2}


def test_a_leaner_plan_measured_alone_beside_plains_own_peak_is_held_as_measured(cpu):
    """Plain training measured alone but too near the budget for malloc's spread: the profile measured updates in
    backward alone too, and that candidate (a lever the planner also simulates) keeps the measured rule, spread and
    mapped files under the budget without the simulation's headroom."""
    step = cpu.training.iteration_s
    lean = MeasuredAlone(levers=["in_backward"], peak_bytes=RETURNED, step_s=step)
    cpu.memory = Memory(dram_peak_bytes=PLAIN, dram_peak_returned_bytes=RETURNED - 100 * MiB, returned_step_s=step,
                        default_step_s=step, measured_alone=[lean])
    budget = fit.with_spread(RETURNED) + fit.MAPPED_BYTES  # within the room only without the headroom
    assert fit.with_spread(RETURNED) > fit.room_of(budget)
    cpu.machine.tiers = [t for t in cpu.machine.tiers if t.kind != "nvme"]  # its Adam would be faster than torch's
    p = plan(cpu, PlanOptions(dram_budget_bytes=budget))
    assert p.update_in_backward is not None and p.allocator is None
    assert p.predicted.dram == {footprint.MEASURED_ALONE: RETURNED} and "measured alone" in p.budget.why
