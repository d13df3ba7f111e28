"""`hetero report --png`: memory per tier over one recorded step, measured (stacked by source) against the plan's
prediction. matplotlib is the optional extra `hetero[viz]`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetero.errors import USAGE, HeteroError
from hetero.plan.solve import predict
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from hetero.schema.run import Run
from hetero.schema.sources import beside
from hetero.schema.trace import memory_track

MiB = 2**20


def step_window(run: Run) -> tuple[float, float]:
    """The last recorded step, in trace seconds: from the previous step's end to its own."""
    if not (ends := [s.at_s for s in run.steps]):
        raise HeteroError("the run recorded no complete step: nothing to draw", hint="record more steps")
    return (ends[-2] if len(ends) > 1 else 0.0), ends[-1]


def measured_series(trace: dict[str, Any], tier: str, start: float, end: float) -> tuple[list[float], dict]:
    """Times (ms from `start`) and bytes per source of one tier's counter track within [start, end], starting with
    the value in force at `start`."""
    track = memory_track(tier)
    samples = sorted((e["ts"] / 1e6, e["args"]) for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == track)
    before = [s for s in samples if s[0] <= start][-1:]
    inside = before + [s for s in samples if start < s[0] <= end]
    sources = list(dict.fromkeys(k for _, args in inside for k in args))
    times = [max(0.0, t - start) * 1e3 for t, _ in inside] + [(end - start) * 1e3]
    values = {k: [args.get(k, 0) / MiB for _, args in inside] for k in sources}
    return times, {k: v + v[-1:] for k, v in values.items()}


def draw(run: Run, trace: dict[str, Any], predicted: dict[str, list[tuple[float, int]]], path: Path) -> None:
    """One panel per tier: measured bytes by source as a stacked step plot; the simulated total dashed."""
    plt = _pyplot()
    start, end = step_window(run)
    tiers = list(run.peak_bytes)
    fig, axes = plt.subplots(len(tiers), 1, figsize=(9, 2.6 * len(tiers)), sharex=True, squeeze=False)
    for ax, tier in zip(axes[:, 0], tiers):
        times, values = measured_series(trace, tier, start, end)
        if values:
            ax.stackplot(times, *values.values(), labels=list(values), step="post", alpha=0.75)
        if tier in predicted:
            t, v = zip(*predicted[tier])
            ax.step([x * 1e3 for x in t], [b / MiB for b in v], where="post", linestyle="--", color="black",
                    label="predicted total")
        ax.set_ylabel(f"{tier} (MiB)")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(f"time in step {run.steps[-1].step} (ms)")
    fig.suptitle(f"memory per tier: {run.source.script} under {Path(run.source.plan).name} ({run.timing.device})")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise HeteroError(f"cannot write {path}: {e.strerror}", hint="pass --png with a writable path") from None
    finally:
        plt.close(fig)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise HeteroError("--png needs matplotlib, which is not installed", exit_code=USAGE,
                          hint="pip install matplotlib (or, in hetero's checkout: pip install -e '.[viz]')") from None
    return plt


def draw_run(run: Run, run_path: Path, plan: Plan, profile: Profile | None, png: Path) -> None:
    """Draw the run's last recorded step from its trace (found beside run.yaml), with the plan's prediction when
    its profile is at hand, into `png`."""
    trace_path = beside(run.source.trace, run_path) if run.source.trace else None
    if trace_path is None or not trace_path.is_file():
        raise HeteroError(f"--png draws from the run's trace, and {trace_path or 'none'} is not there",
                          hint="keep the trace beside run.yaml (hetero run --trace run.json)", exit_code=USAGE)
    try:
        trace = json.loads(trace_path.read_text())
    except (OSError, ValueError) as e:
        raise HeteroError(f"cannot read the trace {trace_path}: {e}", hint="record it again") from None
    predicted: dict[str, list] = {}
    if profile is not None:
        for t, tier, used in predict(profile, plan, record=True).counters:
            predicted.setdefault(tier, []).append((t, used))
    draw(run, trace, predicted, png)
