"""Direct Host Access (MemFerry §III-B): CUDA tensors whose bytes stay in pinned host memory, and the GPU devices
the shadow model and the optimizer's gradient copies drive, found through `devices` (the seam where the tests put a
CPU stand-in). Memory is handled as flat bytes; `carve` views a parameter in them.

A zero-copy view is `torch.as_tensor` over an object exposing `__cuda_array_interface__` (no compiler needed); the
view's storage keeps that object, and so the host tensor, alive. The device pointer comes from
`cudaHostGetDevicePointer` through ctypes on torch's CUDA runtime; where that library cannot be found, the host
pointer itself, valid on the device under unified addressing. A device without unified addressing is refused
(plan without DHA there).
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
from typing import Any, Protocol

import numpy as np
import torch

from hetero.errors import STALE_PLAN, HeteroError

_UNIFIED_ADDRESSING = 41  # cudaDevAttrUnifiedAddressing
NO_DHA_HINT = "plan without DHA on this machine: edit plan.yaml so every layer is `mode: gfgb, grad: gpu`"
PAGE = 4096
_REGISTER_PORTABLE_MAPPED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped


class HostMapping:
    """The device side of pinned host bytes, as `torch.as_tensor` reads it (raw bytes, so every dtype maps)."""

    __slots__ = ("host", "pointer")

    def __init__(self, host: torch.Tensor, pointer: int):
        self.host, self.pointer = host, pointer

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.host.numel(),), "typestr": "|u1", "data": (self.pointer, False), "version": 3,
                "strides": None}


class _Locked(np.ndarray):
    """Host memory page-locked with cudaHostRegister; unregistered when the last tensor over it is gone (torch's
    storage made by `from_numpy` holds this array)."""

    def __del__(self) -> None:
        if (pointer := getattr(self, "_registered", None)) is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(pointer)
            except Exception:  # interpreter shutdown: the process frees everything anyway
                pass


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded with torch (found in /proc/self/maps), or None."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        with contextlib.suppress(OSError):
            return ctypes.CDLL(path)
    return None


def pinned_host(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory (uint8): registered with CUDA directly where hetero can ask for its device
    address (torch's pinned allocator rounds up to a power of two), else torch's."""
    if _cudart() is None or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    size = -(-nbytes // PAGE) * PAGE
    raw = np.empty(size + PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % PAGE
    locked = raw[start:start + size].view(_Locked)
    if int(torch.cuda.cudart().cudaHostRegister(locked.ctypes.data, size, _REGISTER_PORTABLE_MAPPED)) != 0:
        _cudart().cudaGetLastError()  # clear it: torch checks the last error after its own kernel launches
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    locked._registered = locked.ctypes.data
    return torch.from_numpy(locked)[:nbytes]


def device_pointer(host: torch.Tensor, device: torch.device) -> int:
    """The device address of pinned `host` memory (asked for the allocation's start, then offset)."""
    if (lib := _cudart()) is None:
        return host.data_ptr()  # unified addressing: the host pointer of cudaHostAlloc memory is the device pointer
    unified = ctypes.c_int(0)
    lib.cudaDeviceGetAttribute(ctypes.byref(unified), _UNIFIED_ADDRESSING, device.index or 0)
    if not unified.value:
        raise HeteroError(f"{torch.cuda.get_device_name(device)} has no unified addressing: hetero cannot map "
                          "pinned host memory into the GPU", hint=NO_DHA_HINT, exit_code=STALE_PLAN)
    base = host.untyped_storage().data_ptr()
    pointer = ctypes.c_void_p()
    err = lib.cudaHostGetDevicePointer(ctypes.byref(pointer), ctypes.c_void_p(base), 0)
    if err != 0:
        lib.cudaGetLastError()  # not left for torch's next launch check to trip over
        raise HeteroError(f"cudaHostGetDevicePointer failed (CUDA error {err}) for pinned memory at {base:#x}",
                          hint=NO_DHA_HINT, exit_code=STALE_PLAN)
    return pointer.value + (host.data_ptr() - base)


def map_host(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor on `device` over the bytes of `host` (pinned uint8, contiguous): kernels reading or
    writing it go over the link to host memory. The view has its own storage, which keeps `host` alive."""
    if host.dtype != torch.uint8 or host.dim() != 1 or not host.is_contiguous() or not host.is_pinned():
        raise ValueError("map_host needs a flat, contiguous uint8 tensor in pinned host memory")
    pointer = device_pointer(host, device)
    view = torch.as_tensor(HostMapping(host, pointer), device=device)
    if view.data_ptr() != pointer or view.device != device:
        raise HeteroError(f"torch copied pinned host memory to {view.device} instead of mapping it on {device}",
                          hint=NO_DHA_HINT, exit_code=STALE_PLAN)
    return view


ALIGN = 256  # bytes: each tensor in a flat buffer starts where vector loads and copies like it


def offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each of several tensors of these byte sizes starts in one flat buffer, and the buffer's size."""
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += -(-size // ALIGN) * ALIGN
    return out, total


def carve(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of `flat` from `offset`, viewed with `like`'s dtype and shape."""
    return flat[offset:offset + like.numel() * like.element_size()].view(like.dtype).view(like.shape)


# -- the devices the shadow model drives ---------------------------------------------------------------------------


class Device(Protocol):
    """Memory and ordering for the shadow model, the optimizer's gradient copies and activations tiered to host
    memory, on one device. `compute` is the stream the model runs on; `copy` serves host-to-device copies in issue
    order; `download` and `upload` use two more side streams. `buffer` allocates on the compute stream only; side
    streams only touch memory whose owner keeps it alive until their work is known done, never `record_stream`."""

    kind: str
    name: str
    device: torch.device  # where the device's tensors are (the CPU for the stand-in)

    def pinned(self, nbytes: int) -> torch.Tensor: ...
    def alias(self, host: torch.Tensor) -> torch.Tensor: ...
    def buffer(self, nbytes: int) -> torch.Tensor: ...
    def event(self, name: str) -> Any: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def record_copy(self, event: Any) -> None: ...
    def record_compute(self, event: Any) -> None: ...
    def copy_waits(self, event: Any) -> None: ...
    def compute_waits(self, event: Any) -> None: ...
    def synchronize(self, event: Any) -> None: ...
    def query(self, event: Any) -> bool:
        """Whether the work before `event` is done (an event never recorded: True)."""
    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def limit(self, nbytes: int | None) -> None:
        """Cap the memory this process may reserve on the device (None: the whole device)."""

    def peak_reserved(self) -> int:
        """The most memory this process has reserved on the device."""

    def download(self, dst: torch.Tensor, src: torch.Tensor, ready: Any, after: tuple = ()) -> Any:
        """Copy device `src` into host `dst` after `ready` (`src` written) and the events `after`, without waiting;
        the returned event completes when `dst` holds the bytes. The caller keeps `src` alive until then."""

    def upload(self, dst: torch.Tensor, src: torch.Tensor, after: tuple = ()) -> Any:
        """Copy `src` into device `dst` on the upload stream, after the events `after`; the returned event completes
        when `dst` holds the bytes (and every earlier upload is done). The caller keeps both alive until then."""

    def host_view(self, t: torch.Tensor) -> torch.Tensor | None:
        """The host tensor over the same bytes when `t` views pinned memory through `alias`, else None."""


NO_CUDA = HeteroError("the plan places layers on a GPU (its `layers` section), but this machine has no CUDA device",
                      hint="run it on the GPU machine it was planned for, or plan again here: hetero profile, then "
                           "hetero plan", exit_code=STALE_PLAN)


class CudaDevice:
    """One GPU: DHA views of pinned memory, GPU buffers, and its side streams for the whole run."""

    kind = "cuda"

    def __init__(self, index: int | None = None):
        if not torch.cuda.is_available():
            raise NO_CUDA
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.name = str(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)
        self.h2d = torch.cuda.Stream(self.device)  # uploads: activations coming back, beside the weights' copies
        self.mapped: dict[int, tuple[int, torch.Tensor]] = {}  # device address of an alias -> (its end, host tensor)
        self.starts: list[int] = []  # the aliases' device addresses, sorted

    def pinned(self, nbytes: int) -> torch.Tensor:
        return pinned_host(nbytes)

    def alias(self, host: torch.Tensor) -> torch.Tensor:
        if host.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        view = map_host(host, self.device)
        self.mapped[view.data_ptr()] = (view.data_ptr() + host.numel(), host)
        bisect.insort(self.starts, view.data_ptr())
        return view

    def buffer(self, nbytes: int) -> torch.Tensor:
        # on the calling thread's current stream, the compute stream; no record_stream (see Device)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def event(self, name: str) -> torch.cuda.Event:
        return torch.cuda.Event()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def download(self, dst: torch.Tensor, src: torch.Tensor, ready: torch.cuda.Event,
                 after: tuple = ()) -> torch.cuda.Event:
        # not on the compute stream: the copy would queue behind every backward kernel issued so far
        return _side_copy(self.d2h, dst, src, (ready, *after))

    def upload(self, dst: torch.Tensor, src: torch.Tensor, after: tuple = ()) -> torch.cuda.Event:
        return _side_copy(self.h2d, dst, src, after)

    def host_view(self, t: torch.Tensor) -> torch.Tensor | None:
        ptr = t.data_ptr()
        i = bisect.bisect_right(self.starts, ptr) - 1
        if t.device != self.device or i < 0:
            return None
        start = self.starts[i]
        end, host = self.mapped[start]
        return None if ptr + t.numel() * t.element_size() > end else carve(host, ptr - start, t)

    def record_copy(self, event: torch.cuda.Event) -> None:
        event.record(self.stream)

    def record_compute(self, event: torch.cuda.Event) -> None:
        event.record(torch.cuda.current_stream(self.device))

    def copy_waits(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def compute_waits(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def limit(self, nbytes: int | None) -> None:
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if nbytes is None else min(1.0, nbytes / total), self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)  # on the compute stream, after the kernel that produced src


def _side_copy(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, after: tuple) -> torch.cuda.Event:
    """`dst <- src` on `stream` once the events `after` are done; the event that ends the copy."""
    with torch.cuda.stream(stream):
        for event in after:
            stream.wait_event(event)
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


class CudaDevices:
    """The GPUs of this process, one `CudaDevice` each, opened when first needed by the device a tensor is on."""

    kind = "cuda"

    def __init__(self):
        self.opened: dict[int, CudaDevice] = {}

    def check(self) -> None:
        if not torch.cuda.is_available():
            raise NO_CUDA

    def open(self, device: torch.device) -> CudaDevice:
        index = torch.cuda.current_device() if device.index is None else device.index
        if index not in self.opened:
            self.opened[index] = CudaDevice(index)
        return self.opened[index]

    def of(self, t: torch.Tensor) -> CudaDevice | None:
        """The device of a CUDA tensor, None for a host one."""
        return self.open(t.device) if t.is_cuda else None

    def for_model(self, model: torch.nn.Module) -> CudaDevice:
        """The GPU the model's parameters are on (the current one while they are still on the host)."""
        return self.open(next((p.device for p in model.parameters() if p.is_cuda), torch.device("cuda")))


class Devices(Protocol):
    """The devices of this process, as the GPU code paths find them through `devices`."""

    kind: str

    def check(self) -> None:
        """Raise a HeteroError where there is no device to run on."""

    def of(self, t: torch.Tensor) -> Device | None:
        """The device holding tensor `t`, None for a host one."""

    def for_model(self, model: torch.nn.Module) -> Device:
        """The device the model's parameters are on (the current one while they are still on the host)."""


# where the GPU code paths find their devices: this process's GPUs, or the tests' CPU stand-in
devices: Devices = CudaDevices()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors start at the same address (a view of host memory and the host tensor itself included)."""
    return a.data_ptr() == b.data_ptr()
