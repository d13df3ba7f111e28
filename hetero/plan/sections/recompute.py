"""The recompute section: blocks whose saved tensors backward rebuilds from their inputs (a lever of the DRAM-budget
fit; the blocks and their figures: hetero.plan.recompute). Pure: no torch, no I/O."""

from __future__ import annotations

from hetero.plan import recompute
from hetero.plan.section import HostPeak, Section, Step
from hetero.schema.plan import Plan, RecomputePlan
from hetero.schema.profile import Profile

RECOMPUTED = "activations recomputed in backward"  # its host-memory account entry (hetero.plan.footprint)


def solve(step: Step) -> RecomputePlan | None:
    return recompute.section(step.ctx.profile, step.blocks) if "recompute" in step.levers else None


def host_entries(profile: Profile, plan: Plan, _: HostPeak) -> dict[str, int]:
    return {RECOMPUTED: -recompute.peak_drop(profile, plan.recompute)}


def cost_s(profile: Profile, plan: Plan) -> float:
    return recompute.cost_s(profile, plan.recompute)


SECTION = Section(name="recompute", phase="draft", solve=solve, host_bytes=host_entries, cost_s=cost_s)
