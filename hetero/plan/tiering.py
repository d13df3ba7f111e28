"""Which saved activations wait in a slower tier between a layer's forward and its backward (TierTrain §5.3).

A layer's saved tensors are idle from the end of its forward to the start of its backward (Eq. 2). They move only if
there is time to evict them, stay at least ST (against ping-pong) and prefetch them back (Eq. 3-6); otherwise the
part that fits moves (Eq. 7). The prefetch starts just in time (Eq. 8); one prefetcher serves the requests, and one
that would start while it is busy is cut to what fits after it (Eq. 9-10), or dropped. Times come from the tiers'
measured curves, storage by storage as the runtime moves them, so each storage pays a transfer's latency.

Requests are decided in backward order, the prefetcher's: in forward order the paper's t_busy rule would find the
prefetcher busy past every later layer's backward and drop it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

from hetero.plan.model import Curve, chunks_time_s, chunks_within
from hetero.schema.profile import Profile, Tier
from hetero.units import short_size, short_time

_SLACK_S = 1e-9  # float noise: a partial eviction ends exactly ST before its prefetch (Eq. 7), never "late" by it
_ROUNDS = 8  # re-placements after the eviction queue cut requests; caps only shrink, so it settles fast
LATENCY_SHARE = 0.5  # a tensor is moved only if a transfer's fixed cost is at most this share of its time


@dataclass(kw_only=True, slots=True)
class Window:
    """A layer's idle window, from the profile."""

    name: str
    saved_bytes: int
    fp_end_s: float  # te^F
    bp_start_s: float  # ts^B
    storages: tuple[int, ...] = ()  # the saved storages' sizes, largest first; empty: not profiled

    def movable(self, min_tensor: int) -> Window:
        """What the runtime may move: the storages of at least `min_tensor` (unprofiled: all the bytes, if they
        reach it)."""
        storages = tuple(s for s in self.storages or (self.saved_bytes,) if s >= min_tensor)
        return replace(self, storages=storages, saved_bytes=sum(storages))

    def time_s(self, curve: Curve, size: int) -> float:
        """Moving `size` of these bytes takes one transfer per storage (`chunks`), as the runtime moves them."""
        return chunks_time_s(curve, self.storages, size)

    def within(self, curve: Curve, budget_s: float, upper: int) -> int:
        """The most bytes, at most `upper`, moved within `budget_s`; a picosecond of slack keeps float noise from
        losing the last byte of an exact fit."""
        return chunks_within(curve, self.storages, budget_s + 1e-12, upper) if budget_s > 0 else 0


@dataclass(kw_only=True, slots=True)
class Decision:
    layer: int
    evict_bytes: int
    prefetch_at_s: float
    prefetch_after: int | None  # the layer whose backward start triggers the prefetch
    outcome: str  # whole | partial | cut | queued | dropped | pinned
    why: str


def curves(profile: Profile, slow: str) -> tuple[Curve, Curve]:
    """Eviction and prefetch times to `slow`: without a GPU, its measured write and read curves, as long as they
    take beside compute on the shared cores; from the GPU, the D2H/H2D copies, followed by the tier's own write/read
    unless it is host memory itself."""
    tier = next(t for t in profile.machine.tiers if t.name == slow)
    gpu = profile.machine.gpu
    if gpu is None:
        return disk_curves(tier)
    evict, prefetch = Curve.of(gpu.d2h, "gpu.d2h"), Curve.of(gpu.h2d, "gpu.h2d")
    if tier.kind == "dram":
        return evict, prefetch
    return evict.then(Curve.of(tier.write, f"{slow} write")), Curve.of(tier.read, f"{slow} read").then(prefetch)


def disk_curves(tier: Tier) -> tuple[Curve, Curve]:
    """A disk tier's write and read curves as measured beside compute where they were (the CPU computes: the
    workers share its cores), else alone."""
    return (Curve.of(tier.write_beside_compute or tier.write, f"{tier.name} write"),
            Curve.of(tier.read_beside_compute or tier.read, f"{tier.name} read"))


def min_tensor_bytes(evict: Curve, prefetch: Curve) -> int:
    """The smallest measured size at which, in both directions, a transfer's fixed cost (the smallest measured
    transfer's time) is at most LATENCY_SHARE of the transfer. The runtime applies it per tensor, so it must not be
    a size only whole layers reach (a disk may reach half its peak rate only at many MiB)."""
    def amortized(curve: Curve, size: int) -> bool:
        return curve.times[0] <= LATENCY_SHARE * curve.time_s(size)
    for size in sorted(set(evict.sizes) | set(prefetch.sizes)):
        if amortized(evict, size) and amortized(prefetch, size):
            return size
    return max(evict.sizes[-1], prefetch.sizes[-1])


def schedule(windows: list[Window], evict: Curve, prefetch: Curve, stay_time_s: float, min_tensor: int,
             pinned: dict[int, Decision] | None = None, rule: str = "paper") -> list[Decision]:
    """One decision per layer with storages of at least `min_tensor` (dropped ones with the reason), in forward
    order; each such storage is a transfer. `pinned` decisions are kept and occupy the prefetcher like any other.
    rule `paper`: in backward order, each prefetch ending at its layer's backward start, cut to what fits after
    t_busy (Eq. 9-10); `packed` (ours): from the last backward layer to the first, each ending at its backward start
    or when the next prefetch begins, so a large request uses the idle time before a small one. Requests the
    evictions' own queue cuts (`evictions`) are placed again with that cap until nothing changes."""
    q = _Queue(windows=[w.movable(max(min_tensor, 1)) for w in windows], evict=evict, prefetch=prefetch,
               migrate=evict.then(prefetch), stay_s=stay_time_s, pinned=pinned or {}, rule=rule,
               starts=sorted((w.bp_start_s, i) for i, w in enumerate(windows)))
    for _ in range(_ROUNDS):  # the reasons are written once, for the final placement
        cut = q.evictions(q.place(explain=False))
        if not cut:
            break
        q.caps.update(cut)
    out = q.place(explain=True)
    q.evictions(out)
    for d in out:
        if d.outcome != "pinned":
            d.prefetch_after = trigger(q.starts, d.prefetch_at_s) if d.evict_bytes else None
    return sorted(out, key=lambda d: d.layer)


def trigger(starts: list[tuple[float, int]], at_s: float) -> int | None:
    """The latest layer whose backward starts at or before `at_s`; None when the backward has not started yet."""
    k = bisect.bisect_right(starts, (at_s, len(starts)))
    return starts[k - 1][1] if k else None


@dataclass(kw_only=True, slots=True)
class _Queue:
    windows: list[Window]
    evict: Curve  # ER
    prefetch: Curve  # PR
    migrate: Curve  # evict then prefetch: sz * MR (Eq. 5)
    stay_s: float
    pinned: dict[int, Decision]
    rule: str
    starts: list[tuple[float, int]]  # (backward start, layer), in backward order
    caps: dict[int, tuple[int, float]] = field(default_factory=dict)  # layer -> (bytes, eviction start)

    def place(self, explain: bool) -> list[Decision]:
        busy, free = 0.0, float("inf")  # paper: t_busy; packed: when the prefetcher starts the next request
        out = []
        for _, i in self.starts if self.rule == "paper" else self.starts[::-1]:
            w = self.windows[i]
            if i in self.pinned:
                d = replace(self.pinned[i])
            elif w.saved_bytes:
                d = self.decide(i, w, busy, free, explain)
            else:
                continue
            out.append(d)
            if d.evict_bytes and self.rule == "paper":
                busy = max(busy, w.bp_start_s)
            elif d.evict_bytes:
                free = min(free, d.prefetch_at_s)
        return out

    def decide(self, i: int, w: Window, busy: float, free: float, explain: bool) -> Decision:
        end = min(w.bp_start_s, free)  # the paper's end is the backward start: free is infinite there
        idle = end - w.fp_end_s  # Eq. 2
        move = w.time_s(self.migrate, w.saved_bytes)  # Eq. 4-5: sz * MR
        size, outcome = w.saved_bytes, "whole"
        if idle < move + self.stay_s:  # Eq. 7: the part that still fits
            size, outcome = w.within(self.migrate, idle - self.stay_s, size), "partial"
        cap = self.caps.get(i)
        if cap is not None and cap[0] < size:
            size, outcome = cap[0], "queued"
        fitted = size
        if size and busy > end - w.time_s(self.prefetch, size):  # Eq. 8-10: what fits after the busy prefetcher
            size, outcome = w.within(self.prefetch, end - busy, size), "cut"
        start = end - w.time_s(self.prefetch, size)  # Eq. 8
        d = Decision(layer=i, evict_bytes=size, prefetch_at_s=start if size else w.bp_start_s, prefetch_after=None,
                     outcome=outcome if size else "dropped", why="")
        if explain:
            d.why = _why(w, d, idle, move, self.stay_s, end, cap, fitted, busy)
        return d

    def evictions(self, decisions: list[Decision]) -> dict[int, tuple[int, float]]:
        """Evictions share one writer, which the paper's equations leave out: an eviction queued behind earlier ones
        ends later, so it is cut to what still stays ST before its prefetch (a cut never delays another request:
        it shortens its own eviction and starts its own prefetch later). Returns the caps it set, by layer."""
        free, cut = 0.0, {}
        for d in sorted(decisions, key=lambda d: (self.windows[d.layer].fp_end_s, d.layer)):
            w = self.windows[d.layer]
            start = max(free, w.fp_end_s)
            late = start + w.time_s(self.evict, d.evict_bytes) + self.stay_s - d.prefetch_at_s
            if d.evict_bytes and d.outcome != "pinned" and late > _SLACK_S:
                end = d.prefetch_at_s + w.time_s(self.prefetch, d.evict_bytes)
                size = w.within(self.migrate, end - start - self.stay_s, d.evict_bytes)
                cut[d.layer] = (size, start)
                _cap(d, size, start, self.stay_s, end - w.time_s(self.prefetch, size) if size else w.bp_start_s)
            free = start + w.time_s(self.evict, d.evict_bytes) if d.evict_bytes else free
        return cut


def _cap(d: Decision, size: int, start: float, stay_s: float, prefetch_at: float) -> None:
    d.why += _queued(start, size, stay_s)
    d.evict_bytes, d.prefetch_at_s = size, prefetch_at
    d.outcome = "queued" if size else "dropped"
    if not size and not d.why.startswith("dropped"):
        d.why = f"dropped: {d.why}"


def _why(w: Window, d: Decision, idle: float, move: float, stay_s: float, end: float,
         cap: tuple[int, float] | None, fitted: int, busy: float) -> str:
    if idle >= move + stay_s:
        why = f"idle {short_time(idle)} >= evict + prefetch {short_time(move)} + stay {short_time(stay_s)} (Eq. 6)"
    else:
        why = (f"idle {short_time(idle)} < evict + prefetch {short_time(move)} of {short_size(w.saved_bytes)} + stay "
               f"{short_time(stay_s)} (Eq. 7)")
    if end < w.bp_start_s:
        why = f"next prefetch starts at {short_time(end)}, before backward at {short_time(w.bp_start_s)}: {why}"
    if cap is not None and cap[0] <= fitted and cap[0] < w.saved_bytes:
        why += _queued(cap[1], cap[0], stay_s)
    if fitted > d.evict_bytes:
        why += (f"; prefetcher busy until {short_time(busy)}: {short_size(d.evict_bytes)} fits before "
                f"{short_time(end)} (Eq. 10)")
    if not d.evict_bytes:
        return f"dropped: {why}"
    return f"{why}; prefetch {short_size(d.evict_bytes)} takes {short_time(end - d.prefetch_at_s)}"


def _queued(start: float, size: int, stay_s: float) -> str:
    if size:
        return (f"; evictions queue: it starts at {short_time(start)}, so {short_size(size)} still stays "
                f"{short_time(stay_s)} before prefetch")
    return (f"; evictions queue: it would start at {short_time(start)}, too late to stay {short_time(stay_s)} "
            "before prefetch")


