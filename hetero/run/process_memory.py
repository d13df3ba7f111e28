"""What the whole process holds: the figures a user pays for and a memory limit counts.

Host memory is what a memory limit charges: the resident set less the pages mapped from files (a cgroup charges a
library's file pages only to their first reader and reclaims clean ones first, so VmRSS overstates it). Its peak is
the kernel's high-water mark (VmHWM), which no sampling can miss, less the file pages mapped when it last rose
(`Peak`). On a GPU, torch's caching allocator's peaks: `allocated` (live tensors) and `reserved`.
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
from dataclasses import dataclass

from hetero.schema.run import ProcessPeaks
from hetero.units import SIZE


@dataclass(frozen=True, slots=True)
class GpuPeak:
    allocated_bytes: int
    reserved_bytes: int


def resident_bytes() -> int:
    """Host memory this process holds now as a memory limit charges it (VmRSS less RssFile); 0 without /proc."""
    status = _status("VmRSS", "RssFile")
    return max(0, status.get("VmRSS", 0) - status.get("RssFile", 0))


class _StatusFile:
    """/proc/self/status read into one buffer made once, with no allocation per read: an allocation between a
    step's large frees moves where malloc puts the next tensors, and with them the peak being measured."""

    SIZE = 1 << 14  # the fields read are in the file's first lines

    def __init__(self, path: str):
        self.path = path
        # A mapping of its own, not in malloc's heap, where it would split the room a step's freed tensors leave.
        self.buffer = mmap.mmap(-1, self.SIZE + 1)
        self.buffer[:1] = b"\n"  # a newline first: every field then follows one
        self.into = [memoryview(self.buffer)[1:]]
        self.lock = threading.Lock()  # the watch threads and the main thread share the buffer
        self.fd: int | None = None

    def read(self, fields: tuple[str, ...]) -> dict[str, int]:
        with self.lock:
            try:
                if self.fd is None:
                    self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                end = os.preadv(self.fd, self.into, 0) + 1
            except OSError:
                return {}
            return {name: value for name in fields if (value := self._field(name, end)) is not None}

    def _field(self, name: str, end: int) -> int | None:
        key = b"\n" + name.encode() + b":"
        start = self.buffer.find(key, 0, end)
        if start < 0:
            return None
        start += len(key)
        line_end = self.buffer.find(b"\n", start, end)
        stop = self.buffer.find(b"kB", start, line_end if line_end >= 0 else end)
        return int(self.buffer[start:stop]) * 1024 if stop > start else None  # a field in kB, as the ones read

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


_files: dict[str, _StatusFile] = {}


def _forked() -> None:
    # A forked child's "self" is another process, and a lock held at the fork stays held: new readers.
    for reader in _files.values():
        reader.close()
    _files.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forked)


def _status(*fields: str, path: str = "/proc/self/status") -> dict[str, int]:
    """The named fields of /proc/self/status, in bytes (those it lacks are left out; none without /proc)."""
    if not hasattr(os, "preadv"):  # no /proc either (Windows)
        return {}
    return (_files.get(path) or _files.setdefault(path, _StatusFile(path))).read(fields)


class Peak:
    """The peak of what a memory limit charges: VmHWM less the file pages mapped when VmHWM last rose. Call `read`
    often enough to see each rise of VmHWM while it is the resident set's (a watch thread, each optimizer step):
    a rise it did not see is counted with the file pages mapped when it is next read."""

    def __init__(self, path: str = "/proc/self/status"):
        self.path, self._hwm, self._peak = path, 0, 0

    def read(self) -> int:
        status = _status("VmHWM", "RssFile", path=self.path)
        hwm = status.get("VmHWM")
        if hwm is None:  # no /proc: the kernel's maximum resident set, file pages included
            return max(self._peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
        if hwm > self._hwm:
            self._hwm = hwm
            self._peak = max(self._peak, hwm - status.get("RssFile", 0))
        return self._peak


_PEAK = Peak()


def dram_peak_bytes() -> int:
    """This process's peak of host memory so far, as a memory limit charges it (`Peak`)."""
    return _PEAK.read()


def gpu_peak(device) -> GpuPeak | None:
    """torch's peaks on `device` (a torch.device), or None when it is not a CUDA device."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch  # here: the launcher reads the process's memory without importing torch

    return GpuPeak(allocated_bytes=torch.cuda.max_memory_allocated(device),
                   reserved_bytes=torch.cuda.max_memory_reserved(device))


def peaks(model) -> ProcessPeaks:
    """The process's own peaks so far: VmHWM, and torch's on the model's GPU (None: no model, or not on a GPU)."""
    gpu = gpu_peak(next((p.device for p in model.parameters()), None) if model is not None else None)
    return ProcessPeaks(dram_peak_bytes=dram_peak_bytes(),
                        gpu_allocated_peak_bytes=gpu.allocated_bytes if gpu else None,
                        gpu_reserved_peak_bytes=gpu.reserved_bytes if gpu else None)


def peak_line(measured: int, predicted: int | None, plain: int | None, what: str = "dram peak",
              plain_estimated: bool = False) -> str:
    """`dram peak 1.2GiB: 0.98x plain's 1.22GiB (profiled); predicted 1.21GiB, measured -1%`:
    plain's peak as the profile measured it the way this one is (what a memory limit charges)."""
    line = f"{what} {SIZE.format_short(measured)}"
    if plain:
        how = "estimated: profiled under a budget" if plain_estimated else "profiled"
        line += f": {measured / plain:.2f}x plain's {SIZE.format_short(plain)} ({how})"
    if predicted:
        line += f"; predicted {SIZE.format_short(predicted)}, measured {measured / predicted - 1:+.0%}"
    return line


def gpu_peak_line(device, predicted: int | None) -> str | None:
    """`gpu peak reserved 2.4GiB; predicted 2.5GiB, measured -4%; allocated 2.3GiB`, for torch's peaks on
    `device`; None when it is not a CUDA device."""
    if (peak := gpu_peak(device)) is None:
        return None
    return f"{peak_line(peak.reserved_bytes, predicted, None, 'gpu peak reserved')}; allocated " \
           f"{SIZE.format_short(peak.allocated_bytes)}"


UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as the largest page-aligned counter (9223372036854771712)


def memory_limit_bytes(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The limit of this process's memory cgroup, the tightest of its ancestors' included; None when there is none
    or cgroups cannot be read. v1: `hierarchical_memory_limit` in memory.stat (else memory.limit_in_bytes) of the
    `memory` controller's folder; v2: memory.max in the `0::` line's folder and each one above it."""
    if (found := _memory_cgroup(proc_cgroup, root)) is None:
        return None
    version, folders = found
    if version == 1:
        return _v1_limit(folders[0])
    limits = [int(value[0]) for folder in folders
              if (value := _lines(f"{folder}/memory.max")[:1]) and value[0].strip().isdigit()]
    return min(limits) if limits else None


def oom_kills(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The processes the out-of-memory killers of this process's memory cgroup and of every cgroup above it have
    killed so far, summed (compare two readings: whichever limit was hit, the sum grows); None where no count can be
    read (no cgroup, or a v1 kernel before 4.13). v1: `oom_kill` in memory.oom_control; v2: in memory.events."""
    if (found := _memory_cgroup(proc_cgroup, root)) is None:
        return None
    version, folders = found
    name = "memory.oom_control" if version == 1 else "memory.events"
    counts = [int(line.split()[1]) for folder in folders for line in _lines(f"{folder}/{name}")
              if line.startswith("oom_kill ")]
    return sum(counts) if counts else None


def _memory_cgroup(proc_cgroup: str, root: str) -> tuple[int, list[str]] | None:
    """This process's memory cgroup: its version (1 or 2), and its folder followed by each one above it up to the
    hierarchy's root; None where /proc/self/cgroup names none."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    v1 = next((path for _, controllers, path in lines if "memory" in controllers.split(",")), None)
    v2 = next((path for hierarchy, controllers, path in lines if hierarchy == "0" and controllers == ""), None)
    if v1 is None and v2 is None:
        return None
    version, base = (1, f"{root}/memory") if v1 is not None else (2, root)
    parts = [p for p in (v1 if v1 is not None else v2).split("/") if p]
    return version, ["/".join([base, *parts[:depth]]) for depth in range(len(parts), -1, -1)]


def _v1_limit(folder: str) -> int | None:
    limits = [int(line.split()[1]) for line in _lines(f"{folder}/memory.stat")
              if line.startswith("hierarchical_memory_limit ")]
    limits += [int(x) for x in _lines(f"{folder}/memory.limit_in_bytes")[:1] if x.strip().isdigit()]
    tight = min(limits, default=None)
    return tight if tight is not None and tight < UNLIMITED else None


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def clear_referenced() -> bool:
    """Clear the kernel's referenced bits of this process's pages (writing 1 to /proc/self/clear_refs), so that
    `charged_beside_bytes` counts the file pages used from now on; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("1")
    except OSError:
        return False
    return True


def charged_beside_bytes(smaps: str = "/proc/self/smaps") -> int:
    """What a memory limit charges this process beside the anonymous memory `dram_peak_bytes` counts: the file pages
    it referenced since `clear_referenced` (its libraries' code and data in use, which a limit's reclaim cannot take
    from a running process) and its page tables; 0 where /proc cannot tell."""
    used = referenced = 0
    try:
        with open(smaps) as f:
            for line in f:
                if line.startswith("Referenced:"):
                    referenced = int(line.split()[1])
                elif line.startswith("Anonymous:"):  # after Referenced in each mapping's block
                    used += max(0, referenced - int(line.split()[1]))
    except OSError:
        return 0
    return used * 1024 + _status("VmPTE").get("VmPTE", 0)


def reset_peak() -> bool:
    """Start the kernel's high-water mark (VmHWM) again from the current resident set (writing 5 to
    /proc/self/clear_refs); False where the kernel refuses."""
    global _PEAK
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    _PEAK = Peak()
    return True
