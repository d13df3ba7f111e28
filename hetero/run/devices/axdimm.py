"""AXDIMM: a DIMM whose FPGA runs Adam beside its own DRAM channels (paper §3), behind an interface after the paper's
runtime API (§4.2), and an emulated backend that enforces the arbiter's rules (§3.2): each channel is either
`normal` (only the host uses its memory) or `acceleration` (only its kernel does, on its own channel's buffers);
switching to `normal` waits for the channel's kernels (§3.3); channels are independent.

The emulation keeps each channel's DRAM in a preallocated host arena and runs hetero.kernels.adam on a worker thread
per channel, serializing compute across channels by default (`serialize_compute`): two multi-threaded fused ops at
once oversubscribe the cores, while serialized the first channel is free for the host in about half the time.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable

import torch

from hetero.errors import HeteroError
from hetero.kernels.adam import AdamKernel, Hyperparameters
from hetero.kernels.dha import pinned_host
from hetero.run import spans
from hetero.run.devices.nvme import Handle

_ALIGN = 64  # a cache line, one AVX-512 vector: every allocation starts where the vectorized kernel loads fastest


class Mode(str, Enum):
    NORMAL = "normal"
    ACCELERATION = "acceleration"


class ArbiterError(RuntimeError):
    """The caller broke the arbiter's exclusivity (a bug in hetero, not a user error)."""


@dataclass(frozen=True, eq=False)
class Allocation:
    """Bytes [offset, offset + nbytes) of one channel's DRAM. `region` names part of it (one parameter of a flat
    buffer); only what `malloc` returned can be freed."""

    channel: int
    offset: int
    nbytes: int
    root: Allocation | None = field(default=None, repr=False)  # the malloc'd allocation a region lies in

    def region(self, offset: int, nbytes: int) -> Allocation:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"region [{offset}, {offset + nbytes}) is outside an allocation of {self.nbytes} bytes")
        return Allocation(self.channel, self.offset + offset, nbytes, self.root or self)


Buffer = torch.Tensor | Allocation


@runtime_checkable
class AxdimmDevice(Protocol):
    """What a driver for a real AXDIMM implements, after the paper's runtime API (§4.2)."""

    backend: str
    channels: int
    channel_capacity_bytes: int

    def malloc(self, nbytes: int, channel: int) -> Allocation: ...
    def free(self, allocation: Allocation) -> None: ...
    def memcpy(self, dst: Buffer, src: Buffer, nbytes: int, *, through=None) -> None: ...
    def set_arbiter(self, channel: int, mode: Mode | str) -> None: ...
    def mode(self, channel: int) -> Mode: ...
    def run_adam_async(self, param: Allocation, exp_avg: Allocation, exp_avg_sq: Allocation, grad: Allocation, *,
                       hyperparameters: Hyperparameters, step: int, channel: int) -> Handle: ...
    def close(self) -> None: ...


@dataclass(eq=False)
class _Channel:
    index: int
    arena: torch.Tensor  # uint8, the channel's whole DRAM
    worker: ThreadPoolExecutor
    kernel: AdamKernel = field(default_factory=AdamKernel)  # one per worker thread: it owns a step scalar
    mode: Mode = Mode.NORMAL
    pending: int = 0  # kernels submitted and not yet done
    holes: list[tuple[int, int]] = field(default_factory=list)  # free (offset, nbytes), sorted by offset
    live: set[Allocation] = field(default_factory=set)
    cond: threading.Condition = field(default_factory=threading.Condition)  # guards every field above


class EmulatedAxdimm:
    """An AXDIMM emulated in host memory: `channels` arenas of `channel_capacity_bytes` each, allocated and touched
    up front, and one kernel worker thread per channel. `pinned`: a GPU copies into the channels (the model trains
    on it), so the arenas are page-locked where CUDA can lock them (`self.pinned` says whether it did)."""

    backend = "emulated"

    def __init__(self, channel_capacity_bytes: int, channels: int = 2, *, serialize_compute: bool = True,
                 pinned: bool = False) -> None:
        if channels < 1 or channel_capacity_bytes < _ALIGN:
            raise HeteroError(f"emulated AXDIMM with {channels} channels of {channel_capacity_bytes} bytes",
                              hint=f"use at least 1 channel of at least {_ALIGN} bytes")
        self.channels = channels
        self.channel_capacity_bytes = channel_capacity_bytes - channel_capacity_bytes % _ALIGN
        self._compute = threading.Lock() if serialize_compute else contextlib.nullcontext()
        self._channels = [self._make_channel(c, pinned) for c in range(channels)]
        self.pinned = pinned and all(ch.arena.is_pinned() for ch in self._channels)

    def _make_channel(self, index: int, pinned: bool) -> _Channel:
        arena = _arena(self.channel_capacity_bytes, pinned)
        worker = ThreadPoolExecutor(1, thread_name_prefix=f"axdimm-emulated-ch{index}")
        return _Channel(index, arena, worker, holes=[(0, self.channel_capacity_bytes)])

    def __repr__(self) -> str:
        modes = ", ".join(ch.mode.value for ch in self._channels)
        return (f"EmulatedAxdimm(backend=emulated, channels={self.channels}, "
                f"channel_capacity_bytes={self.channel_capacity_bytes}, modes=[{modes}])")

    def __enter__(self) -> EmulatedAxdimm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory management (host side, normal mode) -------------------------------------------------------------

    def malloc(self, nbytes: int, channel: int) -> Allocation:
        ch = self._channel(channel)
        size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        with ch.cond:
            for i, (offset, hole) in enumerate(ch.holes):
                if hole >= size:
                    ch.holes[i:i + 1] = [(offset + size, hole - size)] if hole > size else []
                    allocation = Allocation(channel, offset, nbytes)
                    ch.live.add(allocation)
                    return allocation
            free = sum(h for _, h in ch.holes)
            largest = max((h for _, h in ch.holes), default=0)
        raise HeteroError(f"emulated AXDIMM channel {channel} has no room for {nbytes} bytes: {free} of "
                          f"{self.channel_capacity_bytes} bytes free, largest free block {largest} bytes",
                          hint="raise the channel capacity, spread tensors over the channels, or overflow to NVMe")

    def free(self, allocation: Allocation) -> None:
        ch = self._channel(allocation.channel)
        if allocation.root is not None:
            raise ValueError("a region cannot be freed on its own; free the allocation malloc returned")
        with ch.cond:
            self._require(ch, Mode.NORMAL, "free")
            if allocation not in ch.live:
                raise ValueError(f"{allocation} is not allocated on this device (freed twice?)")
            ch.live.remove(allocation)
            size = -(-max(allocation.nbytes, 1) // _ALIGN) * _ALIGN
            ch.holes = _coalesce(sorted(ch.holes + [(allocation.offset, size)]))

    def memcpy(self, dst: Buffer, src: Buffer, nbytes: int, *, through=None) -> None:
        """Copy `nbytes` between host (or GPU) tensors and allocations, either way; channels involved must be normal.
        `through(dst_bytes, src_bytes)` moves the bytes when given (a GPU gradient comes down on a side stream that
        waits for its producer, not on the caller's current stream), and returns once they are there."""
        channels = sorted({b.channel for b in (dst, src) if isinstance(b, Allocation)})
        with contextlib.ExitStack() as held:  # lock in channel order: two copies never wait on each other
            for c in channels:
                held.enter_context(self._channel(c).cond)
            (through or torch.Tensor.copy_)(self._bytes(dst, nbytes, "memcpy"), self._bytes(src, nbytes, "memcpy"))

    def view(self, allocation: Allocation, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The allocation's memory as a flat host tensor, while its channel is normal. Emulation only (portable code
        uses memcpy); the view cannot be revoked, so using it in acceleration mode is a bug not caught here."""
        with self._channel(allocation.channel).cond:
            return _typed(self._bytes(allocation, allocation.nbytes, "view"), dtype)

    # -- arbiter and kernel --------------------------------------------------------------------------------------

    def mode(self, channel: int) -> Mode:
        return self._channel(channel).mode

    def set_arbiter(self, channel: int, mode: Mode | str) -> None:
        try:
            target = Mode(mode)
        except ValueError:
            raise ValueError(f"arbiter mode {mode!r}; use 'normal' or 'acceleration'") from None
        ch = self._channel(channel)
        with ch.cond:
            if target is Mode.NORMAL:
                ch.cond.wait_for(lambda: ch.pending == 0)  # the host polls the kernel's status (§3.3)
            ch.mode = target

    def run_adam_async(self, param: Allocation, exp_avg: Allocation, exp_avg_sq: Allocation, grad: Allocation, *,
                       hyperparameters: Hyperparameters, step: int, channel: int) -> Handle:
        """Run the Adam(W) kernel of `channel` over four equal-sized fp32 allocations on that channel."""
        ch = self._channel(channel)
        buffers = (param, grad, exp_avg, exp_avg_sq)
        with ch.cond:
            self._require(ch, Mode.ACCELERATION, "run_adam_async")
            for b in buffers:
                if b.channel != channel or b.nbytes != param.nbytes:
                    raise ValueError(f"Adam buffer {b} is not a {param.nbytes}-byte buffer on channel {channel}")
                self._check_live(ch, b)
            views = [_typed(_slice(ch, b), torch.float32) for b in buffers]
            ch.pending += 1
            future = ch.worker.submit(self._adam, ch, views, hyperparameters, step)
        future.add_done_callback(lambda _: self._finished(ch))  # after the future is done: see set_arbiter
        return Handle(future)

    def _adam(self, ch: _Channel, views: list[torch.Tensor], hp: Hyperparameters, step: int) -> None:
        with self._compute, spans.timed(f"axdimm ch{ch.index} (emulated)", "adam", 4 * views[0].nbytes):
            ch.kernel(*views, hyperparameters=hp, step=step)

    def _finished(self, ch: _Channel) -> None:
        with ch.cond:
            ch.pending -= 1
            ch.cond.notify_all()

    def close(self) -> None:
        """Wait for running kernels, stop the workers and release the arenas. Idempotent."""
        for ch in self._channels:
            self.set_arbiter(ch.index, Mode.NORMAL)
            ch.worker.shutdown(wait=True)
        self._channels = []

    def _channel(self, channel: int) -> _Channel:
        if not 0 <= channel < len(self._channels):
            raise ValueError(f"no AXDIMM channel {channel} (this emulated device has {len(self._channels)} open)")
        return self._channels[channel]

    def _require(self, ch: _Channel, mode: Mode, what: str) -> None:
        if ch.mode is not mode:
            who = "the host" if mode is Mode.NORMAL else "the kernel"
            raise ArbiterError(f"{what}: emulated AXDIMM channel {ch.index} is in {ch.mode.value} mode, so {who} may "
                               f"not use its memory; call set_arbiter({ch.index}, '{mode.value}') first")

    def _check_live(self, ch: _Channel, allocation: Allocation) -> None:
        if (allocation.root or allocation) not in ch.live:
            raise ValueError(f"{allocation} is not allocated on this device (freed?)")

    def _bytes(self, buffer: Buffer, nbytes: int, what: str) -> torch.Tensor:
        """`nbytes` of a tensor or allocation as a flat uint8 tensor; for allocations the caller holds the lock."""
        if isinstance(buffer, torch.Tensor):
            if not buffer.is_contiguous() or buffer.nbytes < nbytes:
                raise ValueError(f"{what}: need a contiguous tensor of at least {nbytes} bytes, got "
                                 f"{tuple(buffer.shape)} {buffer.dtype} contiguous={buffer.is_contiguous()}")
            return buffer.detach().reshape(-1).view(torch.uint8)[:nbytes]
        ch = self._channels[buffer.channel]
        self._require(ch, Mode.NORMAL, what)
        self._check_live(ch, buffer)
        if buffer.nbytes < nbytes:
            raise ValueError(f"{what}: {nbytes} bytes do not fit {buffer}")
        return _slice(ch, buffer)[:nbytes]


def _slice(ch: _Channel, allocation: Allocation) -> torch.Tensor:
    return ch.arena[allocation.offset:allocation.offset + allocation.nbytes]


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    size = dtype.itemsize
    if raw.storage_offset() % size or raw.numel() % size:
        raise ValueError(f"{raw.numel()} bytes at offset {raw.storage_offset()} are not whole aligned {dtype}")
    return raw.view(dtype)


def _coalesce(holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for offset, size in holes:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((offset, size))
    return merged


def _arena(nbytes: int, pinned: bool) -> torch.Tensor:
    arena = None
    if pinned and torch.cuda.is_available():
        # exact size (torch's pinned allocator would round up to a power of two); pinning many GiB can fail, and
        # plain memory still emulates the DIMM
        with contextlib.suppress(RuntimeError):
            arena = pinned_host(nbytes)
    if arena is None:
        arena = torch.empty(nbytes, dtype=torch.uint8)
    arena.zero_()  # first touch now: it is slow, and it must not land inside the first step
    return arena
