"""Waiting for a background thread or process without a clock in the assertion: poll until done. A hang is caught
by pytest-timeout (pyproject.toml), never by a deadline here, so a slow machine cannot fail a test."""

import time


def until(condition) -> None:
    """Return once `condition()` is true."""
    while not condition():
        time.sleep(0.005)
