"""The CPU standing in for CUDA devices, so that the GPU code paths run (and fail where a GPU would) on any machine.
A test device, not part of hetero: tests install it through hetero.kernels.dha's one seam, `dha.devices` (the
`stand_ins` fixture of tests/run/conftest.py), or hand a `StandInDevice` to what takes a device.

`StandInDevice` implements hetero.kernels.dha's `Device` contract with CUDA's ordering rules made strict:
- Streams: compute work runs when issued; the copy stream (H2D), the D2H stream and the prefetch stream (H2D for
  activations) are queues that run only when something waits for them, and each queued copy poisons its destination
  (NaN) when issued, so reading before waiting reads garbage. A side stream that waits for another stream's event
  runs that stream up to the event first. `ops` records the stream of every copy and kernel issued through the
  device, `log` every ordering operation, `synchronized` the host waits (`synchronize` calls) by thread name.
- A D2H copy must wait for an event recorded on the compute stream (the source's producer); without one it is
  refused, as a copy racing its producer would read an unfinished gradient on a GPU.
- Memory: `pinned` is host memory, `alias` device memory over host bytes (a second storage, as a CUDA view of pinned
  memory is), `buffer` device memory from a caching allocator as CUDA's: a buffer is freed when the last tensor
  over it goes, and its block is handed to the next `buffer` of that size at once, as CUDA hands a freed block to
  the next allocation on its stream. Side streams hold no reference to what they copy (CUDA's streams do not: that
  is what `record_stream` was for), so a buffer freed while a copy using it is still queued is a use after free:
  it is recorded in `violations`, and the copy, if it ever runs, raises. Every `buffer` is recorded in
  `allocations` with the stream and thread that made it and the streams that used it since. Blocks are never
  returned, so `reserved` (their bytes) is also the peak; a `limit` makes a `buffer` beyond it raise CUDA's
  out-of-memory error.

`StandInDevices` are two such devices, `cuda:0` and `cuda:1`, with a current device as `torch.cuda` has one: a
script "moves" its model to one with `to(model, index)`, so that a runtime binding to the wrong one is seen.
`strict_parameters` enforces what CUDA enforces implicitly: a parameter's data moved between host and device
memory (`p.data = ...` across devices) resets its gradient accumulator in autograd, and with it DDP's reducer hooks;
on the stand-in that move is an error.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import threading
import weakref
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from hetero.kernels.dha import carve

COMPUTE, COPY, D2H, PREFETCH = "compute", "copy", "d2h", "prefetch"
POISON = 255  # all-ones bytes read as NaN in every float format


@dataclass(eq=False, slots=True)
class Mark:
    """A stand-in event: the stream it was recorded on, and how many of that stream's operations must have run."""

    name: str
    at: int = 0
    stream: str | None = None  # None: never recorded


@dataclass(eq=False, slots=True)
class Allocation:
    """One device buffer: its size, where it was made, and every stream that used it since."""

    nbytes: int
    stream: str
    thread: str
    used_by: set[str] = field(default_factory=set)


@dataclass(eq=False, slots=True)
class Block:
    """Device memory of the stand-in's caching allocator: live while a tensor is over it."""

    memory: np.ndarray
    size: int  # what it was made for: later allocations of this size reuse it
    allocation: Allocation
    generation: int = 0
    live: bool = True

    @property
    def start(self) -> int:
        return self.memory.ctypes.data


@dataclass(eq=False, slots=True)
class End:
    """One end of a queued copy: a tensor held by the copy (host and model memory), or bytes of a device buffer the
    copy does not keep alive (as a CUDA stream does not)."""

    tensor: torch.Tensor | None = None
    block: Block | None = None
    generation: int = 0
    offset: int = 0
    nbytes: int = 0

    def bytes(self, stream: str, device: str) -> torch.Tensor:
        if self.block is None:
            return self.tensor
        if not self.block.live or self.block.generation != self.generation:
            raise RuntimeError(f"stand-in {device}: a copy on the {stream} stream used a device buffer freed before "
                               "the copy ran (its memory may hold another tensor by now)")
        return torch.from_numpy(self.block.memory[self.offset:self.offset + self.nbytes])


@dataclass(eq=False, slots=True)
class Op:
    """A queued copy (or a barrier: a stream waiting for events, with nothing to copy)."""

    dst: End | None
    src: End | None
    after: list[Mark]


@dataclass(eq=False, slots=True)
class Queue:
    """A stand-in side stream: operations issued, run in order when waited for."""

    pending: deque = field(default_factory=deque)
    issued: int = 0
    done: int = 0


class StandInDevice:
    """One stand-in CUDA device (see the module's docstring). Thread-safe: optimizer drivers use it too."""

    kind = "stand-in"
    device = torch.device("cpu")  # where its tensors really are

    def __init__(self, index: int = 0):
        self.index = index
        self.name = f"cuda:{index}"
        self.streams = {COPY: Queue(), D2H: Queue(), PREFETCH: Queue()}
        self.allocations: list[Allocation] = []  # every device buffer, in order
        self.pinned_sizes: list[int] = []  # pinned host buffers' sizes, as asked for
        self.log: list[tuple[str, str]] = []
        self.ops: list[tuple[str, str]] = []  # (stream, what) of every copy and kernel issued
        self.synchronized: Counter[str] = Counter()  # host waits, by the name of the thread that waited
        self.violations: list[str] = []  # device buffers freed while a queued copy still used them
        self.host_storages: dict[StorageWeakRef, torch.UntypedStorage] = {}  # held: an address is never reused
        self.mapped: dict[StorageWeakRef, torch.Tensor] = {}  # alias storage -> the host tensor it views
        self.blocks: dict[int, Block] = {}  # start address -> block, live or free
        self.starts: list[int] = []  # the blocks' start addresses, sorted
        self.free: dict[int, list[Block]] = defaultdict(list)  # by size
        self.reserved = 0  # bytes of every block made
        self.limit_bytes: int | None = None
        self.lock = threading.RLock()

    @property
    def queue(self) -> deque:
        return self.streams[COPY].pending

    # -- memory -------------------------------------------------------------------------------------------------

    def pinned(self, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            self.pinned_sizes.append(nbytes)
            self.host_storages[StorageWeakRef(out.untyped_storage())] = out.untyped_storage()
        return out

    def alias(self, host: torch.Tensor) -> torch.Tensor:
        out = torch.from_numpy(host.numpy())  # a second storage over the same bytes, holding `host`
        with self.lock:
            self.mapped[StorageWeakRef(out.untyped_storage())] = host
        return out

    def buffer(self, nbytes: int) -> torch.Tensor:
        """Device memory allocated on the compute stream (the caller's: threads running the model)."""
        allocation = Allocation(nbytes, COMPUTE, threading.current_thread().name)
        with self.lock:
            self.allocations.append(allocation)
            block = self.free[nbytes].pop() if self.free[nbytes] else None
            if block is None:
                if self.limit_bytes is not None and self.reserved + nbytes > self.limit_bytes:
                    raise torch.cuda.OutOfMemoryError(f"stand-in {self.name}: {nbytes} bytes more than the "
                                                      f"{self.limit_bytes} bytes this process may reserve")
                self.reserved += nbytes
                block = Block(np.empty(max(nbytes, 1), dtype=np.uint8), nbytes, allocation)
                self.blocks[block.start] = block
                bisect.insort(self.starts, block.start)
            block.allocation, block.live = allocation, True
            block.generation += 1
            block.memory.fill(POISON)  # what the block's last owner left there, as far as anyone may assume
        lease = block.memory.view()  # torch's storage holds it: it dies with the last tensor over the buffer
        finalizer = weakref.finalize(lease, self._freed, block, block.generation)
        finalizer.atexit = False
        return torch.from_numpy(lease)[:nbytes]

    def _freed(self, block: Block, generation: int) -> None:
        with self.lock:
            if block.generation != generation:
                return
            for name, q in self.streams.items():
                if any(_uses(op, block) for op in q.pending):
                    self.violations.append(f"a device buffer of {block.allocation.nbytes} bytes was freed while a "
                                           f"copy on the {name} stream still used it")
            block.live = False
            self.free[block.size].append(block)

    def _end(self, t: torch.Tensor, stream: str) -> End:
        """How a copy queued on `stream` refers to `t`: the bytes of a device buffer, or `t` itself."""
        block = self._block(t)
        if block is None or not t.is_contiguous():
            return End(tensor=t)
        block.allocation.used_by.add(stream)
        return End(block=block, generation=block.generation, offset=t.data_ptr() - block.start,
                   nbytes=t.numel() * t.element_size())

    def _block(self, t: torch.Tensor) -> Block | None:
        ptr = t.data_ptr()
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i < 0:
            return None
        block = self.blocks[self.starts[i]]
        return block if block.live and ptr < block.start + len(block.memory) else None

    # -- streams ------------------------------------------------------------------------------------------------

    def event(self, name: str) -> Mark:
        return Mark(name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._enqueue(COPY, dst, src, "host to device")

    def download(self, dst: torch.Tensor, src: torch.Tensor, ready: Mark, after: tuple = ()) -> Mark:
        with self.lock:
            if ready is None or ready.stream != COMPUTE:
                raise RuntimeError(f"stand-in {self.name}: a copy to the host must wait for an event recorded on the "
                                   f"compute stream after its source was written (got {ready})")
            self.log.append(("d2h_waits", ready.name))
            for event in after:
                self.log.append(("d2h_waits", event.name))
            self._enqueue(D2H, dst, src, "device to host", list(after))
            done = Mark(f"downloaded {ready.name}")
            self._record(D2H, done)
            return done

    def upload(self, dst: torch.Tensor, src: torch.Tensor, after: tuple = ()) -> Mark:
        with self.lock:
            for event in after:
                self.log.append(("prefetch_waits", event.name))
            self._enqueue(PREFETCH, dst, src, "host to device", list(after))
            done = Mark("uploaded")
            self._record(PREFETCH, done)
            return done

    def host_view(self, t: torch.Tensor) -> torch.Tensor | None:
        host = self.mapped.get(StorageWeakRef(t.untyped_storage()))
        if host is None:
            return None
        return carve(host, t.data_ptr() - host.data_ptr(), t)

    def record_copy(self, event: Mark) -> None:
        self._record(COPY, event)

    def record_compute(self, event: Mark) -> None:
        with self.lock:
            event.at, event.stream = 0, COMPUTE  # compute work runs when issued: nothing is pending behind it
            self.log.append(("record_compute", event.name))

    def copy_waits(self, event: Mark) -> None:
        with self.lock:
            self.log.append(("copy_waits", event.name))
            if event.stream not in (None, COMPUTE):
                q = self.streams[COPY]
                q.pending.append(Op(None, None, [event]))
                q.issued += 1

    def compute_waits(self, event: Mark) -> None:
        with self.lock:
            self.log.append(("compute_waits", event.name))
            self._run(event)

    def synchronize(self, event: Mark) -> None:
        with self.lock:
            self.log.append(("synchronize", event.name))
            self.synchronized[threading.current_thread().name] += 1
            self._run(event)

    def query(self, event: Mark) -> bool:
        with self.lock:
            return event.stream in (None, COMPUTE) or self.streams[event.stream].done >= event.at

    def limit(self, nbytes: int | None) -> None:
        self.limit_bytes = nbytes

    def peak_reserved(self) -> int:
        return self.reserved

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            self.ops.append((COMPUTE, "write"))
            for t in (dst, src):
                block = self._block(t)
                if block is not None:
                    block.allocation.used_by.add(COMPUTE)
        dst.copy_(src)

    def is_host(self, t: torch.Tensor) -> bool:
        return StorageWeakRef(t.untyped_storage()) in self.host_storages

    def _record(self, stream: str, event: Mark) -> None:
        with self.lock:
            event.at, event.stream = self.streams[stream].issued, stream
            self.log.append((f"record_{stream}", event.name))

    def _enqueue(self, stream: str, dst: torch.Tensor, src: torch.Tensor, what: str, after=None) -> None:
        with self.lock:
            for before in after or ():
                self._run(before)  # a legal schedule of what it waits for: done first, then `dst` is garbage
            dst.view(torch.uint8).fill_(POISON)
            op = Op(self._end(dst, stream), self._end(src, stream), after or [])
            q = self.streams[stream]
            q.pending.append(op)
            q.issued += 1
            self.ops.append((stream, what))

    def _run(self, event: Mark) -> None:
        if event.stream in (None, COMPUTE):
            return
        q = self.streams[event.stream]
        while q.done < event.at:
            op = q.pending.popleft()
            for before in op.after:
                self._run(before)
            if op.dst is not None:
                dst, src = op.dst.bytes(event.stream, self.name), op.src.bytes(event.stream, self.name)
                _as_bytes(dst).copy_(_as_bytes(src))
            q.done += 1


def _uses(op: Op, block: Block) -> bool:
    return any(end is not None and end.block is block and end.generation == block.generation
               for end in (op.dst, op.src))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t


class StandInDevices:
    """Stand-in `cuda:0` and `cuda:1`, hetero.kernels.dha's `Devices` contract (see the module's docstring)."""

    kind = "stand-in"

    def __init__(self, count: int = 2):
        self.all = [StandInDevice(i) for i in range(count)]
        self.current = 0
        self.held: dict[int, int] = {}  # id(parameter) -> the device index holding it

    def set_device(self, index: int) -> None:
        """As `torch.cuda.set_device`."""
        self.current = index

    def to(self, model: nn.Module, index: int) -> nn.Module:
        """As `model.to(f"cuda:{index}")`: the model's parameters are on that device from now on."""
        for p in model.parameters():
            self.held[id(p)] = index
        return model

    def check(self) -> None:
        """Stand-in devices are always there."""

    def of(self, t: torch.Tensor) -> StandInDevice | None:
        """The device holding parameter `t`, or None for host tensors."""
        index = self.held.get(id(t))
        return None if index is None else self.all[index]

    def for_model(self, model: nn.Module) -> StandInDevice:
        """The device the model's parameters are on (the current one if it was not moved), which holds them now."""
        indices = {self.held[id(p)] for p in model.parameters() if id(p) in self.held}
        if len(indices) > 1:
            raise RuntimeError(f"the model's parameters are on several stand-in devices: {sorted(indices)}")
        index = indices.pop() if indices else self.current
        self.to(model, index)
        return self.all[index]

    def is_host(self, t: torch.Tensor) -> bool:
        return any(d.is_host(t) for d in self.all)


@contextlib.contextmanager
def strict_parameters(devices: StandInDevices):
    """While active, `p.data = x` that moves a parameter between host and device memory is an error (see above)."""
    original = inspect.getattr_static(torch.Tensor, "data")

    def set_data(p: torch.Tensor, new: torch.Tensor) -> None:
        if devices.is_host(original.__get__(p, type(p))) != devices.is_host(new):
            raise RuntimeError("a parameter's data moved between host and device memory: on CUDA this resets its "
                               "gradient accumulator, and the hooks DDP put there never fire again")
        original.__set__(p, new)

    nn.Parameter.data = property(lambda p: original.__get__(p, type(p)), set_data)
    try:
        yield devices
    finally:
        del nn.Parameter.data
