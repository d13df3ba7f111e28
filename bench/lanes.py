"""Busy time per lane and step of a traced run against the same lanes of the plan's simulated iteration: which
term of the simulator is off, where `hetero report` only says how far the iteration is.

    .venv/bin/python bench/lanes.py build/demo/run.json build/demo/plan.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.errors import HeteroError  # noqa: E402
from hetero.plan.solve import predict  # noqa: E402
from hetero.schema import files  # noqa: E402
from hetero.schema.plan import Plan  # noqa: E402
from hetero.schema.run import Run  # noqa: E402
from hetero.schema.sources import profile_of  # noqa: E402


def measured(trace: Path) -> Counter:
    """Milliseconds per step of each (lane, first word of the span's name) over the recorded steps."""
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    steps = files.load(trace.with_suffix(".yaml"), expect=Run).timing.steps_recorded
    busy: Counter = Counter()
    for e in events:
        if e.get("ph") == "X":
            busy[lanes[e["tid"]], e["name"].split()[0]] += e["dur"] / 1e3 / steps
    return busy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path, help="the JSON `hetero run --trace` wrote (its .yaml summary beside it)")
    p.add_argument("plan", type=Path)
    a = p.parse_args()
    plan = files.load(a.plan, expect=Plan)
    result = predict(profile_of(plan, a.plan, "to simulate it"), plan, record=True)
    simulated: Counter = Counter()
    for s in result.spans:
        simulated[s.lane, s.name.split()[0]] += (s.end_s - s.start_s) * 1e3
    busy = measured(a.trace)
    table = Table(title="busy ms per step", title_justify="left")
    for col in ("lane", "what", "measured", "simulated"):
        table.add_column(col, justify="right" if col in ("measured", "simulated") else "left")
    for lane, what in sorted(set(busy) | set(simulated)):
        table.add_row(lane, what, f"{busy[lane, what]:.1f}", f"{simulated[lane, what]:.1f}")
    Console().print(table)
    if busy["evict", "delete"]:
        print("The simulator counts a file's delete (the writer's, in the run) with its read: compare evict/delete "
              "plus prefetch/prefetch with the simulated prefetch.")


if __name__ == "__main__":
    try:
        main()
    except HeteroError as e:
        sys.exit(f"error: {e}" + (f"\nhint: {e.hint}" if e.hint else ""))
