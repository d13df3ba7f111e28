"""Updates in backward as a lever of the DRAM-budget fit (hetero.plan.fit; the plan's section:
hetero.plan.sections.update_in_backward): whether the script allows them, and what they take off the peak.
Pure: no torch, no I/O."""

from __future__ import annotations

from hetero.plan.backward import Held, peak_bytes
from hetero.schema.profile import Profile


def refused(profile: Profile, ranks: int, optimizer_device: str | None = None) -> str:
    """Why the script's updates cannot move into backward ('' where they can): its optimizer, how it steps, `ranks`
    processes, or `--optimizer-device` giving the optimizer to hetero."""
    training = profile.training
    if training.optimizer == "none":
        return "the script updates its parameters itself, without a torch.optim optimizer"
    if training.optimizer == "other":
        return "the script's optimizer is not Adam(W)"
    if training.updates_wait:
        return training.updates_wait
    if training.edits_grads:
        return "the script changes the gradients after backward (clipping, unscaling)"
    if training.grad_accumulation > 1:
        return f"the script accumulates {training.grad_accumulation} backward passes per step"
    if ranks > 1:
        return f"{ranks} ranks all-reduce their gradients"
    if optimizer_device is not None:
        return f"--optimizer-device {optimizer_device} gives the optimizer to hetero"
    return ""


def grads_freed_in_backward(profile: Profile) -> int:
    """What updating in backward takes off the peak: the gradients that would coexist with the saved activations at
    their highest, or with each other in the optimizer's step, less the largest parameter's gradient and the update's
    temporaries, which now fall inside backward (hetero.plan.backward; with blocks recomputed, the recompute
    section's entry counts what they save with the gradients freed)."""
    out = profile.training.output_bytes
    return peak_bytes(profile.layers, Held(step=True), out) - peak_bytes(profile.layers, Held(in_backward=True), out)
