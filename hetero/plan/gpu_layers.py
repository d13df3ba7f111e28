"""With a GPU: where each layer's gradient goes (GO-MemFerry's reserve) and which mode each layer runs in
(MemFerry's Algorithm 1, DFGB and the simulator-judged search), within the GPU budget."""

from __future__ import annotations

from dataclasses import replace

from hetero.plan import gradient_offload, memferry, memferry_solve
from hetero.plan.choices import build
from hetero.plan.context import Context
from hetero.plan.model import Choices, Costs
from hetero.plan.pins import Pins, pinned_field
from hetero.schema.plan import LayerPlan, Plan

NO_GPU = "the profile has no GPU: DHA modes and gradient offload need a CUDA device"


def layer_modes(ctx: Context, draft: Plan, pins: Pins, reserve: float = 1.0, budget_bytes: int = 0) -> Plan:
    """`draft` with every layer's GPU mode and gradient place (MemFerry, GO-MemFerry): at most `reserve` of the
    gradient bytes kept on the GPU, and the simulator's count of GPU bytes within `budget_bytes` (the GPU budget in
    the count's terms, hetero.plan.plain). An optimizer on the GPU leaves every layer where the script puts it."""
    layers = ctx.profile.layers
    if ctx.gpu is None:
        return replace(draft, omitted=draft.omitted | {"layers": NO_GPU})
    if draft.optimizer is None or draft.optimizer.device == "gpu":
        return replace(draft, layers=[], omitted=draft.omitted | {
            "layers": "the optimizer updates parameters on the GPU: every parameter and gradient stays there"})
    costs, template = build(ctx.profile, draft)
    items = [gradient_offload.GradItem(name=c.name, size_bytes=c.params_bytes,
                                       pinned=pinned_field(pins, c.name, "grad"),
                                       gain_s=None if c.bp_grad_host_s is None else c.bp_grad_host_s - c.bp_s)
             for c in costs.layers]
    go = gradient_offload.offload(items, reserve)
    template.grads = ["gpu" if keep else "host" for keep in go.keep]
    fixed = {i: pins.layers[x.name].mode for i, x in enumerate(layers) if x.name in pins.layers}
    device = budget_bytes + ctx.gpu_device_bytes - ctx.gpu_budget_bytes  # the whole device, in the same terms
    chosen, why = memferry_solve.solve(costs, template, fixed, device, budget_bytes)
    if chosen is None:  # nothing fits: the placement holding the least on the GPU, for the caller to weigh
        chosen = _fewest_bytes(costs, template, fixed)
        why = [f"no placement fits the GPU budget: the one holding the least there ({mode})" for mode in chosen.modes]
    entries = [pins.layers.get(x.name) or LayerPlan(name=x.name, mode=chosen.modes[i], grad=template.grads[i],
                                                  why=f"{why[i]}; grad: {go.why[i]}")
               for i, x in enumerate(layers)]
    return replace(draft, layers=entries, budget=replace(draft.budget, grad_grid_bytes=go.grid_bytes))


def _fewest_bytes(costs: Costs, template: Choices, fixed: dict[int, str]) -> memferry_solve.Evaluated:
    modes = [fixed.get(i, next(m for m in ("dha", "dfgb", "gfgb") if m in memferry.allowed_modes(c)))
             for i, c in enumerate(costs.layers)]
    return memferry_solve.evaluate(costs, template, modes)
