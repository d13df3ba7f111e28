"""The update_in_backward section: the script's own Adam(W) updates each parameter as soon as backward makes its
gradient final, and frees it (a lever of the DRAM-budget fit, hetero.plan.fit). Pure: no torch, no I/O."""

from __future__ import annotations

from hetero.plan.backward import Held, peak_bytes
from hetero.plan.context import Context
from hetero.plan.section import HostPeak, Section, Step
from hetero.schema.plan import Plan, UpdateInBackward
from hetero.schema.profile import Profile
from hetero.units import SIZE

GRADS_FREED = "gradients freed in backward"  # its host-memory account entry (hetero.plan.footprint)


def solve(step: Step) -> UpdateInBackward | None:
    """Only for the script's own optimizer: hetero's places its updates itself."""
    wanted = "in_backward" in step.levers and step.draft.optimizer is None
    return _in_backward(step.ctx) if wanted else None


def grads_freed_in_backward(profile: Profile) -> int:
    """What updating in backward takes off the peak: the gradients that would coexist with the saved activations at
    their highest, or with each other in the optimizer's step, less the largest parameter's gradient and update
    temporaries, which now fall inside backward (hetero.plan.backward; with blocks recomputed, the recompute
    section's entry counts what they save with the gradients freed)."""
    out = profile.training.output_bytes
    return peak_bytes(profile.layers, Held(step=True), out) - peak_bytes(profile.layers, Held(in_backward=True), out)


def host_entries(profile: Profile, plan: Plan, _: HostPeak) -> dict[str, int]:
    return {GRADS_FREED: -grads_freed_in_backward(profile) if plan.update_in_backward is not None else 0}


def _in_backward(ctx: Context) -> UpdateInBackward:
    freed = grads_freed_in_backward(ctx.profile)
    return UpdateInBackward(kind=ctx.profile.training.optimizer, why=(
        f"the script's {ctx.profile.training.optimizer} updates each parameter as soon as backward makes its gradient "
        f"final and frees it: the process holds {SIZE.format_short(freed)} less at its peak, for no time (the same "
        "updates, earlier); the profile saw one backward per step and no clipping, and the script must not read "
        "`.grad` between backward and step (it is None then)"))


SECTION = Section(name="update_in_backward", phase="draft", solve=solve, host_bytes=host_entries)
