"""Chrome Trace Event JSON (opens in Perfetto and chrome://tracing), for predicted and for measured timelines.

One thread per lane, named by a metadata event, in the order lanes first appear; spans are complete events
(`ph: X`) with `ts`/`dur` in microseconds; memory is one counter track (`ph: C`) per tier whose series are the
sources of its bytes, so a viewer stacks them.
"""

from __future__ import annotations

from typing import Any

PID = 1
Span = tuple[str, str, float, float, dict[str, Any]]  # lane, name, start_s, end_s, args
Count = tuple[float, str, dict[str, int]]  # time_s, track, {series: value}


def chrome(spans: list[Span], counters: list[Count], meta: dict[str, Any]) -> dict[str, Any]:
    lanes = list(dict.fromkeys(lane for lane, *_ in spans))
    tid = {lane: k for k, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "hetero"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": PID, "tid": k, "args": {"name": lane}}
               for lane, k in tid.items()]
    events += [{"name": name, "cat": lane, "ph": "X", "pid": PID, "tid": tid[lane], "ts": start * 1e6,
                "dur": (end - start) * 1e6, **({"args": args} if args else {})}
               for lane, name, start, end, args in spans]
    events += [{"name": track, "ph": "C", "pid": PID, "ts": t * 1e6, "args": values} for t, track, values in counters]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def memory_track(tier: str) -> str:
    return f"memory {tier}"
