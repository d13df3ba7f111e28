"""Freed memory returned to the kernel, for the profile: what the plan's `allocator` would cost and save, and how a
profile keeps a budget it runs under.

- Without a budget, `ReturnedSteps`: right after the measured steps, a few more of the script's steps with glibc
  returning the memory freed tensors leave (the thresholds hetero.run.allocator sets for a plan's `allocator`
  section), from a trimmed heap with the kernel's high-water mark started again: the peak and the step time a plan
  that returns memory would have, measured in the profile's own process (its CLI, hooks and records included, so
  a little above a fresh process's; `hetero plan` measures the plan it chooses under a budget in fresh processes:
  hetero.launch.trials).
- Under a budget (a memory cgroup, or `hetero profile --dram-budget`), plain training might not fit, and the
  profile must not die of it: `Budgeted` returns freed memory from before the script's first allocation, the most
  memory-saving setting hetero can apply to a script it does not yet drive. Plain's own peak is then not measured:
  the profile writes the measured one as an estimate and says so.
"""

from __future__ import annotations

import time

from hetero.run import allocator, process_memory
from hetero.schema.plan import AllocatorPlan
from hetero.units import SIZE

TIMED_STEPS = 2  # the steps with freed memory returned that are timed, after the one that pays the switch


def returning() -> bool:
    """Set the thresholds the plan's `allocator` section uses and trim; False where malloc is not glibc."""
    ok = allocator.set_thresholds(AllocatorPlan.RETURNING, AllocatorPlan.RETURNING)
    return ok and allocator.trim()


def restore() -> None:
    allocator.set_thresholds(allocator.RESTORED_MMAP_BYTES, allocator.RESTORED_TRIM_BYTES)


class ReturnedSteps:
    """A few of the script's steps after the others with glibc returning the memory freed tensors leave (the plan's
    `allocator`), in the profile's own process: from a trimmed heap, with the kernel's high-water mark started
    again, the peak they reach and their step time (the first step pays the switch and is not timed)."""

    STEPS = 1 + TIMED_STEPS

    def __init__(self):
        self.ends: list[float] = []
        self.applied = False
        self.result: tuple[int, float] | None = None  # (peak bytes, step seconds); None: the script ended first

    def start(self) -> bool:
        """Switch to returning freed memory; False where that cannot be done or measured (not glibc, no /proc)."""
        self.applied = returning()
        if self.applied and process_memory.reset_peak():
            return True
        self.close()
        return False

    def step_ended(self) -> bool:
        """Count a step; true once the last one has ended (what they measured is read then)."""
        self.ends.append(time.perf_counter())
        if len(self.ends) < self.STEPS:
            return False
        timed = self.ends[-TIMED_STEPS - 1:]
        self.result = process_memory.dram_peak_bytes(), (timed[-1] - timed[0]) / TIMED_STEPS
        return True

    def close(self) -> None:
        if self.applied:
            restore()
            self.applied = False


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
