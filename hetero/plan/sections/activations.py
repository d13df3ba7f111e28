"""The activations section: which saved activations leave the fast tier after each layer's forward and when they
come back (TierTrain's schedule, hetero.plan.tiering), under the paper's busy-prefetcher rule and under ours, the
faster in simulation kept. Pure: no torch, no I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hetero.errors import USAGE, HeteroError
from hetero.plan import recompute, tiering
from hetero.plan.context import Context
from hetero.plan.model import Curve
from hetero.plan.section import HostPeak, Section, Step, Translation, busy_share, ns
from hetero.plan.simulate import Result
from hetero.schema.plan import ActivationPlan, Eviction, Plan, RecomputePlan
from hetero.schema.profile import Profile
from hetero.units import SIZE, short_time, size_change

TIERING = "activation store buffers"  # entries of the host-memory account (hetero.plan.footprint)
EVICTED = "evicted activations"


class Activations(Section):
    name, phase = "activations", "whole"

    def solve(self, step: Step) -> ActivationPlan | None:
        """The faster schedule; None where none evicts a byte (`omitted` says why): a section would hook every layer
        for nothing."""
        kept = step.pinned("activations") or {}
        candidates = _activations(step.ctx, kept, step.omitted, step.levers, step.draft.recompute)
        chosen = _pick_schedule(step.ctx, step.draft, candidates, step.predict)
        if chosen is not None and not any(e.evict_bytes for e in chosen.schedule):
            step.omitted["activations"] = _evicts_nothing(step.ctx.profile, chosen)
            return None
        return chosen

    def pinned(self, profile: Profile, previous: Plan) -> dict[str, Eviction]:
        """The earlier plan's pinned evictions, by layer; refused where the profile has no such layer."""
        evictions = {e.layer: e for e in (previous.activations.schedule if previous.activations else []) if e.pinned}
        unknown = sorted(set(evictions) - {layer.name for layer in profile.layers})
        if unknown:
            raise HeteroError(f"--from plan pins layers the profile does not have: {', '.join(unknown[:5])}",
                              hint="unpin or delete those entries in the old plan, then re-plan", exit_code=USAGE)
        return evictions

    def curves(self, profile: Profile, plan: Plan) -> tuple[Curve, Curve] | None:
        return tiering.curves(profile, plan.activations.slow) if plan.activations else None

    def choose(self, t: Translation) -> dict[str, Any]:
        """Each layer's evicted bytes and what triggers its prefetch; the tiers; the disk workers' share of a core."""
        acts = t.plan.activations
        if acts is None:
            return {}
        n = len(t.costs.layers)
        evicted, trigger, at = [0] * n, [None] * n, [0.0] * n
        for e in acts.schedule:
            if (i := t.index.get(e.layer)) is not None:
                evicted[i] = min(e.evict_bytes, t.costs.layers[i].saved_bytes)
                trigger[i], at[i] = t.index.get(e.prefetch_after) if e.prefetch_after else None, e.prefetch_at_s
        share = {}
        slow = next((x for x in t.profile.machine.tiers if x.name == acts.slow), None)
        if slow is not None:  # disk workers mostly wait for the device (the profile measures how much)
            share["evict"], share["prefetch"] = busy_share(slow.write_cpu), busy_share(slow.read_cpu)
        return dict(evict_bytes=evicted, trigger=trigger, prefetch_at_s=at, fast=acts.fast, slow=acts.slow,
                    cpu_share=share)

    def host_bytes(self, profile: Profile, plan: Plan, peak: HostPeak) -> dict[str, int]:
        """Where freed memory is returned, evictions lower the host peak by the simulated drop; with malloc's defaults
        only by as much as the store's bounce buffers hold, which cost always."""
        tiered = peak.evicted_from_peak and plan.activations is not None and \
            any(e.evict_bytes for e in plan.activations.schedule)
        bounces = ActivationPlan.STORE_BYTES if tiered else 0
        # malloc's heap keeps what evicted tensors free for the next ones saved, so the simulated drop never shows,
        # and tiering's processes did not pass plain's peak either: the buffers come out of what evictions free
        saving = peak.evicted_saving if peak.memory_returned else min(peak.evicted_saving, bounces)
        return {EVICTED: -saving, TIERING: bounces}


def _activations(ctx: Context, evictions: dict[str, Eviction], omitted: dict[str, str], levers: frozenset[str],
                 recomputed: RecomputePlan | None = None) -> list[ActivationPlan]:
    """The TierTrain schedule under the paper's busy-prefetcher rule and under ours; `_pick_schedule` simulates
    both. Layers inside `recomputed` blocks save nothing to evict."""
    if ctx.slow is None:
        omitted["activations"] = f"the profile has no tier slower than {ctx.fast} with measured transfer times"
        return []
    if "layers" in ctx.profile.unmeasured:  # a compiled model: per-layer hooks cannot follow it
        omitted["activations"] = ctx.profile.unmeasured["layers"]
        return []
    if ctx.gpu is None and not (evictions or ctx.options.tier_activations or "tiering" in levers):
        omitted["activations"] = _tiering_saves_nothing(ctx)
        return []
    if ctx.gpu is not None and "tiering" not in levers:
        return []  # hetero.plan.gpu_fit says why
    evict, prefetch = ctx.tier_curves(ctx.slow)
    layers = ctx.profile.layers
    rebuilt = recompute.layers_of(ctx.profile, recomputed.blocks) if recomputed is not None else set()
    windows = [tiering.Window(name=x.name, saved_bytes=0 if x.name in rebuilt else x.saved_bytes, fp_end_s=x.fp_end_s,
                              bp_start_s=x.bp_start_s,
                              storages=() if x.name in rebuilt else tuple(x.saved_storages_bytes))
               for x in layers]
    index = {x.name: i for i, x in enumerate(layers)}
    pinned = {index[name]: tiering.Decision(layer=index[name], evict_bytes=e.evict_bytes, prefetch_at_s=e.prefetch_at_s,
                                            prefetch_after=index.get(e.prefetch_after), outcome="pinned", why=e.why)
              for name, e in evictions.items()}
    min_tensor = tiering.min_tensor_bytes(evict, prefetch)
    out = []
    for rule in ("paper", "packed"):
        decisions = tiering.schedule(windows, evict, prefetch, ctx.options.stay_time_s, min_tensor, pinned, rule)
        keyed = ctx.gpu is not None  # see _trigger
        schedule = [Eviction(layer=layers[d.layer].name, evict_bytes=d.evict_bytes, prefetch_at_s=ns(d.prefetch_at_s),
                             prefetch_after=layers[d.prefetch_after].name if d.prefetch_after is not None else
                             _trigger(layers, d.prefetch_at_s) if keyed and d.outcome != "pinned" and d.evict_bytes
                             else None, pinned=d.outcome == "pinned", why=d.why) for d in decisions]
        out.append(ActivationPlan(fast=ctx.fast, slow=ctx.slow, slow_path=_tier_path(ctx.profile, ctx.slow),
                                  stay_time_s=ctx.options.stay_time_s,
                                  min_tensor_bytes=min_tensor, schedule=schedule, why=rule))
    return out


def _trigger(layers, at_s: float) -> str:
    """On a GPU, the layer whose backward start (as profiled) comes last at or before `at_s`: the prefetch is keyed
    to it, not the clock. A GPU runs behind the thread that issues its work, so a clock-timed prefetch would be
    issued as that thread reached backward, bringing every evicted tensor back at once."""
    started = [x for x in layers if x.bp_start_s <= at_s]
    first = min(layers, key=lambda x: x.bp_start_s)
    return max(started, key=lambda x: x.bp_start_s, default=first).name


def _tiering_saves_nothing(ctx: Context) -> str:
    saved = max((x.saved_bytes for x in ctx.profile.layers), default=0)
    total = sum(x.saved_bytes for x in ctx.profile.layers)
    fits = "" if ctx.budget_source is None else \
        f"the DRAM budget is kept without it ({ctx.budget_source}); "
    return (f"{fits}saved activations ({SIZE.format_short(total)} per step, {SIZE.format_short(saved)} in the "
            "largest layer) live in host memory, whose allocator keeps the memory evicted tensors free for the next "
            "ones: the process's peak would barely fall while every step waits on the disk (--tier-activations "
            "schedules them anyway)")


def _evicts_nothing(profile: Profile, chosen: ActivationPlan) -> str:
    """Why a schedule moves nothing: no saved storage reaches the size worth a transfer, or every layer's request
    was dropped (the first one's reason)."""
    dropped = next((e for e in chosen.schedule if e.why), None)
    if dropped is not None:
        return f"no layer's saved activations can leave and come back in time ({dropped.layer}: {dropped.why})"
    size, layer = max(((max(x.saved_storages_bytes or [x.saved_bytes]), x.name) for x in profile.layers),
                      default=(0, "none"))
    return (f"no saved storage reaches min_tensor {SIZE.format_short(chosen.min_tensor_bytes)}, the least size whose "
            f"transfers to and from {chosen.slow} spend at most {tiering.LATENCY_SHARE:.0%} of their time on their "
            f"fixed cost (the largest: {SIZE.format_short(size)}, in {layer})")


def _tier_path(profile: Profile, name: str) -> str | None:
    return next((t.path for t in profile.machine.tiers if t.name == name), None)


def _pick_schedule(ctx: Context, draft: Plan, candidates: list[ActivationPlan],
                   predict: Callable[[Plan], Result]) -> ActivationPlan | None:
    """The faster schedule in simulation, then the one leaving less in fast memory on average."""
    scored = []
    for cand in candidates:
        r = predict(replace(draft, activations=cand))
        scored.append((ns(r.iteration_s), r.act_avg_bytes, r.act_peak_bytes, r))
    if not scored:
        return None
    best = min(range(len(scored)), key=lambda k: scored[k][:3])
    chosen, r = candidates[best], scored[best][3]
    others = "; ".join(f"{c.why} rule: {short_time(s[0])}, average {SIZE.format_short(s[1])}"
                       for k, (c, s) in enumerate(zip(candidates, scored)) if k != best)
    basis = "simulated with every layer GFGB" if ctx.gpu else "simulated"
    return replace(chosen, why=f"{chosen.why} prefetch rule, {basis}: iteration {short_time(r.iteration_s)}, "
                               f"{ctx.fast} activations {size_change(r.act_avg_untiered_bytes, r.act_avg_bytes)} on "
                               f"average, {size_change(r.act_peak_untiered_bytes, r.act_peak_bytes)} at peak "
                               f"(the {others})")
