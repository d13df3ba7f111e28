"""`hetero run` watching the process's host-memory peak against the plan's DRAM budget.

A thread reads the peak as a memory limit charges it (hetero.run.process_memory) every `interval_s`. The first time it
comes within `margin` of the budget it warns once, naming the largest entries of the plan's account (`predicted.dram`);
the first time it passes the budget it says so, with the entry most to blame: the one whose measured bytes (what the
mechanisms report holding; the rest of the process is the plan's first entry) exceed the plan's most. The summary says
whether the budget was kept. It never stops the run.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

from hetero.plan import footprint
from hetero.plan.policy import POLICY
from hetero.run import process_memory
from hetero.run.mechanism import Mechanism
from hetero.schema.plan import Budget, Predicted
from hetero.units import SIZE

INTERVAL_S = 0.05
# What a mechanism reports holding in host memory (its `resident_bytes`), by the plan's entry it is counted in.
MEASURED_AS = {"optimizer states": footprint.OPTIMIZER, "optimizer states (emulated AXDIMM)": footprint.OPTIMIZER,
               footprint.STAGING: footprint.STAGING}


@dataclass(frozen=True, slots=True)
class Blame:
    entry: str
    predicted_bytes: int
    measured_bytes: int


def warning_line(peak: int, budget: int, contributors: dict[str, int], top: int = 3) -> str:
    """`host memory peak 1.93GiB is within 5% of the plan's 2GiB DRAM budget; largest by the plan: ...`."""
    largest = sorted(((b, what) for what, b in contributors.items() if b > 0), reverse=True)[:top]
    named = ", ".join(f"{what} {SIZE.format_short(b)}" for b, what in largest) or "none recorded in the plan"
    over = "over" if peak > budget else f"within {POLICY.warn_share:.0%} of"
    return (f"host memory peak {SIZE.format_short(peak)} is {over} the plan's {SIZE.format_short(budget)} DRAM "
            f"budget; largest by the plan's accounting: {named}")


def blame(peak: int, account: dict[str, int], held: dict[str, int]) -> Blame | None:
    """The entry of the plan's `account` (signed bytes, its first entry the process's base) whose measured bytes
    exceed the predicted most: `held` is what the mechanisms measured, by entry; the base is measured as the peak
    less every other entry (measured where the mechanisms hold it, else as predicted)."""
    if not account:
        return None
    base = next(iter(account))
    measured = {entry: held[entry] for entry in account if entry in held and entry != base}
    others = sum(measured.get(entry, b) for entry, b in account.items() if entry != base)
    measured[base] = peak - others
    worst = max(measured, key=lambda entry: measured[entry] - account[entry])
    return Blame(worst, account[worst], measured[worst])


def over_line(peak: int, budget: int, predicted: int, worst: Blame | None) -> str:
    """`host memory 1.05GiB is over the plan's 1GiB DRAM budget (predicted 950MiB); most to blame: ...`."""
    line = (f"host memory {SIZE.format_short(peak)} is over the plan's {SIZE.format_short(budget)} DRAM budget "
            f"(predicted {SIZE.format_short(predicted)})")
    if worst is None:
        return line
    return (f"{line}; most to blame by the plan's account: {worst.entry}, predicted "
            f"{SIZE.format_short(worst.predicted_bytes)}, measured {SIZE.format_short(worst.measured_bytes)} "
            f"({SIZE.format_short(worst.measured_bytes - worst.predicted_bytes)} more)")


class BudgetWatch(Mechanism):
    """Watches the peak against `budget.dram_budget_bytes` from install to close, by the plan's `predicted`
    account. `earlier`: the run's other mechanisms, whose host memory it measures when the budget is passed."""

    def __init__(self, budget: Budget, predicted: Predicted, earlier: list[Mechanism] | tuple = (),
                 interval_s: float = INTERVAL_S, out=None):
        self.budget = budget.dram_budget_bytes
        self.contributors = dict(predicted.dram)
        self.account = dict(predicted.dram) | {k: -b for k, b in predicted.dram_saved.items()}
        self.predicted = sum(self.account.values())
        self.others, self.interval_s = earlier, interval_s
        self.out = out or sys.stderr
        self.warned: str | None = None  # the line printed near the budget, once
        self.over: str | None = None  # the line printed when the peak passed the budget, once
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def install(self, patches, need_model) -> None:
        self._thread = threading.Thread(target=self._watch, name="hetero-budget-watch", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Compare the peak so far with the budget: warn the first time it is within the margin, and once it is over."""
        self.peak = peak = process_memory.dram_peak_bytes()
        if self.over is None and peak > self.budget:
            self.over = over_line(peak, self.budget, self.predicted, blame(peak, self.account, self._held()))
            print(f"hetero: warning: {self.over}", file=self.out, flush=True)
        elif self.warned is None and self.over is None and peak >= (1 - POLICY.warn_share) * self.budget:
            self.warned = warning_line(peak, self.budget, self.contributors)
            print(f"hetero: warning: {self.warned}", file=self.out, flush=True)

    def _held(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for m in self.others:
            for what, b in m.resident_bytes().get("host", {}).items():
                if what in MEASURED_AS:
                    held[MEASURED_AS[what]] = held.get(MEASURED_AS[what], 0) + b
        return held

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
        budget = SIZE.format_short(self.budget)
        if self.over is not None:
            return [f"the DRAM budget {budget} was not kept: {self.over}"]
        return [f"the DRAM budget {budget} was kept: peak {SIZE.format_short(self.peak)} "
                f"({self.peak / self.budget:.0%} of it)"]
