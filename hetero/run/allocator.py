"""The plan's `allocator` section: glibc's malloc told to give freed memory back to the kernel.

By default glibc keeps freed tensors' memory inside its heaps, so the resident set stays at its high-water mark and a
memory limit counts it. A low M_MMAP_THRESHOLD maps each large block on its own and unmaps it when freed; a low
M_TRIM_THRESHOLD returns the top of a heap (setting either also stops glibc raising the mmap threshold itself). The
cost, page faults when blocks are mapped again, is what `hetero profile` measures and the plan counts (fewer with huge
pages: hetero.run.huge_pages).

The runtime applies the plan's values before the script runs or, with `from_bytes`, once the process first holds that
much; without the section malloc keeps its defaults. Below `from_bytes`, a backward call that ends holding the policy's
`trim_growth_share` of `from_bytes` more than any before trims the heaps (malloc_trim), so they grow within a bound.
From the switch on, the heaps are trimmed every interval until the next backward ends (the holes the tensors live at
the switch leave when freed). Without glibc (no `mallopt`) nothing can be set, and the runtime says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

from hetero.harness import watch
from hetero.plan.policy import POLICY
from hetero.run import huge_pages, process_memory
from hetero.run.mechanism import Mechanism
from hetero.schema.plan import AllocatorPlan
from hetero.units import SIZE

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
# What `close` restores: glibc's own ceiling for its dynamic mmap threshold on 64-bit systems, and the trim threshold
# it pairs with it (2x). glibc's starting values (128 KiB) cannot be restored once set: they would stay fixed.
RESTORED_MMAP_BYTES = 32 << 20
RESTORED_TRIM_BYTES = 64 << 20
# How often the resident set is read with `from_bytes`: what filling fresh pages adds between two reads must stay
# inside the plan's headroom under its budget (hetero.plan.policy.MemoryPolicy.profile_headroom).
WATCH_INTERVAL_S = 0.005


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def set_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """Set glibc's two thresholds; False where the C library is not glibc (nothing set)."""
    if (libc := _libc()) is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap_bytes))) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_bytes)))


def trim() -> bool:
    """Return the free memory inside every heap now (malloc_trim(0)); False where it could not be done."""
    libc = _libc()
    return libc is not None and libc.malloc_trim(ctypes.c_size_t(0)) >= 0


class ReturnFreedMemory(Mechanism):
    """Applies the plan's `allocator` section for the run: from the start, or, with
    `from_bytes`, once a watching thread sees the resident set reach it."""

    def __init__(self, plan: AllocatorPlan, interval_s: float = WATCH_INTERVAL_S):
        self.plan, self.interval_s = plan, interval_s
        self.applied = False  # the thresholds are set now
        self.ever_applied = False  # for the summary, read after `close`
        self.returned_at: int | None = None  # the resident bytes that made it return memory (with `from_bytes`)
        self.trims = 0  # malloc_trim calls below the switch and while its holes are returned
        self._trimming = False  # since the switch, until a backward call has ended
        self._ended_at = 0  # the most resident bytes a backward below the switch ended with
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backward: watch.Handle | None = None

    def install(self, patches, need_model) -> None:
        if self.plan.from_bytes is None:
            glibc = self._apply()
        elif glibc := _libc() is not None:
            self._backward = watch.backward_calls(self._backward_ended)
            self._thread = threading.Thread(target=self._watch, name="hetero-malloc-watch", daemon=True)
            self._thread.start()
        if not glibc:
            print("hetero: warning: the plan asks malloc to return freed memory, but the C library is not glibc "
                  "(no mallopt): the process may peak above the plan's prediction", file=sys.stderr)

    def _apply(self) -> bool:
        self.applied = set_thresholds(self.plan.mmap_threshold_bytes, self.plan.trim_threshold_bytes)
        self.ever_applied |= self.applied
        if self.applied:
            trim()  # what is free now goes back before the next allocation
        return self.applied

    def _backward_ended(self) -> None:
        if self.applied:
            self._trimming = False
            self._backward.remove()
            self._backward = None
            self._trim()
        else:
            resident = process_memory.resident_bytes()
            if resident >= self._ended_at + int(self.plan.from_bytes * POLICY.trim_growth_share):
                self._trim()
            self._ended_at = max(self._ended_at, resident)

    def _trim(self) -> None:
        self.trims += trim()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.applied:
                if not self._trimming:
                    return
                self._trim()
                continue
            resident = process_memory.resident_bytes()
            if resident >= self.plan.from_bytes:
                self.returned_at = resident
                self._trimming = True
                self._apply()

    def close(self) -> None:
        self._stop.set()
        if self._backward is not None:
            self._backward.remove()
            self._backward = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.applied:
            set_thresholds(RESTORED_MMAP_BYTES, RESTORED_TRIM_BYTES)
            self.applied = False

    def summary(self) -> list[str]:
        settings = (f"mmap threshold {self.plan.mmap_threshold_bytes} B, trim threshold "
                    f"{self.plan.trim_threshold_bytes} B, "
                    f"{'huge pages' if huge_pages.in_use(os.environ) else 'without huge pages'}")
        if self.plan.from_bytes is None:
            return [f"malloc returned freed memory ({settings})"] if self.ever_applied else []
        if self.returned_at is None:
            return [f"malloc kept its defaults: the process stayed under {SIZE.format_short(self.plan.from_bytes)} "
                    f"(the heaps' free memory returned after {self.trims} backward calls that grew them)"]
        return [f"malloc returned freed memory ({settings}) from {SIZE.format_short(self.returned_at)} resident on"]
