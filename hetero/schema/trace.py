"""Chrome Trace Event JSON (opens in Perfetto and chrome://tracing), for predicted and for measured timelines: a
thread per lane, spans as complete events (`ph: X`, microseconds), and a counter track (`ph: C`) per tier whose
series (the sources of its bytes) a viewer stacks.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

PID = 1
NO_ARGS: Mapping[str, Any] = MappingProxyType({})


class Span(NamedTuple):
    """One piece of work on a lane (a lane serves one piece at a time), in seconds: from the run's or the predicted
    iteration's origin in a trace, perf_counter values while the runtime records."""

    lane: str
    name: str
    start_s: float
    end_s: float
    args: Mapping[str, Any] = NO_ARGS


class TierUse(NamedTuple):
    """A tier's bytes in use from `time_s` on (seconds from an origin its owner states)."""

    time_s: float
    tier: str
    used_bytes: int


class Count(NamedTuple):
    """A counter sample: at `time_s`, the value of each series of `track` (a viewer stacks them)."""

    time_s: float
    track: str
    values: dict[str, int]


def chrome(spans: list[Span], counters: list[Count], meta: dict[str, Any]) -> dict[str, Any]:
    lanes = list(dict.fromkeys(lane for lane, *_ in spans))
    tid = {lane: k for k, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "hetero"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": PID, "tid": k, "args": {"name": lane}}
               for lane, k in tid.items()]
    events += [{"name": name, "cat": lane, "ph": "X", "pid": PID, "tid": tid[lane], "ts": start * 1e6,
                "dur": (end - start) * 1e6, **({"args": dict(args)} if args else {})}
               for lane, name, start, end, args in spans]
    events += [{"name": c.track, "ph": "C", "pid": PID, "ts": c.time_s * 1e6, "args": c.values} for c in counters]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def memory_track(tier: str) -> str:
    return f"memory {tier}"
