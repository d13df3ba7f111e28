"""Bytes in use over time, as a step function: what the planner predicts (hetero.plan.simulate) and the recorder
measures (hetero.run.recorder) are averaged and peaked by the same rule. Pure: no torch, no I/O."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sweep:
    avg_bytes: int  # time-averaged over the window
    peak_bytes: int


def levels(changes: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(time, bytes in use from then on) after each (time, change in bytes), from 0 bytes; at equal times frees
    (negative changes) come first, so a free and an allocation at one moment make no false peak."""
    ordered = sorted(changes)
    return list(zip((t for t, _ in ordered), itertools.accumulate(delta for _, delta in ordered)))


def sweep(points: list[tuple[float, int]], start: float, end: float) -> Sweep:
    """Time-average and peak over [start, end] of a step function given by its (time, new value) points, in time
    order; before the first point it is 0."""
    value = next((n for t, n in reversed(points) if t <= start), 0)
    peak, area, last = value, 0.0, start
    for t, n in points:
        if start < t <= end:
            area += value * (t - last)
            last, value = t, n
            peak = max(peak, value)
    area += value * (end - last)
    return Sweep(int(area / (end - start)) if end > start else value, peak)
