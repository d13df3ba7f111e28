"""Where workers report what they did while `hetero run --trace` records: a span per piece of work, on the lane of
the thread that did it (so a lane's spans never overlap). Costs one attribute read when nothing records."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from time import perf_counter

from hetero.schema.trace import NO_ARGS, Span


class Sink:
    """The recorder's side: spans arrive here while `recording` is true (list.append is atomic across threads)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.recording = False


active: Sink | None = None  # the recorder of this process


@contextlib.contextmanager
def timed(lane: str, name: str, nbytes: int = 0) -> Iterator[None]:
    """Record the enclosed work as a span on `lane` while a window is open."""
    sink = active
    if sink is None or not sink.recording:
        yield
        return
    start = perf_counter()
    try:
        yield
    finally:
        sink.spans.append(Span(lane, name, start, perf_counter(), {"bytes": nbytes} if nbytes else NO_ARGS))


def span(lane: str, name: str, start: float, end: float, nbytes: int = 0) -> None:
    """Record a span whose times are already known (work that completes on another thread)."""
    sink = active
    if sink is not None and sink.recording:
        sink.spans.append(Span(lane, name, start, end, {"bytes": nbytes} if nbytes else NO_ARGS))
