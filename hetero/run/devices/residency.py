"""Bytes of saved activations resident in each memory tier over time, and what it took to keep them there.

Every change updates running integrals under one lock (averages and peaks cost nothing to read), and is kept as a
(time, tier, bytes) event for the run report, up to EVENTS. `saved` counts every saved storage wherever it is.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from time import perf_counter

from hetero.schema.trace import TierUse

UNTIERED = "saved"  # the series of every saved byte wherever it is: the fast tier's without tiering
EVENTS = 200_000  # about 10 MB of tuples: enough for a report of the first steps of any run


@dataclass(frozen=True, slots=True)
class Residency:
    span_s: float  # from the first change to the last
    avg_fast: float
    peak_fast: int
    avg_saved: float  # without tiering
    peak_saved: int
    peak_slow: int
    evictions: int
    queued: dict[str, int]  # bytes the schedule chose to evict, by the layer that chose them
    evicted: dict[str, int]  # bytes whose eviction completed (a prefetch may cancel one still queued)
    late: int  # prefetches not complete when autograd asked
    waited_s: float  # time autograd spent waiting for them


class Ledger:
    def __init__(self, fast: str, slow: str):
        self.tiers = (fast, slow, UNTIERED)
        self.lock = threading.RLock()  # re-entered by finalizers of records freed while it is held
        self.now = [0, 0, 0]  # fast, slow, saved
        self.peak = [0, 0, 0]
        self.area = [0.0, 0.0, 0.0]
        self.start: float | None = None
        self.last = 0.0
        self.events: list[TierUse] = []
        self.evictions, self.late, self.waited_s = 0, 0, 0.0
        self.queued: Counter[str] = Counter()
        self.evicted: Counter[str] = Counter()

    def change(self, *, fast: int = 0, slow: int = 0, saved: int = 0) -> None:
        with self.lock:
            t = perf_counter()
            if self.start is None:
                self.start = self.last = t
            dt = t - self.last
            for i, delta in enumerate((fast, slow, saved)):
                self.area[i] += self.now[i] * dt
                if delta:
                    self.now[i] += delta
                    self.peak[i] = max(self.peak[i], self.now[i])
                    if len(self.events) < EVENTS:
                        self.events.append(TierUse(t - self.start, self.tiers[i], self.now[i]))
            self.last = t

    def series(self) -> dict[str, list[tuple[float, int]]]:
        """Each tier's bytes over time, by name (and UNTIERED's), as (perf_counter seconds, bytes from then on)
        points in time order."""
        with self.lock:
            out: dict[str, list[tuple[float, int]]] = {tier: [] for tier in self.tiers}
            for t, tier, n in self.events:
                out[tier].append((self.start + t, n))
        return out

    def report(self) -> Residency:
        with self.lock:
            span = self.last - self.start if self.start is not None else 0.0
            avg = [a / span if span > 0 else 0.0 for a in self.area]
            return Residency(span_s=span, avg_fast=avg[0], peak_fast=self.peak[0], avg_saved=avg[2],
                             peak_saved=self.peak[2], peak_slow=self.peak[1], evictions=self.evictions,
                             queued=dict(self.queued), evicted=dict(self.evicted), late=self.late,
                             waited_s=self.waited_s)
