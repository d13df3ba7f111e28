"""Timing helpers for the profile: the median of a call, and compute beside worker threads."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def median_time(fn: Callable[[], object], repeats: int = 7, min_s: float = 2e-4) -> float:
    """Median seconds of one call; fast calls are batched until a batch takes at least `min_s`."""
    fn()
    batch = 1
    while True:
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        if time.perf_counter() - start >= min_s or batch >= 2**16:
            break
        batch *= 4
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times)


@dataclass(frozen=True, slots=True)
class Beside:
    """Compute and workers sharing the cores."""

    compute: float  # a GEMM loop's time with the workers beside it over alone (>= 1)
    work_s: float  # the workers' median call beside the GEMM loop


def beside_compute(works: list[Callable[[], object]], target_s: float = 0.06, pairs: int = 5) -> Beside:
    """A loop of GEMMs of about `target_s`, alone and then while one thread per entry of `works` repeats it, `pairs`
    times over; the slowdown is the median of the pairs' ratios (timed side by side: a shared machine drifts), >= 1."""
    a, b = torch.ones(512, 1024), torch.ones(1024, 1024)
    count = max(1, round(target_s / median_time(lambda: a @ b, repeats=3, min_s=0)))

    def gemms() -> tuple[float, float]:
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        return start, time.perf_counter()

    ratios, inside = [], []
    for _ in range(pairs):
        start, end = gemms()
        alone = end - start
        (start, end), calls = _while_working(works, gemms)
        ratios.append((end - start) / alone)
        inside += [e - s for s, e in calls if start <= s and e <= end] or [max(e - s for s, e in calls)]
    return Beside(compute=max(1.0, statistics.median(ratios)), work_s=statistics.median(inside))


def _while_working(works: list[Callable[[], object]], job: Callable[[], object]) -> tuple[object, list]:
    """`job()` while one thread per entry of `works` repeats it; its result and the workers' (start, end) calls."""
    stop, calls = threading.Event(), []

    def loop(work: Callable[[], object]) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            work()
            calls.append((start, time.perf_counter()))

    workers = [threading.Thread(target=loop, args=(w,), name="hetero-profile-worker", daemon=True) for w in works]
    for w in workers:
        w.start()
    try:
        return job(), calls
    finally:
        stop.set()
        for w in workers:
            w.join()


def share(compute: float, slowdown: float, workers: int = 1) -> float:
    """(compute slowdown beside `workers` workers - 1) / (slowdown beside one streaming worker - 1), per worker,
    clamped to [0, 1]."""
    return round(min(1.0, max(0.0, (compute - 1) / (slowdown - 1) / workers)), 3) if slowdown > 1 else 0.0
