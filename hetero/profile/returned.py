"""What returning freed memory does to the script's training: its peak and its step time, measured so that the plan
can count both (hetero.plan.fit's `allocator` lever).

Two ways, one per case:
- Without a budget, after the other measured steps, `ReturnedSteps` sets glibc's thresholds as the runtime would
  (hetero.run.allocator), returns what the heap holds free (malloc_trim), restarts the kernel's high-water mark
  and runs `STEPS` more steps: their peak, and the mean time of all but the first (which also faults back what the
  trim returned).
- Under a budget (a memory cgroup, or `hetero profile --dram-budget`), plain training might not fit, and the
  profile must not die of it: `Budgeted` returns freed memory from before the script's first allocation, the
  most memory-saving setting hetero can apply to a script it does not yet drive. Plain's own peak is then not
  measured: the profile writes the measured one as an estimate (a lower bound) and says so.
"""

from __future__ import annotations

import time

from hetero.plan.fit import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES
from hetero.run import allocator, process_memory
from hetero.units import SIZE

STEPS = 3


def returning() -> bool:
    """Set the thresholds the plan's `allocator` section uses and trim; False where malloc is not glibc."""
    ok = allocator.set_thresholds(MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)
    return ok and allocator.trim()


def restore() -> None:
    allocator.set_thresholds(allocator.RESTORED_MMAP_BYTES, allocator.RESTORED_TRIM_BYTES)


class ReturnedSteps:
    """`STEPS` optimizer steps with freed memory returned; `step_ended` after each, True after the last."""

    def __init__(self):
        self.ends: list[float] = []
        self.peak_bytes: int | None = None
        self.active = False

    def start(self) -> bool:
        if not returning() or not process_memory.reset_peak():
            restore()
            return False
        self.active = True
        self.ends = [time.perf_counter()]
        return True

    def step_ended(self) -> bool:
        self.ends.append(time.perf_counter())
        if len(self.ends) <= STEPS:
            return False
        self.peak_bytes = process_memory.dram_peak_bytes()
        self.close()
        return True

    def step_s(self) -> float | None:
        """Mean time of the steps after the first, once all ran."""
        if self.peak_bytes is None:
            return None
        times = [b - a for a, b in zip(self.ends[1:], self.ends[2:])]
        return sum(times) / len(times)

    def close(self) -> None:
        if self.active:
            restore()
            self.active = False


def budget_of(option_bytes: int | None) -> tuple[int, str] | None:
    """The budget the profile keeps: `--dram-budget`, else the memory cgroup's limit; None: none."""
    if option_bytes is not None:
        return option_bytes, f"--dram-budget {SIZE.format_short(option_bytes)}"
    limit = process_memory.memory_limit_bytes()
    return (limit, f"the {SIZE.format_short(limit)} memory cgroup") if limit is not None else None


class Budgeted:
    """The whole profile under a budget, freed memory returned from the start."""

    def __init__(self, budget: tuple[int, str]):
        self.budget_bytes, self.source = budget
        self.applied = returning()

    @property
    def profiled_under(self) -> str:
        how = "freed memory returned from the start" if self.applied else \
            "nothing could be moved (malloc is not glibc)"
        return f"{how}, under {self.source}"

    def close(self) -> None:
        if self.applied:
            restore()
            self.applied = False
