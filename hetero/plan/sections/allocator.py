"""The allocator section: glibc returns the memory freed tensors leave (a lever of the DRAM-budget fit,
hetero.plan.fit), its cost the page faults the profile measured. Pure: no torch, no I/O."""

from __future__ import annotations

from dataclasses import replace

from hetero.plan import fit
from hetero.plan.context import Context
from hetero.plan.section import Section, Step
from hetero.schema.plan import AllocatorPlan, Plan
from hetero.schema.profile import Profile
from hetero.units import SIZE, short_time


class Allocator(Section):
    name = "allocator"

    def solve(self, step: Step) -> AllocatorPlan | None:
        if "allocator" not in step.levers:
            return None
        plan = _allocator(step.ctx)
        if "recompute" not in step.levers:
            return plan
        return replace(plan, why=f"{plan.why}; recomputed blocks need it (hetero.plan.fit.NEEDS): with malloc's "
                                 "defaults the heap keeps much of what their rebuilds free, and the peak falls by far "
                                 "less")

    def cost_s(self, profile: Profile, plan: Plan) -> float:
        return fit.allocator_cost_s(profile) if plan.allocator is not None else 0.0


def _allocator(ctx: Context) -> AllocatorPlan:
    m = ctx.profile.memory
    if m.dram_peak_estimated:
        return fit.allocator_plan(
            f"glibc returns the memory freed tensors leave as it did throughout the profile ({m.profiled_under}): "
            f"plain training peaked at {SIZE.format_short(m.dram_peak_returned_bytes)} that way")
    return fit.allocator_plan(
        f"glibc returns the memory freed tensors leave: plain training peaks at "
        f"{SIZE.format_short(m.dram_peak_returned_bytes)} this way against {SIZE.format_short(m.dram_peak_bytes)} "
        f"by default, for {short_time(fit.allocator_cost_s(ctx.profile))} more per step (page faults), as the "
        "profile measured it")
