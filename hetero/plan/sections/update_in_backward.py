"""The update_in_backward section: the script's own Adam(W) updates each parameter as soon as backward makes its
gradient final, and frees it (a lever of the DRAM-budget fit, hetero.plan.fit). Pure: no torch, no I/O."""

from __future__ import annotations

from hetero.plan.in_backward import grads_freed_in_backward
from hetero.plan.section import HostPeak, Section, Step
from hetero.schema.plan import Plan, UpdateInBackward
from hetero.schema.profile import Profile
from hetero.units import SIZE

GRADS_FREED = "gradients freed in backward"  # its host-memory account entry (hetero.plan.footprint)


class UpdatesInBackward(Section):
    name = "update_in_backward"

    def solve(self, step: Step) -> UpdateInBackward | None:
        """Only for the script's own optimizer: hetero's places its updates itself."""
        wanted = "in_backward" in step.levers and step.draft.optimizer is None
        return section(step.ctx.profile) if wanted else None

    def host_bytes(self, profile: Profile, plan: Plan, _: HostPeak) -> dict[str, int]:
        if plan.update_in_backward is None:
            return {}
        return {GRADS_FREED: -grads_freed_in_backward(profile)}


def section(profile: Profile) -> UpdateInBackward:
    """The section for a profile whose script allows it (`refused`)."""
    freed = grads_freed_in_backward(profile)
    return UpdateInBackward(kind=profile.training.optimizer, why=(
        f"the script's {profile.training.optimizer} updates each parameter as soon as backward makes its gradient "
        f"final and frees it: the process holds {SIZE.format_short(freed)} less at its peak, for no time (the same "
        "updates, earlier); the profile saw one backward per step and no clipping, and the script must not read "
        "`.grad` between backward and step (it is None then)"))
