"""With a GPU: where each layer's gradient goes (GO-MemFerry's reserve) and which mode each layer runs in
(MemFerry's Algorithm 1, DFGB and the simulator-judged search), within the GPU budget."""

from __future__ import annotations

from dataclasses import replace

from hetero.errors import USAGE, HeteroError
from hetero.plan import gradient_offload, memferry, memferry_solve
from hetero.plan.choices import build
from hetero.plan.context import Context
from hetero.plan.model import GPU, Choices, Costs
from hetero.plan.pins import Pins, pinned_field
from hetero.plan.simulate import simulate
from hetero.schema.plan import LayerPlan, Plan
from hetero.units import SIZE

NO_GPU = "the profile has no GPU: DHA modes and gradient offload need a CUDA device"


def layer_modes(ctx: Context, draft: Plan, pins: Pins) -> Plan:
    """`draft` with every layer's GPU mode and gradient place (MemFerry, GO-MemFerry)."""
    layers = ctx.profile.layers
    if ctx.gpu is None:
        return replace(draft, omitted=draft.omitted | {"layers": NO_GPU})
    if draft.optimizer is None or draft.optimizer.device == "gpu":
        reason = "the optimizer updates parameters on the GPU: every parameter and gradient stays there"
        out = replace(draft, layers=[pins.layers.get(x.name) or LayerPlan(name=x.name, mode="gfgb", grad="gpu",
                                                                          why=reason) for x in layers])
        _check_fits(ctx, out)
        return out
    costs, template = build(ctx.profile, draft)
    items = [gradient_offload.GradItem(name=c.name, size_bytes=c.params_bytes,
                                       pinned=pinned_field(pins, c.name, "grad"),
                                       gain_s=None if c.bp_grad_host_s is None else c.bp_grad_host_s - c.bp_s)
             for c in costs.layers]
    go = gradient_offload.offload(items, ctx.options.reserve)
    template.grads = ["gpu" if keep else "host" for keep in go.keep]
    fixed = {i: pins.layers[x.name].mode for i, x in enumerate(layers) if x.name in pins.layers}
    chosen, why = memferry_solve.solve(costs, template, fixed, ctx.device_bytes, ctx.budget_bytes)
    if chosen is None:
        _too_small(ctx, costs, template)
    entries = [pins.layers.get(x.name) or LayerPlan(name=x.name, mode=chosen.modes[i], grad=template.grads[i],
                                                  why=f"{why[i]}; grad: {go.why[i]}")
               for i, x in enumerate(layers)]
    return replace(draft, layers=entries, budget=replace(draft.budget, grad_grid_bytes=go.grid_bytes))


def _check_fits(ctx: Context, out: Plan) -> None:
    used = simulate(*build(ctx.profile, out)).peak_bytes.get(GPU, 0)
    if used > ctx.budget_bytes:
        raise HeteroError(f"keeping every parameter, gradient and state on the GPU needs {SIZE.format_short(used)}, "
                          f"over the GPU budget {SIZE.format_short(ctx.budget_bytes)}",
                          hint="use --optimizer-device host (or axdimm) so MemFerry can offload", exit_code=USAGE)


def _too_small(ctx: Context, costs: Costs, template: Choices) -> None:
    fewest = [next((m for m in ("dha", "dfgb", "gfgb") if m in memferry.allowed_modes(c))) for c in costs.layers]
    least = memferry_solve.evaluate(costs, template, fewest).gpu_bytes
    raise HeteroError(f"the GPU budget {SIZE.format_short(ctx.budget_bytes)} is too small: even with every layer "
                      f"in host memory the plan needs {SIZE.format_short(least)} (kept gradients and activations)",
                      hint=f"use --gpu-memory {SIZE.format_short(least, 3)} or more, or a lower --reserve",
                      exit_code=USAGE)
