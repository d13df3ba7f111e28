"""The CPU standing in for CUDA devices, so that the GPU code paths run (and fail where a GPU would) on any machine.

`StandInDevice` implements hetero.kernels.dha's `Device` contract with CUDA's ordering rules made strict:
- Streams: compute work runs when issued; the copy stream (H2D) and the D2H stream are queues that run only when
  something waits for them, and each queued copy poisons its destination (NaN) when issued, so reading before
  waiting reads garbage. `ops` records the stream of every copy and kernel issued through the device, `log` every
  ordering operation.
- A D2H copy must wait for an event recorded on the compute stream (the source's producer); without one it is
  refused, as a copy racing its producer would read an unfinished gradient on a GPU.
- Memory: `pinned` is host memory, `buffer` and `alias` device memory (an alias is a second storage over host
  bytes, as a CUDA view of pinned memory is).

`StandInDevices` are two such devices, `cuda:0` and `cuda:1`, with a current device as `torch.cuda` has one: a
script "moves" its model to one with `to(model, index)`, so that a runtime binding to the wrong one is seen.
`strict_parameters` enforces what CUDA enforces implicitly: a parameter's data moved between host and device
memory (`p.data = ...` across devices) resets its gradient accumulator in autograd, and with it DDP's reducer hooks;
on the stand-in that move is an error.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from hetero.kernels.dha import carve

COMPUTE, COPY, D2H = "compute", "copy", "d2h"


@dataclass(eq=False, slots=True)
class Mark:
    """A stand-in event: the stream it was recorded on, and how many of that stream's copies must have run."""

    name: str
    at: int = 0
    stream: str | None = None  # None: never recorded


@dataclass(eq=False, slots=True)
class Queue:
    """A stand-in side stream: copies issued, run in order when waited for."""

    pending: deque = field(default_factory=deque)
    issued: int = 0
    done: int = 0


class StandInDevice:
    """One stand-in CUDA device (see the module's docstring). Thread-safe: optimizer drivers use it too."""

    kind = "stand-in"

    def __init__(self, index: int = 0):
        self.index = index
        self.name = f"cuda:{index}"
        self.streams = {COPY: Queue(), D2H: Queue()}
        self.allocations: list[int] = []  # device buffers' sizes
        self.pinned_sizes: list[int] = []  # pinned host buffers' sizes, as asked for
        self.log: list[tuple[str, str]] = []
        self.ops: list[tuple[str, str]] = []  # (stream, what) of every copy and kernel issued
        self.host_storages: dict[int, torch.UntypedStorage] = {}  # held: a freed one's address is never reused
        self.mapped: dict[int, torch.Tensor] = {}  # alias storage -> the host tensor it views
        self.lock = threading.RLock()

    @property
    def queue(self) -> deque:
        return self.streams[COPY].pending

    def pinned(self, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_sizes.append(nbytes)
        self.host_storages[out.untyped_storage()._cdata] = out.untyped_storage()
        return out

    def alias(self, host: torch.Tensor) -> torch.Tensor:
        out = torch.from_numpy(host.numpy())  # a second storage over the same bytes, holding `host`
        self.mapped[out.untyped_storage()._cdata] = host
        return out

    def buffer(self, nbytes: int) -> torch.Tensor:
        self.allocations.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def event(self, name: str) -> Mark:
        return Mark(name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._enqueue(COPY, dst, src, "host to device")

    def download(self, dst: torch.Tensor, src: torch.Tensor, ready: Mark) -> Mark:
        with self.lock:
            if ready is None or ready.stream != COMPUTE:
                raise RuntimeError(f"stand-in {self.name}: a copy to the host must wait for an event recorded on the "
                                   f"compute stream after its source was written (got {ready})")
            self.log.append(("d2h_waits", ready.name))
            self._enqueue(D2H, dst, src, "device to host")
            done = Mark(f"downloaded {ready.name}")
            self._record(D2H, done)
            return done

    def host_view(self, t: torch.Tensor) -> torch.Tensor | None:
        host = self.mapped.get(t.untyped_storage()._cdata)
        if host is None or t.untyped_storage().data_ptr() != host.data_ptr():
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

    def compute_waits(self, event: Mark) -> None:
        with self.lock:
            self.log.append(("compute_waits", event.name))
            self._run(event)

    def synchronize(self, event: Mark) -> None:
        with self.lock:
            self.log.append(("synchronize", event.name))
            self._run(event)

    def write(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            self.ops.append((COMPUTE, "write"))
        dst.copy_(src)

    def is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self.host_storages

    def _record(self, stream: str, event: Mark) -> None:
        with self.lock:
            event.at, event.stream = self.streams[stream].issued, stream
            self.log.append((f"record_{stream}", event.name))

    def _enqueue(self, stream: str, dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        with self.lock:
            dst.view(torch.uint8).fill_(255)  # all-ones bytes read as NaN in every float format
            q = self.streams[stream]
            q.pending.append((dst, src))
            q.issued += 1
            self.ops.append((stream, what))

    def _run(self, event: Mark) -> None:
        if event.stream in (None, COMPUTE):
            return
        q = self.streams[event.stream]
        while q.done < event.at:
            dst, src = q.pending.popleft()
            dst.copy_(src)
            q.done += 1


class StandInDevices:
    """Stand-in `cuda:0` and `cuda:1` for hetero.kernels.dha's `devices` (see the module's docstring)."""

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
    original = torch._C.TensorBase.data

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
