"""The recompute section: blocks whose saved tensors backward rebuilds from their inputs (a lever of the DRAM-budget
fit; the blocks and their figures: hetero.plan.recompute). Pure: no torch, no I/O."""

from __future__ import annotations

from hetero.plan import recompute
from hetero.plan.backward import Held
from hetero.plan.section import HostPeak, Section, Step
from hetero.plan.sections.optimizer_bytes import grads_on_nvme
from hetero.schema.plan import Plan, RecomputePlan
from hetero.schema.profile import Profile

RECOMPUTED = "activations recomputed in backward"  # its host-memory account entry (hetero.plan.footprint)


class Recompute(Section):
    name = "recompute"

    def solve(self, step: Step) -> RecomputePlan | None:
        return recompute.section(step.ctx.profile, step.blocks) if "recompute" in step.levers else None

    def host_bytes(self, profile: Profile, plan: Plan, _: HostPeak) -> dict[str, int]:
        return {RECOMPUTED: -recompute.peak_drop(profile, plan.recompute, gradients_of(profile, plan))}

    def cost_s(self, profile: Profile, plan: Plan) -> float:
        """Each chosen block's forward once more."""
        return recompute.cost_s(profile, plan.recompute)


def gradients_of(profile: Profile, plan: Plan) -> Held:
    """Where the plan's gradients are through the step: each freed once its update ran (update_in_backward), gone to
    NVMe as made (the layers whose states all wait there), or all held until the optimizer steps."""
    if plan.update_in_backward is not None:
        return Held(in_backward=True)
    if not grads_on_nvme(profile, plan.optimizer):
        return Held(step=True)
    tier = {s.param: s.tier for s in plan.optimizer.states}
    gone = frozenset(x.name for x in profile.layers
                     if x.params and all(tier.get(name) == "nvme" for name in x.param_names()))
    return Held(gone_grads=gone, step=True)
