"""MemFerry's modes chosen (`solve`): Algorithm 1 and DFGB's choice (hetero.plan.memferry), then a local search
judged by the simulator, a fit to the GPU budget by the cheapest demotions, and exhaustive search on small models.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from hetero.plan.model import GPU, Choices, Costs, LayerCosts
from hetero.plan.simulate import Result, simulate
from hetero.schema.plan import GradPlace, LayerMode, Mode
from hetero.units import SIZE, short_time

_EPS = 1e-12  # a change must beat float noise to count as an improvement
_PAIRS_UP_TO = 16  # models this small also get two-layer moves and a search from every start
_CHAIN_POINTS = 16  # demotion-chain plans simulated at most (1000-layer plans stay well under a second)
_LEVELS = 12  # memory levels a small model's budget family searches within
from hetero.plan.memferry import MODES, allowed_modes, choose_dfgb, forward_modes


@dataclass(kw_only=True, slots=True)
class Evaluated:
    modes: list[Mode]
    result: Result

    @property
    def time_s(self) -> float:
        return self.result.iteration_s

    @property
    def gpu_bytes(self) -> int:
        return self.result.peak_bytes.get(GPU, 0)


def evaluate(costs: Costs, template: Choices, modes: list[Mode]) -> Evaluated:
    return Evaluated(modes=modes, result=simulate(costs, replace(template, modes=modes), detail=False))


Memo = dict[tuple[Mode, ...], Evaluated]  # one `solve`'s simulations by modes: its searches meet the same plans often


def _evaluated(costs: Costs, template: Choices, modes: list[Mode], memo: Memo) -> Evaluated:
    key = tuple(modes)
    if key not in memo:
        memo[key] = evaluate(costs, template, modes)
    return memo[key]


def bound_s(costs: Costs, template: Choices, modes: list[Mode]) -> float:
    """A lower bound on the simulated iteration: the compute lane's own work, as if nothing ever waited."""
    own = sum(_own_s(layer, modes[i], template.grads[i], costs.has_gpu and not template.params_on_gpu)
              for i, layer in enumerate(costs.layers))
    gaps = sum(layer.fp_gap_s + layer.bp_gap_s for layer in costs.layers)
    updates = sum(u.update_s for per in template.updates for u in per if u.lane < 0)
    return own + gaps + updates + template.step_s + costs.tail_s


def _own_s(layer: LayerCosts, mode: Mode, grad: GradPlace, modes_apply: bool) -> float:
    if not modes_apply:
        return layer.fp_s + layer.bp_time_s(LayerMode.GFGB, grad)
    return (layer.fp_s if mode == LayerMode.GFGB else layer.fp_dha_s) + layer.bp_time_s(mode, grad)


def local_search(costs: Costs, template: Choices, start: Evaluated, fixed: dict[int, Mode], budget_bytes: int,
                 allowed: tuple[Mode, ...] = MODES, max_evals: int | None = None, pairs: bool = True,
                 memo: Memo | None = None) -> Evaluated:
    """First-improvement hill climbing by simulated iteration time within the GPU budget: one layer's mode at a time,
    then (on small models) two layers' at once. Large layers are tried first; a change whose compute alone cannot
    beat the best is not simulated; big models get a bounded number of simulations (a plan found in `memo`, simulated
    before, counts too: the bound keeps the search's length the same with or without one)."""
    layers = costs.layers
    order = sorted((i for i, layer in enumerate(layers) if i not in fixed and len(allowed_modes(layer, allowed)) > 1),
                   key=lambda i: (-layers[i].params_bytes, i))
    search = _Search(costs=costs, template=template, allowed=allowed, budget_bytes=budget_bytes,
                     evals=max_evals if max_evals is not None else max(16, 6000 // max(1, len(layers))),
                     best=start, bound=bound_s(costs, template, start.modes), memo={} if memo is None else memo)
    two = [(i, j) for k, i in enumerate(order) for j in order[k + 1:]] if pairs and len(order) <= _PAIRS_UP_TO else []
    while search.evals > 0 and (any(search.improve((i,)) for i in order) or any(search.improve(p) for p in two)):
        pass
    return search.best


@dataclass(kw_only=True, slots=True)
class _Search:
    costs: Costs
    template: Choices
    allowed: tuple[Mode, ...]
    budget_bytes: int
    evals: int
    best: Evaluated
    bound: float
    memo: Memo

    def improve(self, where: tuple[int, ...]) -> bool:
        """Try every other combination of modes on the layers `where`; take the first that is faster, or as fast
        with less GPU memory (which leaves the budget chain more room)."""
        layers, grads, modes = self.costs.layers, self.template.grads, self.best.modes
        tol = _EPS * max(1.0, self.best.time_s)
        for combo in itertools.product(*(allowed_modes(layers[i], self.allowed) for i in where)):
            if self.evals <= 0 or any(m == modes[i] for i, m in zip(where, combo)):
                continue
            bound = self.bound + sum(_own_s(layers[i], m, grads[i], True) - _own_s(layers[i], modes[i], grads[i], True)
                                     for i, m in zip(where, combo))
            if bound > self.best.time_s + tol:
                continue
            self.evals -= 1
            trial = list(modes)
            for i, m in zip(where, combo):
                trial[i] = m
            e = _evaluated(self.costs, self.template, trial, self.memo)
            if e.gpu_bytes <= self.budget_bytes and (e.time_s < self.best.time_s - tol or (
                    e.time_s <= self.best.time_s + tol and e.gpu_bytes < self.best.gpu_bytes)):
                self.best, self.bound = e, bound
                return True
        return False


def fit_budget(costs: Costs, template: Choices, best: Evaluated, fixed: dict[int, Mode], budget_bytes: int,
               allowed: tuple[Mode, ...] = MODES, memo: Memo | None = None) -> Evaluated | None:
    """The fastest plan within `budget_bytes` among a family of plans that does not depend on the budget: a chain
    that demotes GPU-resident layers to DHA one at a time, cheapest slowdown per byte first, and (on small models)
    a local search within each of _LEVELS memory levels spread over the chain, from the chain's plan below it, so a
    larger budget can never give a slower plan. None when no plan of the family fits."""
    chosen, memo = None, {} if memo is None else memo
    for e in _family(costs, template, best, fixed, allowed, memo):
        if isinstance(e, tuple):  # (modes, lower bound) of a big model's chain plan
            if chosen is not None and e[1] >= chosen.time_s:
                continue
            e = _evaluated(costs, template, e[0], memo)
        if e.gpu_bytes <= budget_bytes and (chosen is None or e.time_s < chosen.time_s):
            chosen = e
    return chosen


def _family(costs: Costs, template: Choices, best: Evaluated, fixed: dict[int, Mode], allowed: tuple[Mode, ...],
            memo: Memo):
    """The family's plans, lazily: evaluated, or (modes, lower bound) for a big model's chain, which is sampled at
    most _CHAIN_POINTS times."""
    layers = costs.layers
    movable = [i for i, m in enumerate(best.modes) if m != LayerMode.DHA and i not in fixed
               and LayerMode.DHA in allowed_modes(layers[i], allowed)]
    movable.sort(key=lambda i: (_demotion_cost_s(layers[i], best.modes[i]) / layers[i].params_bytes, i))
    chain, bounds = [best.modes], [bound_s(costs, template, best.modes)]
    for i in movable:
        prev = chain[-1]
        chain.append([*prev[:i], LayerMode.DHA, *prev[i + 1:]])
        grad = template.grads[i]
        bounds.append(bounds[-1] - _own_s(layers[i], prev[i], grad, True)
                      + _own_s(layers[i], LayerMode.DHA, grad, True))
    yield best
    if len(layers) > _PAIRS_UP_TO:
        step = max(1, -(-len(chain) // _CHAIN_POINTS))
        yield from ((chain[k], bounds[k]) for k in sorted(set(range(step, len(chain), step)) | {len(chain) - 1}) if k)
        return
    plans = [best] + [_evaluated(costs, template, m, memo) for m in chain[1:]]
    yield from plans[1:]
    low, high = plans[-1].gpu_bytes, best.gpu_bytes
    for level in sorted({low + (high - low) * j // _LEVELS for j in range(1, _LEVELS)}):
        start = next((e for e in plans if e.gpu_bytes <= level), None)
        if start is not None:
            yield local_search(costs, template, start, fixed, level, allowed, memo=memo)


def _demotion_cost_s(layer: LayerCosts, mode: Mode) -> float:
    backward = max(0.0, layer.bp_dha_s - layer.bp_s)
    return backward if mode == LayerMode.DFGB else backward + max(0.0, layer.fp_dha_s - layer.fp_s)


def exhaustive(costs: Costs, template: Choices, budget_bytes: int, allowed: tuple[Mode, ...] = MODES,
               fixed: dict[int, Mode] | None = None) -> Evaluated | None:
    """The optimum over every combination of modes (3^L plans): for measuring the heuristics on small models."""
    fixed = fixed or {}
    options = [(fixed[i],) if i in fixed else allowed_modes(layer, allowed) for i, layer in enumerate(costs.layers)]
    best = None
    for combo in itertools.product(*options):
        e = evaluate(costs, template, list(combo))
        if e.gpu_bytes <= budget_bytes and (best is None or e.time_s < best.time_s - _EPS):
            best = e
    return best


def solve(costs: Costs, template: Choices, fixed: dict[int, Mode], device_bytes: int, budget_bytes: int,
          allowed: tuple[Mode, ...] = MODES) -> tuple[Evaluated | None, list[str]]:
    """Alg. 1, then greedy DFGB; local search from that plan and from uniform ones (all GFGB, all DFGB) within the
    whole device, then the budget chain. Returns the chosen plan (None when nothing fits `budget_bytes`) and a
    `why` per layer."""
    alg1 = forward_modes(costs.layers, fixed, allowed)
    memo: Memo = {}
    first = _evaluated(costs, template, alg1.modes, memo)
    dfgb = choose_dfgb(costs, alg1.modes, first.result, device_bytes - first.gpu_bytes, fixed, allowed)
    paper = _evaluated(costs, template, dfgb.modes, memo)
    uniform = ([fixed.get(i, mode if mode in allowed_modes(x, allowed) else LayerMode.GFGB)
                for i, x in enumerate(costs.layers)] for mode in (LayerMode.GFGB, LayerMode.DFGB))
    starts = [paper] + [_evaluated(costs, template, modes, memo) for modes in uniform]
    if len(costs.layers) > _PAIRS_UP_TO:  # big models: one search, from the best start
        starts = [min(starts, key=lambda e: (e.gpu_bytes > device_bytes, e.time_s))]
    searched = min((local_search(costs, template, m, fixed, device_bytes, allowed, memo=memo) for m in starts),
                   key=lambda e: (e.gpu_bytes > device_bytes, e.time_s))
    chosen = fit_budget(costs, template, searched, fixed, budget_bytes, allowed, memo)
    why = [d or a for a, d in zip(alg1.why, dfgb.why)]
    if chosen is None:
        return None, why
    for i, mode in enumerate(chosen.modes):
        if mode != searched.modes[i]:
            why[i] = (f"{searched.modes[i]} -> dha to fit the GPU budget {SIZE.format_short(budget_bytes)}: the plan "
                      f"needs {SIZE.format_short(chosen.gpu_bytes)}, iteration {short_time(searched.time_s)} -> "
                      f"{short_time(chosen.time_s)}")
        elif mode != dfgb.modes[i]:
            why[i] = (f"local search: {dfgb.modes[i]} -> {mode}, simulated iteration {short_time(paper.time_s)} "
                      f"(Alg. 1 + DFGB) -> {short_time(searched.time_s)}")
    return chosen, why
