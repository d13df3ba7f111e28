"""`hetero plan --from-run`: a profile whose timings are the ones a traced run measured under its plan.

A layer's measured time replaces the profiled time of the mode it ran in (MemFerry's T_FP for a GFGB layer,
T_FP^H for a DHA one, GO's T_GBP for a layer writing gradients to the host), so the other modes keep their
profiled times. The rest of the step (data, loss, zero_grad) is the run's. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import replace

from hetero.errors import USAGE, HeteroError
from hetero.schema.plan import LayerGrad, LayerMode, LayerPlan, Plan
from hetero.schema.profile import Layer, Profile
from hetero.schema.run import Run, RunLayer


def measured_profile(profile: Profile, plan: Plan, run: Run) -> Profile:
    """`profile` with `run`'s timings; `plan` is the plan the run carried out."""
    if run.source.model_fingerprint != profile.model.fingerprint:
        raise HeteroError("the run's model is not the profile's (their fingerprints differ)",
                          hint="re-plan from the profile of the model that ran", exit_code=USAGE)
    measured = {x.name: x for x in run.layers}
    missing = [x.name for x in profile.layers if x.name not in measured]
    if missing:
        raise HeteroError(f"the run measured no layer named {missing[0]} ({len(missing)} of the profile's layers "
                          f"missing): it was recorded at another granularity", hint="profile and run again",
                          exit_code=USAGE)
    entries = {e.name: e for e in plan.layers}
    layers = [_layer(x, measured[x.name], entries.get(x.name)) for x in profile.layers]
    busy = max((max(x.fp_end_s, x.bp_start_s + x.bp_s) for x in layers), default=0.0)
    t = profile.training
    # The simulator takes the rest of the step as iteration - optimizer step - micro-batches x busy: keep the run's.
    training = replace(t, iteration_s=run.timing.other_s + t.optimizer_step_s + t.grad_accumulation * busy,
                       forward_s=run.timing.forward_s, backward_s=run.timing.backward_s)
    # The measured times already include how the run's workers slowed compute: counting it again would be twice.
    cpu = replace(profile.machine.cpu, background_slowdown=None)
    unmeasured = profile.unmeasured | {"machine.cpu.background_slowdown": "re-timed from a run, whose layer times "
                                                                         "include the workers' slowdown"}
    return replace(profile, layers=layers, training=training, machine=replace(profile.machine, cpu=cpu),
                   unmeasured=unmeasured)


def _layer(x: Layer, m: RunLayer, entry: LayerPlan | None) -> Layer:
    mode, grad = (entry.mode, entry.grad) if entry is not None else (LayerMode.GFGB, LayerGrad.GPU)
    fp = {"fp_s": m.fp_s} if mode == LayerMode.GFGB else {"fp_dha_s": m.fp_s}
    if grad == LayerGrad.HOST:  # DHA and host gradients at once: not a mode's time
        bp = {"bp_grad_host_s": m.bp_s} if mode != LayerMode.DHA else {}
    else:
        bp = {"bp_dha_s": m.bp_s} if mode == LayerMode.DHA else {"bp_s": m.bp_s}
    saved = {"saved_bytes": m.saved_bytes} if m.saved_bytes is not None else {}
    return replace(x, fp_end_s=m.fp_end_s, bp_start_s=m.bp_start_s, **fp, **bp, **saved)
