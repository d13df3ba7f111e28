"""Freed memory returned to the kernel, for the profile: what the plan's `allocator` would cost and save, and how a
profile keeps a budget it runs under.

- Without a budget, `ReturnedSteps`: after the measured steps, a few more with glibc returning freed memory (the
  thresholds of a plan's `allocator`), from a trimmed heap and a reset high-water mark: their peak and step time.
- Under a budget (a memory cgroup, or `--dram-budget`), `Budget` returns freed memory from the start and moves what
  else it can (hetero.profile.conservative, hetero.profile.pressure); plain's peak is then written as an estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from hetero.harness.capture import Capture
from hetero.profile.conservative import Conservative
from hetero.profile.instruments import Instrument
from hetero.profile.pressure import UnderPressure
from hetero.run import allocator, process_memory
from hetero.schema.plan import AllocatorPlan
from hetero.schema.profile import Layer, Memory
from hetero.units import SIZE

TIMED_STEPS = 2  # the steps with freed memory returned that are timed, after the one that pays the switch


def returning() -> bool:
    """Set the thresholds the plan's `allocator` section uses and trim; False where malloc is not glibc."""
    return allocator.set_thresholds(AllocatorPlan.RETURNING, AllocatorPlan.RETURNING) and allocator.trim()


def restore(applied: bool) -> bool:
    """Malloc's defaults again where `returning` was `applied`; False: applied no more."""
    if applied:
        allocator.set_thresholds(allocator.RESTORED_MMAP_BYTES, allocator.RESTORED_TRIM_BYTES)
    return False


class ReturnedSteps(Instrument):
    """A few of the script's steps with glibc returning freed memory (the plan's `allocator`): the peak they reach
    and their step time (the first step pays the switch and is not timed)."""

    PHASE = "freed memory returned"  # the profile's progress phase
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
        self.applied = restore(self.applied)


class Budget(Instrument):
    """The budget the profile keeps: `--dram-budget` (`asked_bytes`), else the memory cgroup's limit; with none,
    every call is a no-op. It returns freed memory from its making; `install` moves the optimizer where plain
    training would not fit (Conservative) and recomputes blocks near the budget (UnderPressure). A cgroup limit that
    binds nothing (`Conservative.ample`) is dropped at `bind`. `close` leaves the blocks' overrides to `end`."""

    def __init__(self, asked_bytes: int | None, nvme_dir: str, progress: Callable[[str, int, int], None]):
        self.asked = asked_bytes is not None
        if asked_bytes is not None:
            self.kept: tuple[int, str] | None = asked_bytes, f"--dram-budget {SIZE.format_short(asked_bytes)}"
        else:
            limit = process_memory.memory_limit_bytes()
            self.kept = (limit, f"the {SIZE.format_short(limit)} memory cgroup") if limit is not None else None
        self.applied = self.kept is not None and returning()
        self.nvme_dir, self.progress = nvme_dir, progress
        self.conservative: Conservative | None = None
        self.pressure: UnderPressure | None = None

    @property
    def budget_bytes(self) -> int | None:
        return self.kept[0] if self.kept is not None else None

    @property
    def moved_tensors(self) -> int:
        """Parameters whose optimizer the profile kept on NVMe: its step is not plain training's."""
        return self.conservative.moved_tensors if self.conservative is not None else 0

    @property
    def moved(self) -> bool:
        """The optimizer's states and gradients are on NVMe."""
        return self.conservative is not None and self.conservative.moved_params > 0

    def install(self, capture: Capture) -> None:
        if self.kept is None:
            return
        self.conservative = Conservative(self.kept[0], self.nvme_dir, self.progress)
        self.conservative.install(capture.resolve, capture.every_optimizer_has_a_model)
        self.pressure = UnderPressure(self.kept[0], self.progress)

    def bind(self, model: nn.Module) -> None:
        if self.conservative is None:
            return
        self.conservative.bind(model)
        if self.conservative.ample and not self.asked and not self.pressure.engaged:
            self.kept = None
            self.applied = restore(self.applied)
            self.end()

    def memory(self, device: torch.device) -> Memory:
        """The whole process's peaks so far; plain training's, estimated, where the profile moved the optimizer."""
        gpu = process_memory.gpu_peak(device)
        measured_peak = process_memory.dram_peak_bytes()
        peak = self.conservative.plain_estimate(measured_peak) if self.moved else measured_peak
        estimated = self.applied or self.moved
        under = None
        if self.kept is not None:
            how = "freed memory returned from the start" if self.applied else \
                "nothing could be moved (malloc is not glibc)"
            under = f"{how}, under {self.kept[1]}"
        if self.moved:
            under = (f"{self.conservative.described()}; {under}; the peak measured that way: "
                     f"{SIZE.format_short(measured_peak)}")
        return Memory(dram_peak_bytes=peak, gpu_allocated_peak_bytes=gpu.allocated_bytes if gpu else None,
                      gpu_reserved_peak_bytes=gpu.reserved_bytes if gpu else None, dram_peak_estimated=estimated,
                      dram_peak_returned_bytes=peak if estimated else None, profiled_under=under)

    def filled(self, layers: list[Layer], output_bytes: int, memory: Memory) -> list[Layer]:
        """`layers`, those of blocks recomputed near the budget given their twins' (UnderPressure.fill), and plain
        training's estimated peak in `memory` raised by what recomputing them took off."""
        if self.pressure is None or not self.pressure.engaged:
            return layers
        layers, added = self.pressure.fill(layers, output_bytes, grads_gone=self.moved)
        memory.dram_peak_bytes += added
        memory.dram_peak_returned_bytes = memory.dram_peak_bytes
        memory.profiled_under = f"{memory.profiled_under}; {self.pressure.described(added)}"
        return layers

    def least(self) -> None:
        """Every block recomputed from now on (the profile's own forward that checks them)."""
        if self.pressure is not None:
            self.pressure.least()

    def close(self) -> None:
        if self.conservative is not None:
            self.conservative.close()
        self.applied = restore(self.applied)

    def end(self) -> None:
        """After the profile's check of the blocks: their overrides taken back."""
        if self.pressure is not None:
            self.pressure.close()
            self.pressure = None
