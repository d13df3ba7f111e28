"""Waiting for a background thread or process without a clock in the assertion: poll until done. A hang is caught
by pytest-timeout (pyproject.toml), so a slow machine cannot fail a test; a wait that is itself what the test checks
(a process that must end) gives `within`, a deadline far above what the wait takes on a loaded machine and below
the test's timeout, so that a failure says what did not happen rather than that the test ran out of time."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(condition: Callable[[], object], within: float | None = None,
          what: str | Callable[[], str] = "the condition") -> None:
    """Return once `condition()` is true (None: a hook may return it). With `within`, an AssertionError saying
    `what` (a string, or a function that says it at that moment) if it is still false after that many seconds."""
    deadline = None if within is None else time.monotonic() + within
    while not condition():
        if deadline is not None and time.monotonic() > deadline:
            raise AssertionError(f"not within {within:g} s: {what() if callable(what) else what}")
        time.sleep(0.005)
