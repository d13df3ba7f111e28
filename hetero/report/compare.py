"""Predicted against measured: the plan's simulated iteration next to what `hetero run --trace` recorded.

Pure: a Run, its Plan and the plan's Profile in, rows out. A layer's predicted times are the simulator's (the
profile's times under the plan's modes, stalls excluded); its measured ones are the recorder's, which uses the
profiler's own definitions.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.plan.choices import host_tier
from hetero.plan.model import GPU
from hetero.plan.simulate import Result
from hetero.plan.solve import predict, predicted_of
from hetero.schema.plan import Plan, Predicted
from hetero.schema.profile import Profile
from hetero.schema.run import Run
from hetero.units import SIZE, TIME, Unit

TOLERANCE = 0.15  # entries further off than this get a warning line
NEGLIGIBLE = 0.01  # entries below this fraction of the iteration are shown but not checked: timer noise


@dataclass(frozen=True, slots=True)
class Row:
    entry: str
    predicted: float | None
    measured: float | None
    unit: Unit
    checked: bool = True  # large enough for its error to mean something

    @property
    def error(self) -> float | None:
        """measured / predicted - 1; None when either is missing or the prediction is zero."""
        return None if not self.predicted or self.measured is None else self.measured / self.predicted - 1

    @property
    def off(self) -> bool:
        return self.checked and self.error is not None and abs(self.error) > TOLERANCE


def compare(run: Run, plan: Plan, profile: Profile | None) -> list[Row]:
    """The iteration first, then memory, then (with the profile) forward, backward and every layer. With the
    profile the plan is simulated as written, since a hand-edited plan's `predicted` section is the planner's,
    from before the edit; without it that section is all there is."""
    result = predict(profile, plan) if profile is not None else None
    predicted = predicted_of(profile, plan, result) if result is not None else plan.predicted
    rows = [Row("iteration", predicted.iteration_s, run.timing.iteration_s, TIME)]
    rows += _memory(run, predicted, host_tier(profile) if profile is not None else None)
    if result is not None:
        rows += _layers(run, result, profile, predicted.iteration_s)
    return rows


def _memory(run: Run, predicted: Predicted, host: str | None) -> list[Row]:
    """Each tier's peak: the process's own for host memory (VmHWM) and the GPU (torch's reserved peak, with its
    allocated peak beside it), the runtime's count of its bytes for the other tiers (files, an AXDIMM)."""
    rows = [Row(f"peak {tier}", predicted.peak_bytes.get(tier), _measured_peak(run, tier, host), SIZE)
            for tier in dict.fromkeys([*predicted.peak_bytes, *run.peak_bytes])]
    if run.process is not None and run.process.gpu_allocated_peak_bytes is not None:
        rows.append(Row(f"peak {GPU} allocated", None, run.process.gpu_allocated_peak_bytes, SIZE))
    p, m = predicted.activations, run.activations
    if p is not None and m is not None:
        rows += [Row("saved activations, fast tier, average", p.avg_fast_bytes, m.avg_fast_bytes, SIZE),
                 Row("saved activations, fast tier, peak", p.peak_fast_bytes, m.peak_fast_bytes, SIZE),
                 Row("saved activations without tiering, average", p.avg_fast_untiered_bytes,
                     m.avg_fast_untiered_bytes, SIZE)]
    return rows


def _measured_peak(run: Run, tier: str, host: str | None) -> int | None:
    process = run.process
    if process is not None and tier == GPU and process.gpu_reserved_peak_bytes is not None:
        return process.gpu_reserved_peak_bytes
    return process.dram_peak_bytes if process is not None and tier == host else run.peak_bytes.get(tier)


def _layers(run: Run, result: Result, profile: Profile, iteration_s: float) -> list[Row]:
    names = [x.name for x in profile.layers]
    fp = dict(zip(names, (e - s for s, e in zip(result.fp_start_s, result.fp_end_s))))
    bp = dict(zip(names, (e - s for s, e in zip(result.bp_start_s, result.bp_end_s))))
    micro = run.timing.micro_batches
    forward = max(result.fp_end_s, default=0.0)
    backward = max(result.bp_end_s, default=0.0) - min(result.bp_start_s, default=0.0)
    small = NEGLIGIBLE * iteration_s
    rows = [Row("forward (per micro-batch)", forward, run.timing.forward_s / micro, TIME),
            Row("backward (per micro-batch)", backward, run.timing.backward_s / micro, TIME)]
    for x in run.layers:
        for what, predicted, measured in (("fp", fp.get(x.name), x.fp_s), ("bp", bp.get(x.name), x.bp_s)):
            big = max(predicted or 0.0, measured) >= small
            rows.append(Row(f"{what} {x.name}", predicted, measured, TIME, checked=big))
    return rows


def folded(rows: list[Row]) -> tuple[list[Row], int]:
    """The rows to print: the layer times too short to compare one by one (under `NEGLIGIBLE` of the iteration, where
    a few microseconds of timer and hook noise are tens of percent) summed into one row per phase, checked like any
    other where the sum is long enough; and how many were summed."""
    small = [r for r in rows if not r.checked and r.entry[:3] in ("fp ", "bp ")]
    out = [r for r in rows if r not in small]
    for what, phase in (("fp", "forward"), ("bp", "backward")):
        mine = [r for r in small if r.entry.startswith(f"{what} ")]
        if not mine:
            continue
        predicted = sum(r.predicted or 0.0 for r in mine)
        measured = sum(r.measured or 0.0 for r in mine)
        big = max(predicted, measured) >= NEGLIGIBLE * next((r.predicted for r in rows if r.entry == "iteration"), 0.0)
        out.append(Row(f"{what} of {len(mine)} short layers, summed ({phase})", predicted, measured, TIME,
                       checked=big))
    return out, len(small)


def warnings(rows: list[Row]) -> list[str]:
    return [f"{r.entry}: measured {r.unit.format_short(r.measured)}, predicted {r.unit.format_short(r.predicted)} "
            f"({r.error:+.0%})" for r in rows if r.off]


def grouped_warnings(rows: list[Row]) -> list[str]:
    """`warnings`, with the layers' entries (`fp NAME`, `bp NAME`) folded into one line: how many are off, how many
    slower, and the three furthest off. A run on a busy machine is off on most layers at once; one line says so."""
    layers = [r for r in rows if r.off and r.entry[:3] in ("fp ", "bp ")]
    lines = warnings([r for r in rows if r not in layers])
    if layers:
        checked = sum(r.checked and r.entry[:3] in ("fp ", "bp ") for r in rows)
        slower = sum(r.error > 0 for r in layers)
        worst = sorted(layers, key=lambda r: -abs(r.error))[:3]
        lines.append(f"{len(layers)} of {checked} layer times: {slower} slower, {len(layers) - slower} faster than "
                     f"predicted; furthest: " + ", ".join(f"{r.entry} {r.error:+.0%}" for r in worst))
    return lines


def headline(rows: list[Row]) -> list[str]:
    """The iteration and each tier's peak, measured against predicted: what a reader wants first."""
    return [f"{r.entry}: {r.unit.format_short(r.measured)} measured, {r.unit.format_short(r.predicted)} predicted"
            + ("" if r.error is None else f" ({r.error:+.0%})")
            for r in rows if (r.entry == "iteration" or r.entry.startswith("peak ")) and r.measured is not None]
