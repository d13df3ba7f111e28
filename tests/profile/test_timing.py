"""hetero.profile.timing: the median of a call on a clock the test drives (no wall-clock figure is asserted), and the
share of a core a worker takes from compute."""

import pytest

from hetero.profile import timing
from hetero.profile.timing import median_time, share


class Clock:
    """perf_counter for hetero.profile.timing: each call of the timed function advances it by its next duration."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, iter(durations), 0

    def perf_counter(self) -> float:
        return self.now

    def call(self) -> None:
        self.calls += 1
        self.now += next(self.durations)


def test_a_slow_call_is_timed_alone_and_the_median_is_taken(monkeypatch):
    # a warm-up call (not counted), a probe of one call (1 ms >= min_s: no batching), then the 5 timed calls
    clock = Clock([9.0, 1e-3, 5e-3, 1e-3, 3e-3, 2e-3, 4e-3])
    monkeypatch.setattr(timing, "time", clock)
    assert median_time(clock.call, repeats=5, min_s=5e-4) == pytest.approx(3e-3)
    assert clock.calls == 7


def test_fast_calls_are_batched_until_a_batch_takes_min_s(monkeypatch):
    clock = Clock([1e-6] * 100_000)
    monkeypatch.setattr(timing, "time", clock)
    assert median_time(clock.call, repeats=3, min_s=5e-5) == pytest.approx(1e-6)
    # batches of 1, 4, 16 and 64 calls probed (64 us >= 50 us), then 3 batches of 64, after the warm-up call
    assert clock.calls == 1 + (1 + 4 + 16 + 64) + 3 * 64


def test_a_workers_share_of_compute_is_its_slowdown_over_a_streaming_workers_per_worker():
    assert share(compute=1.1, slowdown=1.2) == 0.5
    assert share(compute=1.1, slowdown=1.2, workers=2) == 0.25
    assert share(compute=1.5, slowdown=1.2) == 1.0  # clamped
    assert share(compute=0.98, slowdown=1.2) == 0.0  # noise below 1 is no speed-up
    assert share(compute=1.3, slowdown=1.0) == 0.0  # a streaming worker that costs nothing: no share to scale by
