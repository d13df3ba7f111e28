"""`hetero run` watching the process's host-memory peak against the plan's DRAM budget.

A thread reads the kernel's high-water mark (VmHWM, which no sampling can miss: the kernel keeps it) every
`interval_s`; the first time it comes within `margin` of the budget it prints one warning naming the largest
contributors to the peak by the plan's own accounting (`predicted.dram`), so the user sees what to move. It warns
once, and never stops the run: the budget is the plan's promise, a memory limit the kernel's.
"""

from __future__ import annotations

import sys
import threading

from hetero.run import process_memory
from hetero.schema.plan import Plan
from hetero.units import SIZE

MARGIN = 0.05  # warn within 5% of the budget
INTERVAL_S = 0.05


def warning_line(peak: int, budget: int, contributors: dict[str, int], top: int = 3) -> str:
    """`host memory peak 1.93GiB is within 5% of the plan's 2GiB DRAM budget; largest by the plan: ...`."""
    largest = sorted(((b, what) for what, b in contributors.items() if b > 0), reverse=True)[:top]
    named = ", ".join(f"{what} {SIZE.format_short(b)}" for b, what in largest) or "none recorded in the plan"
    over = "over" if peak > budget else f"within {MARGIN:.0%} of"
    return (f"host memory peak {SIZE.format_short(peak)} is {over} the plan's {SIZE.format_short(budget)} DRAM "
            f"budget; largest by the plan's accounting: {named}")


class BudgetWatch:
    """A runtime Mechanism: watches VmHWM against `plan.budget.dram_budget_bytes` from install to close."""

    def __init__(self, plan: Plan, interval_s: float = INTERVAL_S, out=None):
        self.budget = plan.budget.dram_budget_bytes
        self.contributors = dict(plan.predicted.dram)
        self.interval_s = interval_s
        self.out = out or sys.stderr
        self.warned: str | None = None  # the line printed, once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def install(self, patches, need_model) -> None:
        self._thread = threading.Thread(target=self._watch, name="hetero-budget-watch", daemon=True)
        self._thread.start()

    def bind(self, model) -> None:
        pass

    def check(self) -> None:
        """Compare the peak so far with the budget; warn the first time it is within the margin."""
        peak = process_memory.dram_peak_bytes()
        if self.warned is None and peak >= (1 - MARGIN) * self.budget:
            self.warned = warning_line(peak, self.budget, self.contributors)
            print(f"hetero: warning: {self.warned}", file=self.out, flush=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()  # a peak reached after the last poll

    def summary(self) -> list[str]:
        return []

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        return {}
