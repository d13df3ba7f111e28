"""The allocator section: glibc returns the memory freed tensors leave (a lever of the DRAM-budget fit,
hetero.plan.fit), from the start of the run, its cost the page faults the profile measured. Pure: no torch, no
I/O."""

from __future__ import annotations

from dataclasses import replace

from hetero.plan import fit
from hetero.plan.context import Context
from hetero.plan.section import Section, Step
from hetero.schema.plan import AllocatorPlan, Plan
from hetero.schema.profile import Profile
from hetero.units import SIZE, short_time


def solve(step: Step) -> AllocatorPlan | None:
    if "allocator" not in step.levers:
        return None
    plan = _allocator(step.ctx)
    if "recompute" not in step.levers:
        return plan
    return replace(plan, why=f"{plan.why}; recomputed blocks need it (hetero.plan.fit.NEEDS): with malloc's "
                             "defaults the heap keeps much of what their rebuilds free, and the peak falls by far less")


def cost_s(profile: Profile, plan: Plan) -> float:
    return fit.allocator_cost_s(profile) if plan.allocator is not None else 0.0


def _allocator(ctx: Context) -> AllocatorPlan:
    m = ctx.profile.memory
    if m.dram_peak_estimated:
        # From the start, as the profile measured it: a switch from malloc's defaults once the process holds more
        # (the plan's `from`) went on growing past it by 160-195 MiB (train_gpt 6 x 256 under 1200 MiB, the
        # switch at 1.04 GiB: 1.10-1.14 GiB, and the limit's kill under a loaded machine, where returning from the
        # start peaks at 970 MiB; docs/benchmarks.md, round seven): no prediction holds for it.
        return fit.allocator_plan(
            f"glibc returns the memory freed tensors leave from the start, as it did throughout the profile "
            f"({m.profiled_under}): plain training peaked at {SIZE.format_short(m.dram_peak_returned_bytes)} that "
            "way")
    return fit.allocator_plan(
        f"glibc returns the memory freed tensors leave: plain training peaks at "
        f"{SIZE.format_short(m.dram_peak_returned_bytes)} this way against {SIZE.format_short(m.dram_peak_bytes)} "
        f"by default, for {short_time(fit.allocator_cost_s(ctx.profile))} more per step (page faults), as the "
        "profile measured it in a fresh process")


SECTION = Section(name="allocator", phase="draft", solve=solve, cost_s=cost_s)
