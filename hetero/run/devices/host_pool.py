"""GPU memory over pinned host memory: the slow tier of activation tiering on a GPU machine, NVMe below it; and the
pool of host buffers both host tiers reuse (pinning is slow: the driver locks and maps every page).

Copies run on the device's side streams (hetero.kernels.dha.Device): evictions on the download stream, prefetches
on the upload stream, so an eviction never queues behind a prefetch (PCIe is full duplex) and neither waits on the
compute stream beyond the events it was given. Device memory follows the Device's rules, so that reserved GPU
memory stays close to allocated: every device buffer is allocated on the compute stream by the thread running the
model, and a side stream only uses memory its owner keeps alive until that work is known done, with no
`record_stream` (which would hold a freed block out of the compute stream's pool until the side stream's later work
is done, and made per-stream pools grow: DESIGN §7).
- an eviction's fast-tier tail (a partial eviction) is copied on the compute stream, when the eviction is queued
  (`split`); the download of its head waits for the compute stream's `ready` event, and the tier keeps the evicted
  storage until a query of the download's event finds it done (`reclaim`), so its memory goes back to the compute
  stream's pool only once nothing reads it. Without a store below, nothing waits for a download on the host before
  close: the writer issues the next one at once;
- the buffers of the fetches one prefetch request asks for are one allocation on the compute stream, made when the
  request is (`landings`, with an event the uploads wait for: the block may have been freed by kernels still
  running), filled on the upload stream, and waited for by the stream that unpacks them (`wait`); a record freed
  before that wait (a graph dropped) waits for its upload on the host before its buffer can go;
- an upload from a pinned buffer waits (on the device) for the download that filled it;
- an eviction's pinned buffer, reused from the pool, is written by a download that waits (on the device) for the
  upload that last read it, not by the host.
Memory: an evicted storage held for its download is GPU memory beyond the ledger's fast-tier bytes (which drop when
the download is issued; hetero.run.devices.residency), `held_bytes` here. The queries run at every eviction (writer),
every prefetch request (`landings`: memory is allocated next), every fetch (reader), and when a backward returns
(hetero.run.tiering calls `reclaim`: the optimizer may allocate next), so a storage outlives its download only until
the next of those (in training, the next step's first eviction at the latest); close waits for the downloads still
running.
With an NVMe store below, the writer waits for each download on the host (the file is written from the pinned copy),
writes the file and gives the pinned buffer back to the pool, and the storage goes at once; a prefetch reads the
file into a pooled buffer first.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hetero.kernels.dha import Device, offsets, pinned_host
from hetero.run.devices.nvme import NvmeStore

_GRANULE = 64 << 10  # sizes round up to this: a step's shapes recur exactly, so classes match with little waste


def size_class(nbytes: int) -> int:
    return max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)


class HostPool:
    """Reusable host buffers by size class, pinned or plain. Fresh memory is slow to touch for the first time (page
    faults, and pinning maps every page), so each buffer is touched once and handed out again.

    Plain buffers come back by themselves once nothing views them any more (the tensors autograd made of a fetched
    buffer included): each is handed out as a new storage over the pool's memory, and the memory returns to the pool
    when that storage dies. Pinned buffers come back with `give`, and are reused once the copy that last used them
    has finished (its event, waited for with `synchronize`). `allocated_bytes` is what the pool holds: pinned
    buffers are allocated at their class's exact size (`allocate_pinned`, e.g. hetero.kernels.dha.pinned_host), not
    by torch's pinned allocator, which rounds each up to a power of two."""

    def __init__(self, pinned: bool = False, allocate_pinned: Callable[[int], torch.Tensor] = pinned_host,
                 synchronize: Callable[[Any], None] = lambda event: event.synchronize()) -> None:
        self.pinned = pinned
        self.allocate_pinned = allocate_pinned  # nbytes -> uint8 pinned tensor of exactly nbytes
        self.synchronize = synchronize  # waits for an event `give` was handed
        self._free: dict[int, list[tuple[Any, Any]]] = defaultdict(list)  # size -> (memory, event)
        self._lock = threading.RLock()  # re-entered by finalizers that return memory while it is held
        self.allocated_bytes = 0
        self._closed = False

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes` on pooled memory, free of any copy still running."""
        buffer, after = self.take_unordered(nbytes)
        if after is not None:
            self.synchronize(after)  # the copy that last read it must be done before it is written again
        return buffer

    def take_unordered(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A uint8 buffer of `nbytes` on pooled memory, and the event of the copy that last used it (None: none),
        which whatever writes the buffer must wait for first."""
        size = size_class(nbytes)
        with self._lock:
            entry = self._free[size].pop() if self._free[size] else None
            if entry is None:
                self.allocated_bytes += size
        memory, after = entry if entry is not None else (self._fresh(size), None)
        if self.pinned:
            return torch.empty(0, dtype=torch.uint8).set_(memory, 0, (nbytes,), (1,)), after
        lease = memory.view()  # the storage handed out holds it; it dies with the last view of the buffer
        finalizer = weakref.finalize(lease, self._returned, memory, size)
        finalizer.atexit = False
        return torch.from_numpy(lease)[:nbytes], after

    def _fresh(self, size: int) -> Any:
        if self.pinned:
            return self.allocate_pinned(size).zero_().untyped_storage()  # zero: touched here, on a worker thread
        memory = np.empty(size, dtype=np.uint8)
        memory.fill(0)
        return memory

    def _returned(self, memory: np.ndarray, size: int) -> None:
        with self._lock:
            if not self._closed:
                self._free[size].append((memory, None))

    def give(self, buffer: torch.Tensor, after: Any = None) -> None:
        """Return a pinned buffer from `take`; it is reused once `after` (the last copy using it) has completed."""
        storage = buffer.untyped_storage()
        with self._lock:
            self._free[storage.nbytes()].append((storage, after))

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(size * len(entries) for size, entries in self._free.items())

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            self._closed = True


@dataclass(eq=False, slots=True)
class Landing:
    """A prefetch's device buffer, allocated on the compute stream, and the event after that allocation."""

    buffer: torch.Tensor
    allocated: Any


@dataclass(eq=False, slots=True)
class Arrival:
    """What the user of a fetched buffer waits for: the upload's event. `rest` (a partial eviction's tail, which the
    upload stream read) is held until then."""

    event: Any
    rest: torch.Tensor | None


class PinnedTier:
    """The GPU's slow tier: pinned host buffers from a pool, with an optional NVMe store below them, driven through
    the model's device (a CUDA GPU, or the stand-in in tests)."""

    def __init__(self, name: str, link: Device, store: NvmeStore | None = None):
        self.name, self.link, self.store = name, link, store
        self.device = link.device
        self.directory = str(store.directory) if store is not None else None
        self.pool = HostPool(pinned=True, allocate_pinned=link.pinned, synchronize=link.synchronize)
        self._held: dict[str, tuple[torch.Tensor, Any]] = {}  # key -> pinned copy, the last copy's event
        self._downloading: deque[tuple[Any, torch.Tensor]] = deque()  # (download's event, its source), in issue order
        self.held_bytes = 0  # of the sources held
        self._lock = threading.Lock()

    def ready(self) -> Any:
        event = self.link.event("evict ready")
        self.link.record_compute(event)
        return event

    def split(self, data: torch.Tensor, evict_bytes: int) -> torch.Tensor | None:
        if evict_bytes >= data.numel():
            return None
        rest = self.link.buffer(data.numel() - evict_bytes)
        self.link.write(rest, data[evict_bytes:])
        return rest

    def evict(self, key: str, data: torch.Tensor, evict_bytes: int, ready: Any) -> None:
        """Issue the download of `data[:evict_bytes]`; without a store, `data` is kept until it is done."""
        self.reclaim()
        pinned, after = self.pool.take_unordered(evict_bytes)
        last_use = () if after is None or self.link.query(after) else (after,)
        done = self.link.download(pinned, data[:evict_bytes], ready, last_use)
        if self.store is None:
            with self._lock:
                self._held[key] = (pinned, done)
                self._downloading.append((done, data))  # the caller drops `data`: its memory is reused once read
                self.held_bytes += data.numel()
            return
        self.link.synchronize(done)  # the file is written from the pinned copy
        self.store.write(key, pinned)
        self.pool.give(pinned)

    def reclaim(self) -> None:
        """Drop the evicted storages whose downloads are done (the download stream runs them in order), without
        waiting for any."""
        with self._lock:
            done = []
            while self._downloading and self.link.query(self._downloading[0][0]):
                done.append(self._downloading.popleft()[1])
            self.held_bytes -= sum(data.numel() for data in done)
        del done  # outside the lock: their memory goes back to the allocator here

    def _settle(self) -> None:
        """Wait for every download issued, then drop the storages they read."""
        with self._lock:
            last = self._downloading[-1][0] if self._downloading else None
        try:
            if last is not None:
                self.link.synchronize(last)  # in order: the downloads before it are done too
        finally:
            with self._lock:
                held, self._downloading, self.held_bytes = self._downloading, deque(), 0
            del held

    def landings(self, sizes: list[int]) -> list[Landing]:
        self.reclaim()  # memory is allocated next: what the downloads are done with goes back first
        where, total = offsets(sizes)
        buffer = self.link.buffer(total)
        allocated = self.link.event("prefetch buffers")
        self.link.record_compute(allocated)
        return [Landing(buffer[at:at + nbytes], allocated) for at, nbytes in zip(where, sizes)]

    def fetch(self, key: str, nbytes: int, rest: torch.Tensor | None, landing: Landing) -> tuple[torch.Tensor, Arrival]:
        self.reclaim()
        stored = nbytes - (0 if rest is None else rest.numel())
        after = (landing.allocated,)
        if self.store is None:
            with self._lock:
                pinned, filled = self._held[key]
            after += (filled,)  # the download that filled `pinned` may still be running
        else:
            pinned = self.pool.take(stored)
            self.store.read(key, pinned)
        out = landing.buffer
        arrived = self.link.upload(out[:stored], pinned, after)
        if rest is not None:
            arrived = self.link.upload(out[stored:], rest)
        if self.store is None:
            with self._lock:
                self._held[key] = (pinned, arrived)
        else:
            self.pool.give(pinned, arrived)
        return out, Arrival(arrived, rest)

    def wait(self, marker: Arrival, data: torch.Tensor) -> bool:
        on_time = self.link.query(marker.event)
        self.link.compute_waits(marker.event)
        return on_time

    def release(self, data: torch.Tensor, marker: Arrival | None = None) -> None:
        """A fetched buffer whose record goes: never waited for, its upload is waited for here, on the host."""
        if marker is not None:
            self.link.synchronize(marker.event)

    def delete(self, key: str) -> None:
        if self.store is not None:
            self.store.delete(key)
            return
        with self._lock:
            pinned, after = self._held.pop(key)
        self.pool.give(pinned, after)

    def close(self) -> None:
        try:
            self._settle()
        finally:
            with self._lock:
                self._held.clear()
            self.pool.close()
            if self.store is not None:
                self.store.close()
