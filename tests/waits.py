"""Waiting for a background thread without a clock in the assertion: poll until done, fail only on a hang."""

import time


def until(condition, timeout_s: float = 30.0) -> None:
    """Return once `condition()` is true; fail after `timeout_s` (a hang, not a slow machine)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
