"""The plan's `allocator` section: glibc's malloc told to give freed memory back to the kernel.

By default glibc keeps what freed tensors leave inside its heaps for the next allocation; the process's resident
memory then stays at its high-water mark, and a memory limit counts it (docs/benchmarks.md, "Why the default plan
runs plain on a CPU": evicting saved activations lowered nothing). With a low M_MMAP_THRESHOLD each large block is
mapped on its own and unmapped when freed, and a low M_TRIM_THRESHOLD returns the top of a heap; that costs page
faults each time a block is mapped again, which `hetero profile` measures and the plan counts. Setting either
threshold also stops glibc from raising the mmap threshold by itself.

The runtime applies the plan's values before the script runs and decides nothing: without the section, malloc
keeps its defaults. Elsewhere than glibc (no `mallopt` symbol) nothing can be set, and the runtime says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from hetero.schema.plan import AllocatorPlan

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
# What `close` restores: glibc's own ceiling for its dynamic mmap threshold on 64-bit systems, and the trim threshold
# it pairs with it (2x). glibc's starting values (128 KiB) cannot be restored once set: they would stay fixed.
RESTORED_MMAP_BYTES = 32 << 20
RESTORED_TRIM_BYTES = 64 << 20


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def set_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """Set glibc's two thresholds; False where the C library is not glibc (nothing set)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap_bytes))) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_bytes)))


def trim() -> bool:
    """Return the free memory inside every heap now (malloc_trim(0)); False where it could not be done."""
    libc = _libc()
    return libc is not None and libc.malloc_trim(ctypes.c_size_t(0)) >= 0


class ReturnFreedMemory:
    """Applies the plan's `allocator` section for the run (a runtime Mechanism)."""

    def __init__(self, plan: AllocatorPlan):
        self.plan = plan
        self.applied = False

    def install(self, patches, need_model) -> None:
        self.applied = set_thresholds(self.plan.mmap_threshold_bytes, self.plan.trim_threshold_bytes)
        if self.applied:
            trim()  # what hetero's own start-up freed goes back before the script's first allocation
        else:
            print("hetero: warning: the plan asks malloc to return freed memory, but the C library is not glibc "
                  "(no mallopt): the process may peak above the plan's prediction", file=sys.stderr)

    def bind(self, model) -> None:
        pass

    def close(self) -> None:
        if self.applied:
            set_thresholds(RESTORED_MMAP_BYTES, RESTORED_TRIM_BYTES)
            self.applied = False

    def summary(self) -> list[str]:
        if not self.applied:
            return []
        return [f"malloc returned freed memory (mmap threshold {self.plan.mmap_threshold_bytes} B, trim threshold "
                f"{self.plan.trim_threshold_bytes} B)"]

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        return {}
