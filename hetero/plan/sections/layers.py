"""The layers section: with a GPU, each layer's mode (MemFerry: GFGB, DHA, DFGB) and where its gradient goes
(GO-MemFerry's reserve), solved in hetero.plan.gpu_layers; the model's own bytes in host memory. Pure: no torch,
no I/O."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hetero.errors import USAGE, HeteroError
from hetero.plan import gpu_layers, gradient_offload
from hetero.plan.context import Context
from hetero.plan.model import LayerCosts
from hetero.plan.policy import POLICY
from hetero.plan.section import Section, Step, Translation
from hetero.schema.plan import GradPlace, LayerGrad, LayerMode, LayerPlan, Mode, Plan
from hetero.schema.profile import Profile

NO_GPU = "the profile has no GPU: DHA modes and gradient offload need a CUDA device"
ON_GPU = "the optimizer updates parameters on the GPU: every parameter and gradient stays there"


class Layers(Section):
    name, phase = "layers", "whole"

    def solve(self, step: Step) -> list[LayerPlan]:
        """Every layer's mode and gradient place, with the predicted GPU peak within the GPU budget less headroom; at
        most `--reserve` of the gradient bytes kept on the GPU where the fit turned `host_grads` on."""
        ctx, draft = step.ctx, step.draft
        if ctx.gpu is None:
            step.omitted["layers"] = NO_GPU
            return []
        if draft.optimizer is None or draft.optimizer.device == "gpu":
            step.omitted["layers"] = ON_GPU
            return []
        room = int(ctx.gpu_budget_bytes * (1 - POLICY.gpu_headroom))
        reserve = ctx.options.reserve if "host_grads" in step.levers else 1.0
        return gpu_layers.layer_modes(ctx, draft, step.pinned("layers") or {}, step.build, reserve, room)

    def settle(self, ctx: Context, out: Plan) -> Plan:
        """The budget names the size grid the gradient-offload DP solved on (from the model alone)."""
        if not out.layers:
            return out
        grid = gradient_offload.grid_bytes(sum(x.params_bytes for x in ctx.profile.layers), len(ctx.profile.layers))
        return replace(out, budget=replace(out.budget, grad_grid_bytes=grid))

    def pinned(self, profile: Profile, previous: Plan) -> dict[str, LayerPlan]:
        """The earlier plan's pinned layer entries, by name; refused where the profile has no such layer."""
        layers = {e.name: e for e in previous.layers if e.pinned}
        unknown = sorted(set(layers) - {layer.name for layer in profile.layers})
        if unknown:
            raise HeteroError(f"--from plan pins layers the profile does not have: {', '.join(unknown[:5])}",
                              hint="unpin or delete those entries in the old plan, then re-plan", exit_code=USAGE)
        return layers

    def static_bytes(self, profile: Profile, _: Plan, host: str) -> dict[str, int]:
        return {host: model_host_bytes(profile)}

    def choose(self, t: Translation) -> dict[str, Any]:
        """Each layer's mode and gradient place as the plan's entries say (an entry naming no layer is ignored)."""
        n, gpu = len(t.costs.layers), t.profile.machine.gpu is not None
        modes, grads = [LayerMode.GFGB] * n, [LayerGrad.GPU] * n
        for e in t.plan.layers:
            if (i := t.index.get(e.name)) is not None:
                modes[i], grads[i] = _timed_mode(t.costs.layers[i], e, gpu)
        return dict(modes=modes, grads=grads)

    def absent(self) -> list[LayerPlan]:
        return []


def model_host_bytes(profile: Profile) -> int:
    """What host memory holds of the model with the script's own optimizer: its parameters, and without a GPU
    their gradients too."""
    model = sum(x.params_bytes for x in profile.layers)
    return model + (model if profile.machine.gpu is None else 0)


def _timed_mode(layer: LayerCosts, e: LayerPlan, gpu: bool) -> tuple[Mode, GradPlace]:
    """A layer entry's mode and gradient place, refused where the profile has no timing for them (an edited plan
    can ask for DHA on a layer the profiler could not run from host memory)."""
    unknown = gpu and ((e.mode != LayerMode.GFGB and layer.fp_dha_s is None)
                       or (e.mode == LayerMode.DHA and layer.bp_dha_s is None)
                       or (e.grad == LayerGrad.HOST and layer.bp_grad_host_s is None))
    if unknown:
        raise HeteroError(f"layers.{e.name}: mode {e.mode} / grad {e.grad} needs DHA or host-gradient timings the "
                          f"profile does not have", hint=f"set `mode: gfgb, grad: gpu` for {e.name}, or re-profile",
                          exit_code=USAGE)
    return e.mode, e.grad
