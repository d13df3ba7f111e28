"""Leaner plans measured alone: the profile runs the ones the script allows, updates in backward first (they cost
no time); the planner knows such a plan, and only such a plan, by its sections."""

from dataclasses import replace

import pytest

from hetero.plan import alone
from hetero.plan.solve import measured_alone
from hetero.schema import files
from hetero.schema.plan import AllocatorPlan
from hetero.schema.profile import Block, MeasuredAlone, Memory, Profile

MiB = 2**20


@pytest.fixture
def cpu(repo) -> Profile:
    profile = files.load(repo / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)
    profile.blocks = [Block(name=f"h.{i}", input_bytes=MiB, recomputable=True) for i in range(4)]
    profile.memory = Memory(dram_peak_bytes=900 * MiB, dram_peak_estimated=True, dram_peak_returned_bytes=700 * MiB,
                            returned_step_s=1.0, measured_alone=[
                                MeasuredAlone(levers=["in_backward"], peak_bytes=800 * MiB, step_s=0.8),
                                MeasuredAlone(levers=["in_backward", "recompute"], peak_bytes=600 * MiB, step_s=0.9)])
    return profile


def test_the_profile_measures_updates_in_backward_first_then_every_block_recomputed_with_them(cpu):
    assert alone.to_measure(cpu) == [{"in_backward"}, {"in_backward", "recompute"}]
    cpu.training.edits_grads = True  # updates must wait for every gradient: recomputation alone
    assert alone.to_measure(cpu) == [{"recompute"}]
    cpu.blocks = []
    assert alone.to_measure(cpu) == []


def test_a_leaner_plan_is_known_by_its_sections_and_costs_its_measured_step(cpu):
    for levers, peak, step in ((["in_backward"], 800, 0.8), (["in_backward", "recompute"], 600, 0.9)):
        p = measured_alone(cpu, "profile.yaml", frozenset(levers))
        assert alone.measured(cpu, p).peak_bytes == peak * MiB
        # against plain with freed memory returned, and a plan that recomputes its margin above that
        margin = alone.RECOMPUTE_MARGIN if "recompute" in levers else 0.0
        assert alone.cost_s(cpu, p) == pytest.approx(step - 1.0 + margin)
        assert p.allocator is None and p.optimizer is None and p.budget.dram_budget_bytes is None
    p = measured_alone(cpu, "profile.yaml", frozenset({"in_backward", "recompute"}))
    edited = [replace(p, recompute=replace(p.recompute, blocks=p.recompute.blocks[1:])),  # fewer blocks
              replace(p, allocator=AllocatorPlan(mmap_threshold_bytes=AllocatorPlan.RETURNING,
                                                 trim_threshold_bytes=AllocatorPlan.RETURNING)),
              replace(p, update_in_backward=None)]  # recomputation alone was not measured
    assert [alone.measured(cpu, e) for e in edited] == [None, None, None]
    assert alone.cost_s(cpu, edited[0]) == 0.0


def test_updates_in_backward_measured_slower_than_memory_returned_cost_nothing(cpu):
    """They add no work and fault less than memory returned: a slower measurement is the machine's noise, while
    recomputation's measured cost stands."""
    for lean in cpu.memory.measured_alone:
        lean.step_s = 1.2
    costs = [alone.cost_s(cpu, measured_alone(cpu, "profile.yaml", frozenset(levers)))
             for levers in (["in_backward"], ["in_backward", "recompute"])]
    assert costs == [0.0, pytest.approx(0.2 + alone.RECOMPUTE_MARGIN)]
