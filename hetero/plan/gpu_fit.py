"""With a GPU: plain training first, and a mechanism only where it is needed to fit the GPU budget or lowers the
predicted iteration. The candidates are combinations of three levers, each simulated as a whole plan:

- `offload`: Adam's states and updates leave the GPU for the host or an AXDIMM, overlapped with backward, and
  MemFerry places each layer's parameters (GFGB, DHA, DFGB) within the budget;
- `host_grads`: with `offload`, GO-MemFerry's reserve: backward writes the gradients beyond the reserve's share
  straight to pinned host memory;
- `tiering`: saved activations wait in host memory between each layer's forward and backward (TierTrain).

Predictions are anchored on plain training as profiled: the GPU peak by hetero.plan.gpu_peak, the iteration by
hetero.plan.plain. Of the plans that fit the budget the fastest wins, but one within `TIE` of it with fewer levers
wins instead, so plain training stays plain unless a lever pays clearly. Pure: `solve` builds and simulates each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import combinations

from hetero.errors import USAGE, HeteroError
from hetero.plan.model import GPU
from hetero.plan.policy import POLICY
from hetero.schema.plan import Plan
from hetero.units import SIZE, short_time

LEVERS = ("offload", "host_grads", "tiering")
NEEDS = {"host_grads": "offload"}
REFITS = 4  # searches of a candidate's layers, each for a budget tighter by the last one's overshoot
TIE = 0.02  # a lever must shorten the predicted iteration by more than this share to be worth its risk
NAMES = {"offload": "the optimizer's states and updates off the GPU",
         "host_grads": "gradients beyond the reserve written to host memory",
         "tiering": "saved activations evicted to host memory"}


@dataclass(frozen=True, slots=True)
class Candidate:
    levers: frozenset[str]
    plan: Plan | None  # None: no plan with these levers fits the device (`refusal` says why)
    refusal: str = ""

    @property
    def peak_bytes(self) -> int:
        return self.plan.predicted.peak_bytes[GPU] if self.plan is not None else 1 << 62

    @property
    def iteration_s(self) -> float:
        return self.plan.predicted.iteration_s if self.plan is not None else float("inf")


def available(ctx, pins) -> tuple[list[str], frozenset[str], dict[str, str]]:
    """The levers these options allow, those they (or pinned entries of an earlier plan) force, and why each
    unusable one is not allowed."""
    o, training = ctx.options, ctx.profile.training
    why: dict[str, str] = {}
    if training.optimizer == "other":
        why["offload"] = "the script's optimizer is not Adam(W) of the model's parameters without amsgrad"
    elif ctx.device in (None, "gpu"):
        why["offload"] = f"--optimizer-device {o.optimizer_device}"
    if "offload" in why:
        why["host_grads"] = "gradients reach the host only for an optimizer there"
    if ctx.slow is None:
        why["tiering"] = f"the profile has no tier slower than {ctx.fast} with measured transfer times"
    elif "layers" in ctx.profile.unmeasured:
        why["tiering"] = ctx.profile.unmeasured["layers"]
    forced = set()
    pinned_offload = pins.get("optimizer") is not None or pins.get("layers")
    if (o.optimizer_device in ("host", "axdimm") or o.emulate or pinned_offload) and "offload" not in why:
        forced.add("offload")
    if (o.tier_activations or pins.get("activations")) and "tiering" not in why:
        forced.add("tiering")
    return [x for x in LEVERS if x not in why], frozenset(forced), why


def fit(ctx, pins, solve: Callable[[frozenset[str], int], Plan]) -> Plan:
    """The plan for a GPU profile: see the module. `solve(levers, budget_bytes)` plans with the levers for a GPU
    budget. HeteroError (exit 2) when no candidate fits the budget."""
    levers, forced, unusable = available(ctx, pins)
    seen: dict[frozenset[str], Candidate] = {}
    for k in range(len(levers) + 1):
        for combo in combinations(levers, k):
            chosen = frozenset(combo)
            if forced - chosen or any(x in chosen and NEEDS[x] not in chosen for x in NEEDS):
                continue
            seen[chosen] = candidate(ctx.gpu_budget_bytes, chosen, solve)
    budget = ctx.gpu_budget_bytes
    fitting = [c for c in seen.values() if c.plan is not None and c.peak_bytes <= room_bytes(c, budget)]
    if not fitting:
        raise _too_small(ctx, seen, unusable)
    fastest = min(c.iteration_s for c in fitting)
    best = min(fitting, key=lambda c: (c.iteration_s > fastest * (1 + TIE), len(c.levers), c.iteration_s))
    return _explained(ctx, best, seen, len(fitting), unusable)


def candidate(budget: int, levers: frozenset[str], solve: Callable[[frozenset[str], int], Plan]) -> Candidate:
    """The plan with `levers` whose prediction fits `budget`, where one does. MemFerry searches in the simulator's
    count (hetero.plan.gpu_layers.counted_budget_bytes), inexact where tiered evictions shift with the modes, so a
    plan over the budget is searched again for a budget tighter by its overshoot, up to REFITS times."""
    searched, best = budget, None
    for _ in range(REFITS):
        try:
            plan = solve(levers, searched)
        except HeteroError as e:  # MemFerry found no placement within the device: names its least need
            return best or Candidate(levers, None, e.message)
        found = Candidate(levers, plan)
        over = found.peak_bytes - room_bytes(found, budget)
        if best is None or found.peak_bytes < best.peak_bytes:
            best = found
        if over <= 0 or "offload" not in levers:  # only MemFerry's search places by the budget
            return found
        searched -= over
    return best


def room_bytes(c: Candidate, budget: int) -> int:
    """The most a candidate's predicted peak may be: plain training's measured peak is what it is; a prediction
    keeps the policy's GPU headroom under the budget."""
    return budget if not c.levers else int(budget * (1 - POLICY.gpu_headroom))


def _too_small(ctx, seen: dict[frozenset[str], Candidate], unusable: dict[str, str]) -> HeteroError:
    planned = [c for c in seen.values() if c.plan is not None]
    source = "--gpu-memory" if ctx.options.gpu_memory_bytes is not None else f"the {ctx.gpu.name}'s memory"
    if not planned:
        return HeteroError(next(iter(seen.values())).refusal, exit_code=USAGE,
                           hint="raise --gpu-memory, or train a smaller model or batch")
    least = min(planned, key=lambda c: c.peak_bytes)
    need = least.peak_bytes if not least.levers else least.peak_bytes / (1 - POLICY.gpu_headroom)
    return HeteroError(
        f"the GPU budget {SIZE.format_short(ctx.gpu_budget_bytes, 4)} ({source}) is below what any plan reaches: the "
        f"least is {SIZE.format_short(least.peak_bytes, 4)} predicted, with {_names(least.levers) or 'nothing moved'}"
        + _unusable_text(unusable),
        hint=f"use --gpu-memory {SIZE.format_short(need + (1 << 20), 3)} or more, or train a smaller model or batch"
             + (f", or let the optimizer leave the GPU (not --optimizer-device {ctx.options.optimizer_device})"
                if ctx.options.optimizer_device in ("gpu", "none") else ""), exit_code=USAGE)


def _explained(ctx, best: Candidate, seen: dict[frozenset[str], Candidate], fitting: int,
               unusable: dict[str, str]) -> Plan:
    """`best`'s plan with the budget's `why`, and each section it leaves out saying what it would have cost."""
    plain = seen.get(frozenset())
    source = (f"GPU budget {SIZE.format_short(ctx.gpu_budget_bytes)} "
              f"({'--gpu-memory' if ctx.options.gpu_memory_bytes is not None else 'the whole device'})")
    if plain is not None and plain.plan is not None and plain.peak_bytes <= room_bytes(plain, ctx.gpu_budget_bytes):
        fits = f"plain training's predicted peak {SIZE.format_short(plain.peak_bytes)} fits"
    elif plain is not None and plain.plan is not None:
        fits = f"plain training's predicted peak {SIZE.format_short(plain.peak_bytes)} exceeds it"
    else:
        fits = "plain training is not a candidate (forced options)"
    if best.levers:
        moved = f"{_names(best.levers)}: predicted {SIZE.format_short(best.peak_bytes)} at " \
                f"{short_time(best.iteration_s)} per iteration"
    else:
        moved = f"nothing moved ({short_time(best.iteration_s)} per iteration)"
    others = "; ".join(f"{_names(c.levers) or 'plain'}: {_outcome(c, ctx.gpu_budget_bytes)}"
                       for c in seen.values() if c is not best)
    why = f"{source}: {fits}; {moved}, the fastest of {fitting} that fit ({others})" + _unusable_text(unusable)
    out = replace(best.plan, budget=replace(best.plan.budget, why=why))
    omitted = dict(out.omitted)
    for section, lever in (("optimizer", "offload"), ("activations", "tiering")):
        if getattr(out, section) is None and lever not in best.levers and lever not in unusable:
            omitted[section] = _left_out(lever, best, seen)
    return replace(out, omitted=omitted)


def _outcome(c: Candidate, budget: int) -> str:
    if c.plan is None:
        return c.refusal
    over = " (over the budget)" if c.peak_bytes > room_bytes(c, budget) else ""
    return f"{SIZE.format_short(c.peak_bytes)}{over}, {short_time(c.iteration_s)}"


def _left_out(lever: str, best: Candidate, seen: dict[frozenset[str], Candidate]) -> str:
    other = seen.get(best.levers | {lever})
    if other is None or other.plan is None:
        return f"{NAMES[lever]}: not needed to fit the GPU budget"
    return (f"{NAMES[lever]} would predict {SIZE.format_short(other.peak_bytes)} of GPU memory at "
            f"{short_time(other.iteration_s)} per iteration, against {SIZE.format_short(best.peak_bytes)} at "
            f"{short_time(best.iteration_s)} without: not needed to fit the GPU budget, and not faster")


def _names(levers: frozenset[str]) -> str:
    return ", ".join(NAMES[x] for x in LEVERS if x in levers)


def _unusable_text(unusable: dict[str, str]) -> str:
    return "".join(f"; not {NAMES[k]}: {v}" for k, v in unusable.items())
