"""GPU memory over pinned host memory: the slow tier of activation tiering on a GPU machine, NVMe below it.

Pinning is slow (the driver locks and maps every page), so pinned buffers come from a pool: allocated once per size
class and handed out again when the copy that last used them has finished (its CUDA event), never earlier.

Copies run on two side streams created once for the run, one per direction, so an eviction never queues behind a
prefetch (PCIe is full duplex) and neither waits on the compute stream beyond the event it was given. Stream rules:
- an eviction waits for the compute stream's `ready` event (the tensor's bytes are final), then copies D2H;
- the evicted GPU tensor is `record_stream`ed on the eviction stream, so the caller may drop it at once: the
  caching allocator reuses its memory only after the copy;
- a prefetch allocates the GPU buffer on the prefetch stream, copies H2D and records `arrived`; the thread that
  uses the buffer makes its own stream wait for `arrived` and records the buffer on it (`wait`).
With an NVMe store below, an evicted buffer is written to a file once its D2H copy is done (host-synchronized in the
writer thread only) and the pinned buffer goes back to the pool; a prefetch reads the file into a pooled buffer
first.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from hetero.kernels.dha import pinned_host
from hetero.run.devices.nvme import NvmeStore

_GRANULE = 64 << 10  # sizes round up to this: a step's shapes recur exactly, so classes match with little waste
# The references a buffer's storage has when only its holder uses it: the holder's tensor and the storage object
# asking. More means a view of it is still alive somewhere, and it must not be handed out again.
_ALONE = 2
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def size_class(nbytes: int) -> int:
    return max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)


class HostPool:
    """Reusable host buffers by size class, pinned or plain. Fresh memory is slow to touch for the first time (page
    faults, and pinning maps every page), so each buffer is touched once and handed out again; a buffer comes back
    once the copy that last used it has finished (its event), or, from `recycle`, once nothing else views it.
    `allocated_bytes` is what the pool holds: pinned buffers are allocated at their class's exact size
    (hetero.kernels.dha.pinned_host), not by torch's pinned allocator, which rounds each up to a power of two."""

    def __init__(self, pinned: bool = False, allocate_pinned=pinned_host) -> None:
        self.pinned = pinned
        self.allocate_pinned = allocate_pinned  # nbytes -> uint8 pinned tensor of exactly nbytes
        self._free: dict[int, list[tuple[torch.UntypedStorage, torch.cuda.Event | None]]] = defaultdict(list)
        self._lock = threading.RLock()  # re-entered by finalizers that recycle while it is held
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes` on a pooled storage, free of any copy still running."""
        size = size_class(nbytes)
        with self._lock:
            entry = self._free[size].pop() if self._free[size] else None
            if entry is None:
                self.allocated_bytes += size
        if entry is None:
            fresh = self.allocate_pinned(size).zero_() if self.pinned else \
                torch.zeros(size, dtype=torch.uint8)  # zeros: the first touch happens here, on a worker thread
            storage = fresh.untyped_storage()
        else:
            storage, after = entry
            if after is not None:
                after.synchronize()  # the copy that last read it must be done before it is written again
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))

    def give(self, buffer: torch.Tensor, after: torch.cuda.Event | None = None) -> None:
        """Return a buffer from `take`; it is reused once `after` (the last copy using it) has completed."""
        storage = buffer.untyped_storage()
        with self._lock:
            self._free[storage.nbytes()].append((storage, after))

    def recycle(self, buffer: torch.Tensor) -> bool:
        """Return a buffer from `take` if nothing but `buffer` views it any more; False leaves it to the allocator."""
        storage = buffer.untyped_storage()
        if _use_count is None or _use_count(storage._cdata) > _ALONE:
            return False
        self.give(buffer)
        return True

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(size * len(entries) for size, entries in self._free.items())

    def close(self) -> None:
        with self._lock:
            self._free.clear()


class CudaHostTier:
    """The GPU's slow tier: pinned host buffers from a pool, with an optional NVMe store below them."""

    def __init__(self, name: str, device: torch.device, store: NvmeStore | None = None):
        self.name, self.device, self.store = name, device, store
        self.directory = str(store.directory) if store is not None else None
        self.evicting = torch.cuda.Stream(device)
        self.prefetching = torch.cuda.Stream(device)
        self.pool = HostPool(pinned=True)
        self._held: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}  # key -> pinned copy, its last event
        self._lock = threading.Lock()

    def ready(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def evict(self, key: str, data: torch.Tensor, evict_bytes: int, ready: torch.cuda.Event) -> torch.Tensor | None:
        pinned = self.pool.take(evict_bytes)
        s = self.evicting
        with torch.cuda.stream(s):
            s.wait_event(ready)
            pinned.copy_(data[:evict_bytes], non_blocking=True)
            rest = data[evict_bytes:].clone() if evict_bytes < data.numel() else None
            done = torch.cuda.Event()
            done.record(s)
        data.record_stream(s)
        if self.store is None:
            with self._lock:
                self._held[key] = (pinned, done)
            return rest
        done.synchronize()  # the file write reads the pinned copy on this (writer) thread
        self.store.write(key, pinned)
        self.pool.give(pinned)
        return rest

    def fetch(self, key: str, nbytes: int, rest: torch.Tensor | None) -> tuple[torch.Tensor, torch.cuda.Event]:
        stored = nbytes - (0 if rest is None else rest.numel())
        if self.store is None:
            with self._lock:
                pinned, written = self._held[key]
        else:
            pinned, written = self.pool.take(stored), None
            self.store.read(key, pinned)
        s = self.prefetching
        with torch.cuda.stream(s):
            if written is not None:
                s.wait_event(written)  # the D2H copy (and the clone of `rest` before it) ran on the other stream
            out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            out[:stored].copy_(pinned, non_blocking=True)
            if rest is not None:
                out[stored:].copy_(rest)
                rest.record_stream(s)
            arrived = torch.cuda.Event()
            arrived.record(s)
        if self.store is None:
            with self._lock:
                self._held[key] = (pinned, arrived)
        else:
            self.pool.give(pinned, arrived)
        return out, arrived

    def wait(self, marker: torch.cuda.Event, data: torch.Tensor) -> bool:
        on_time = marker.query()
        stream = torch.cuda.current_stream(data.device)
        stream.wait_event(marker)
        data.record_stream(stream)
        return on_time

    def release(self, data: torch.Tensor) -> None:
        """GPU buffers need nothing: the caching allocator recycles them, after the streams that used them."""

    def delete(self, key: str) -> None:
        if self.store is not None:
            self.store.delete(key)
            return
        with self._lock:
            pinned, after = self._held.pop(key)
        self.pool.give(pinned, after)

    def close(self) -> None:
        with self._lock:
            self._held.clear()
        self.pool.close()
        if self.store is not None:
            self.store.close()
