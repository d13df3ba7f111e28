"""With a GPU: where each layer's gradient goes (GO-MemFerry's reserve) and which mode each layer runs in
(MemFerry's Algorithm 1, DFGB and the simulator-judged search), within the GPU budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hetero.plan import gpu_peak, gradient_offload, memferry, memferry_solve
from hetero.plan.context import Context
from hetero.plan.model import GPU, Choices, Costs
from hetero.plan.simulate import simulate
from hetero.schema.plan import LayerGrad, LayerMode, LayerPlan, Mode, Plan

_LEAST_FIRST = (LayerMode.DHA, LayerMode.DFGB, LayerMode.GFGB)  # by what a layer holds on the GPU, least first


def layer_modes(ctx: Context, draft: Plan, kept: dict[str, LayerPlan], build: Callable[[Plan], tuple[Costs, Choices]],
                reserve: float = 1.0, budget_bytes: int = 0) -> list[LayerPlan]:
    """Every layer's GPU mode and gradient place under `draft`, an optimizer off the GPU (MemFerry, GO-MemFerry):
    at most `reserve` of the gradient bytes kept on the GPU, and the predicted GPU peak (hetero.plan.gpu_peak)
    within `budget_bytes`. `kept`: the entries pinned in an earlier plan, by layer; `build`: a plan in the
    simulator's terms (hetero.plan.choices.build)."""
    layers = ctx.profile.layers
    costs, template = build(draft)
    items = [gradient_offload.GradItem(name=c.name, size_bytes=c.params_bytes,
                                       pinned=kept[c.name].grad if c.name in kept else None,
                                       gain_s=None if c.bp_grad_host_s is None else c.bp_grad_host_s - c.bp_s)
             for c in costs.layers]
    go = gradient_offload.offload(items, reserve)
    template.grads = [LayerGrad.GPU if keep else LayerGrad.HOST for keep in go.keep]
    fixed = {i: kept[x.name].mode for i, x in enumerate(layers) if x.name in kept}
    counted = counted_budget_bytes(ctx, draft, template.grads, build, budget_bytes)
    device = counted + ctx.gpu_device_bytes - ctx.gpu_budget_bytes  # the whole device, in the same terms
    chosen, why = memferry_solve.solve(costs, template, fixed, device, counted)
    if chosen is None:  # nothing fits: the placement holding the least on the GPU, for the caller to weigh
        chosen = _fewest_bytes(costs, template, fixed)
        why = [f"no placement fits the GPU budget: the one holding the least there ({mode})" for mode in chosen.modes]
    return [kept.get(x.name) or LayerPlan(name=x.name, mode=chosen.modes[i], grad=template.grads[i],
                                         why=f"{why[i]}; grad: {go.why[i]}")
            for i, x in enumerate(layers)]


def counted_budget_bytes(ctx: Context, draft: Plan, grads: list[LayerGrad],
                         build: Callable[[Plan], tuple[Costs, Choices]], budget_bytes: int) -> int:
    """`budget_bytes` of predicted peak in the simulator's count of GPU bytes, which MemFerry's search compares: both
    count a resident layer's weights alike, so for these gradient places (`grads`, by layer) what the prediction
    adds to the count is the same whatever the modes, and is found on the plan with every layer resident."""
    probe = replace(draft, layers=[LayerPlan(name=x.name, mode=LayerMode.GFGB, grad=g)
                                   for x, g in zip(ctx.profile.layers, grads)])
    result = simulate(*build(probe))
    predicted = gpu_peak.predicted_bytes(ctx.profile, gpu_peak.on_gpu(probe, result))
    return budget_bytes - predicted + result.peak_bytes.get(GPU, 0)


def _fewest_bytes(costs: Costs, template: Choices, fixed: dict[int, Mode]) -> memferry_solve.Evaluated:
    modes = [fixed.get(i, next(m for m in _LEAST_FIRST if m in memferry.allowed_modes(c)))
             for i, c in enumerate(costs.layers)]
    return memferry_solve.evaluate(costs, template, modes)
