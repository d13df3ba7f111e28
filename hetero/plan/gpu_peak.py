"""A GPU plan's peak: what the plan keeps on the GPU, counted in each phase of a step, plus what plain training's
measured peak holds beyond the same count. The one rule the GPU fit (hetero.plan.gpu_fit, hetero.plan.gpu_layers)
and the plan's prediction (`predicted.peak.gpu` and its account) count by.

- forward, at its end: saved activations and the model's output (with micro-batches, earlier ones' gradients too);
- backward: saved activations and GPU-kept gradients at their highest (hetero.plan.backward), and the largest host
  gradient backward makes on the GPU before copying it down;
- step: every gradient kept on the GPU, and the scratch of each Adam that steps there.

Each phase also holds the resident weights (all but DHA layers') and the Adam states on the GPU. Host gradients
leave as backward makes them; GPU ones stay until the script frees them after the step. Adam's states and scratch
count only where Adam stays on the GPU (the script's, or `optimizer.device: gpu`), the scratch by
`ScriptOptimizer.implementation`. Tiered activations count at most the simulator's peak of them on the GPU.

The prediction is the highest phase plus plain training's slack: its measured reserved peak less the same count of
plain training, so that a plan that moves nothing is predicted as measured (without a measurement, the count alone).
Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from hetero.plan import backward
from hetero.plan.model import GPU
from hetero.plan.simulate import Result
from hetero.schema.plan import LayerGrad, LayerMode, Plan
from hetero.schema.profile import Profile, ScriptOptimizer

SLACK = "plain training's reserved peak beyond its count (measured)"
WEIGHTS = "weights on the gpu"
STATES = "adam states on the gpu"
EARLIER_GRADS = "gradients of earlier micro-batches"
EVICTED = "activations evicted to host memory"
FORWARD_SAVED = "forward: saved activations and the output"
BACKWARD_SAVED = "backward: saved activations and gradients at their highest"
TRANSIENT_GRAD = "backward: a host gradient made on the gpu first (the largest)"
STEP_GRADS = "step: gradients on the gpu"
SCRATCH = "step: adam's scratch"

Adam = Literal["script", "gpu", "off"]


@dataclass(frozen=True, slots=True)
class OnGpu:
    """What a plan keeps on the GPU, in the count's terms; the default is plain training."""

    dha: frozenset[str] = frozenset()  # layers whose weights are read from host memory
    host_grads: frozenset[str] = frozenset()  # layers whose gradients backward writes to host memory
    adam: Adam = "script"  # the script's own Adam(W) on the GPU, the plan's there (`gpu`), or the plan's off it
    hetero_states_bytes: int = 0  # states the plan's own optimizer keeps on the GPU (`adam: gpu`)
    in_backward: bool = False  # the script's Adam updates each parameter as backward makes its gradient final
    saved_cap: int | None = None  # tiering: the most saved activation bytes on the GPU at once (None: untiered)


PLAIN = OnGpu()


@dataclass(frozen=True, slots=True)
class Phases:
    """A plan's count of GPU bytes in each phase of a step, by what makes it up (negative: taken off)."""

    forward: Mapping[str, int]
    backward: Mapping[str, int]
    step: Mapping[str, int]

    @property
    def peak(self) -> Mapping[str, int]:
        """The items of the phase whose count is highest (the earliest of equals)."""
        return max((self.forward, self.backward, self.step), key=lambda items: sum(items.values()))

    @property
    def peak_bytes(self) -> int:
        return sum(self.peak.values())


def on_gpu(plan: Plan, result: Result, hetero_states_bytes: int = 0) -> OnGpu:
    """What `plan` keeps on the GPU; `result`: its simulated iteration (tiering's peak of saved activations on the
    GPU); `hetero_states_bytes`: the states its own optimizer keeps on the GPU (`optimizer.device: gpu`). Layer
    modes and gradient places apply only with the optimizer off the GPU, as the runtime carries them out."""
    opt = plan.optimizer
    adam: Adam = "script" if opt is None else ("gpu" if opt.device == "gpu" else "off")
    off = adam == "off"
    tiered = plan.activations is not None and plan.activations.fast == GPU
    return OnGpu(dha=frozenset(e.name for e in plan.layers if off and e.mode == LayerMode.DHA),
                 host_grads=frozenset(e.name for e in plan.layers if off and e.grad == LayerGrad.HOST),
                 adam=adam, hetero_states_bytes=hetero_states_bytes if adam == "gpu" else 0,
                 in_backward=plan.update_in_backward is not None,
                 saved_cap=result.act_peak_bytes if tiered else None)


def phases(profile: Profile, held: OnGpu) -> Phases:
    """The count of each phase (module docstring)."""
    layers, out = profile.layers, profile.training.output_bytes
    common = {WEIGHTS: sum(x.params_bytes for x in layers if x.name not in held.dha), STATES: _states_bytes(profile, held)}
    kept = sum(x.params_bytes for x in layers if x.name not in held.host_grads)
    accumulating = profile.training.grad_accumulation > 1 and not held.in_backward
    earlier = {EARLIER_GRADS: kept if accumulating else 0}
    saved = sum(x.saved_bytes for x in layers)
    capped = saved if held.saved_cap is None else min(saved, held.saved_cap)
    gone = frozenset(x.name for x in layers) if accumulating else held.host_grads  # held whole as `earlier`
    swept = backward.Held(gone_grads=gone, in_backward=held.in_backward)
    sweep = backward.peak_bytes(layers, swept, out)
    tiered = backward.peak_bytes(layers, replace(swept, saved_cap=held.saved_cap), out)
    return Phases(
        forward=common | earlier | {FORWARD_SAVED: saved + out, EVICTED: capped - saved},
        backward=common | earlier | {BACKWARD_SAVED: sweep, EVICTED: tiered - sweep,
                                     TRANSIENT_GRAD: _transient_grad_bytes(profile, held)},
        step=common | {STEP_GRADS: 0 if held.in_backward else kept,
                       SCRATCH: 0 if held.in_backward else _scratch_bytes(profile, held)})


def slack_bytes(profile: Profile) -> int:
    """Plain training's measured reserved peak less its count (0 where the profile measured none)."""
    measured = profile.memory.gpu_reserved_peak_bytes if profile.memory is not None else None
    return measured - phases(profile, PLAIN).peak_bytes if measured else 0


def contributors(profile: Profile, held: OnGpu) -> dict[str, int]:
    """The predicted GPU peak by what makes it up: plain training's slack and the highest phase's items (negative
    items are what the plan takes off). Its sum is the prediction."""
    items = {SLACK: slack_bytes(profile)} | dict(phases(profile, held).peak)
    return {what: b for what, b in items.items() if b}


def predicted_bytes(profile: Profile, held: OnGpu) -> int:
    """The predicted GPU peak: the sum of `contributors`."""
    return sum(contributors(profile, held).values())


def _adams(profile: Profile) -> list[tuple[ScriptOptimizer | None, list[int]]]:
    """The script's Adam(W) optimizers with the bytes of each parameter they update (None: a profile that lists
    none, whose one optimizer updates every layer)."""
    training = profile.training
    if not training.optimizers:
        return [(None, [b for x in profile.layers for b in x.params.values()])] \
            if training.optimizer in ("adam", "adamw") else []
    return [(o, [b for x in profile.layers if x.model in (None, o.model) for b in x.params.values()])
            for o in training.optimizers if o.kind != "other"]


def _states_bytes(profile: Profile, held: OnGpu) -> int:
    """exp_avg and exp_avg_sq of the script's Adam in its parameters' dtype, where the script keeps them (plain
    training, or an optimizer the plan leaves to the script), and the plan's own optimizer's on the GPU."""
    own = [params for o, params in _adams(profile) if held.adam == "script" or (o is not None and o.kept)]
    return held.hetero_states_bytes + 2 * sum(sum(params) for params in own)


def _scratch_bytes(profile: Profile, held: OnGpu) -> int:
    """The step's scratch of each Adam that steps on the GPU: the script's (also under `optimizer.device: gpu`,
    where the runtime leaves the script's optimizer be), or one the plan leaves to the script."""
    stepping = [(o, params) for o, params in _adams(profile) if held.adam != "off" or (o is not None and o.kept)]
    return sum(backward.step_scratch_bytes(o.implementation if o is not None else "single", params)
               for o, params in stepping)


def _transient_grad_bytes(profile: Profile, held: OnGpu) -> int:
    """Backward writes a Linear layer's gradients into host memory itself (hetero.run.grad_offload); any other
    layer's host gradient is made on the GPU and copied down, one parameter at a time."""
    return max((b for x in profile.layers if x.name in held.host_grads and x.type != "Linear"
                for b in x.params.values()), default=0)
