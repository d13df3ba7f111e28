"""What the whole process holds: the figures a user pays for and a memory limit counts.

Host memory is the resident set (RSS) as the kernel counts it, interpreter, libraries and allocator slack
included; its peak is the kernel's own high-water mark (VmHWM), so no sampling can miss it. On a GPU, torch's
caching allocator's peaks: `allocated` (live tensors) and `reserved` (what the GPU has given the process).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuPeak:
    allocated_bytes: int
    reserved_bytes: int


def dram_peak_bytes() -> int:
    """Peak resident memory of this process so far."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def gpu_peak(device) -> GpuPeak | None:
    """torch's peaks on `device` (a torch.device), or None when it is not a CUDA device."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return GpuPeak(allocated_bytes=torch.cuda.max_memory_allocated(device),
                   reserved_bytes=torch.cuda.max_memory_reserved(device))


def peak_line(measured: int, predicted: int | None, plain: int | None, what: str = "dram peak") -> str:
    """`dram peak 1.2GiB: 0.98x plain's 1.22GiB (profile); predicted 1.21GiB, measured -1%`."""
    from hetero.units import SIZE

    line = f"{what} {SIZE.format_short(measured)}"
    if plain:
        line += f": {measured / plain:.2f}x plain's {SIZE.format_short(plain)} (profile)"
    if predicted:
        line += f"; predicted {SIZE.format_short(predicted)}, measured {measured / predicted - 1:+.0%}"
    return line
