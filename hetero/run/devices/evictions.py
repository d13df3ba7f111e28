"""Saved storages on their way between the fast and the slow tier: one record per storage, and the single writer and
single reader threads that move them (TierTrain's eviction and prefetch queues, §5.3).

A record's state says where its bytes are; every transition happens under the ledger's lock, the I/O outside it:

    RESIDENT -> QUEUED -> WRITING -> EVICTED -> FETCHING -> BACK
                  |          |
                  |          +-> KEPT (a prefetch came while writing: the write ends, the data never leaves)
                  +-> RESIDENT (a prefetch came first: the eviction is cancelled)

The fast-tier copy is dropped only once its write is complete (on a GPU, issued), a fetched buffer handed out only
once read (on a GPU, with an event to wait for), and a failed read raised to the unpack that needs it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hetero.errors import HeteroError
from hetero.run import spans
from hetero.run.devices.residency import Ledger
from hetero.run.devices.slow_tier import SlowTier

RESIDENT, QUEUED, WRITING, KEPT, EVICTED, FETCHING, BACK = range(7)


class Deletion(NamedTuple):
    """A writer job: remove a slow copy no longer needed (its size and layer name its span)."""

    key: str
    nbytes: int
    layer: str


@dataclass(eq=False, slots=True)
class Saved:
    """What the pack hook hands autograd instead of a tensor: the storage's record and how to view it again."""

    record: Record
    tensor: torch.Tensor | None  # kept as is: not movable
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class Group:
    """A layer's saved storages in one micro-batch: what tiering (hetero.run.tiering) evicts and prefetches together."""

    layer: str
    mb: TieredPass
    budget: int  # bytes the plan evicts
    committed: int = 0  # bytes queued for eviction so far
    ended: bool = False  # the layer's forward has ended (at least once)
    requested: bool = False  # its prefetch was queued: nothing more leaves
    records: dict[int, weakref.ref] = field(default_factory=dict)

    def live(self) -> list[Record]:
        return [r for r in (ref() for ref in list(self.records.values())) if r is not None]


@dataclass(eq=False)
class TieredPass:
    """One micro-batch's forward and backward as tiering sees them: its layers' groups and progress."""

    start: float
    timed: list[tuple[float, str]]  # prefetches due by time (from the forward start), earliest first
    groups: dict[str, Group] = field(default_factory=dict)
    storages: dict[int, weakref.ref] = field(default_factory=dict)  # data_ptr -> record
    pending: list[Record] = field(default_factory=list)  # saved before the first layer started
    started: set[str] = field(default_factory=set)  # layers whose backward started
    backward: bool = False


class Record:
    """One saved storage. Autograd's saved variables hold it; when the last one goes, its bytes leave the ledger
    and a copy still in the slow tier is deleted."""

    __slots__ = ("mover", "key", "nbytes", "alias", "movable", "data", "rest", "state", "evict_bytes", "group",
                 "ready", "marker", "back", "error", "late", "resident", "slow", "fetched", "__weakref__")

    def __init__(self, mover: Mover, storage: torch.UntypedStorage, movable: bool):
        self.mover, self.key, self.nbytes = mover, str(next(mover.keys)), storage.nbytes()
        self.alias, self.movable = StorageWeakRef(storage), movable  # tells a live storage from a reused address
        self.data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage) if movable else None
        self.rest: torch.Tensor | None = None  # the part a partial eviction keeps in fast memory
        self.state, self.evict_bytes = RESIDENT, 0
        self.group: Group | None = None  # the layer that saved it last (hetero.run.tiering decides)
        self.ready = self.marker = self.back = self.error = None
        self.late, self.resident, self.slow = False, self.nbytes, 0
        self.fetched = False  # `data` is a buffer the tier handed out, to give back when done
        mover.ledger.change(fast=self.nbytes, saved=self.nbytes)

    def __del__(self) -> None:
        self.mover.ledger.change(fast=-self.resident, slow=-self.slow, saved=-self.nbytes)
        if self.slow:  # never brought back (a graph dropped without backward)
            self.mover.writer.put(Deletion(self.key, self.slow, _layer(self)))
        if self.fetched:
            self.mover.tier.release(self.data, self.marker)


class Worker:
    """One thread serving jobs in the order queued; `put` may be called from any thread, finalizers included."""

    def __init__(self, name: str, serve: Callable[[Any], None], failed: Callable[[BaseException], None]):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # its put is reentrant: safe inside __del__
        self._serve, self._failed = serve, failed
        self._closed = False
        self._lock = threading.RLock()  # re-entered when a finalizer puts a job while a put holds it
        self._put, self._done = 0, 0  # jobs put, jobs finished
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Any) -> None:
        if not self._closed:
            with self._lock:
                self._put += 1
            self._jobs.put(job)

    def idle(self) -> bool:
        """Every job put so far is done."""
        return self._done >= self._put

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if not self._closed:  # closing (an error, Ctrl-C): what is still queued is dropped, not done
                try:
                    self._serve(job)
                except BaseException as e:
                    self._failed(e)
            del job
            self._done += 1

    def close(self) -> None:
        """Finish the job running, drop the rest, stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join()


class Mover:
    """Moves records between the fast tier and `tier`, keeping `ledger` current."""

    def __init__(self, tier: SlowTier, ledger: Ledger):
        self.tier, self.ledger, self.lock = tier, ledger, ledger.lock
        self.keys = itertools.count()
        self.failure: BaseException | None = None
        self.writer = Worker("hetero-evict", self._write, self._failed)
        self.reader = Worker("hetero-prefetch", self._prefetch, self._failed)

    def close(self) -> None:
        self.writer.close()
        self.reader.close()
        self.tier.close()

    def evict(self, chosen: list[tuple[Record, int]], layer: str) -> None:
        """Queue `(record, bytes)` for the writer, the bytes final as of now on the compute stream (hook thread)."""
        ready = self.tier.ready()
        kept = [self.tier.split(r.data, nbytes) for r, nbytes in chosen]
        with self.lock:
            for (r, nbytes), rest in zip(chosen, kept):
                r.state, r.evict_bytes, r.ready, r.rest = QUEUED, nbytes, ready, rest
                self.ledger.queued[layer] += nbytes
        for r, _ in chosen:
            self.writer.put(r)

    def prefetch(self, records: Iterable[weakref.ref]) -> None:
        """Bring the records (weakly held: one freed meanwhile needs nothing) back, in this order: evictions not written
        yet are called off now, the others queued for the reader with the buffers they will land in (hook thread)."""
        claimed = []
        for ref in records:
            if (r := ref()) is None:
                continue
            with self.lock:
                if self._claim(r):
                    claimed.append((ref, r.nbytes))
        if not claimed:
            return
        try:
            landings = self.tier.landings([nbytes for _, nbytes in claimed])
        except BaseException:  # out of GPU memory: an unpack fetches them itself, or the error ends the step
            with self.lock:
                for ref, _ in claimed:
                    if (r := ref()) is not None and r.state == FETCHING:
                        r.state = EVICTED
            raise
        self.reader.put([(ref, landing) for (ref, _), landing in zip(claimed, landings)])

    def recall(self, r: Record) -> None:
        """Keep `r` in fast memory after all: cancel its eviction, or bring it back now."""
        self.prefetch([weakref.ref(r)])

    def _claim(self, r: Record) -> bool:
        """Under the lock: whether the caller is to fetch `r`; an eviction not done yet is called off instead."""
        if r.state == QUEUED:
            r.state, r.rest = RESIDENT, None
        elif r.state == WRITING:
            r.state = KEPT
        elif r.state == EVICTED:
            r.state = FETCHING
            return True
        return False

    def data(self, r: Record) -> torch.Tensor:
        """Unpack side: the storage's bytes in fast memory, waiting for (or doing) the fetch if they are not back."""
        with self.lock:
            data, marker = r.data, r.marker
            inline = data is None and r.state == EVICTED
            if inline:
                r.state = FETCHING
        if data is None:
            self._late(r)
            start = perf_counter()
            if inline:
                with spans.timed("late fetch", f"fetch {_layer(r)}", r.slow):
                    self._fetch(r, self.tier.landings([r.nbytes])[0])
            else:
                r.back.wait()
            with self.lock:
                self.ledger.waited_s += perf_counter() - start
            if r.error is not None:
                raise HeteroError(f"could not bring a saved activation back from {self.tier.name}: {r.error}",
                                  hint="check the slow tier's directory") from r.error
            data, marker = r.data, r.marker
        if marker is not None:
            r.marker = None  # one wait per fetch: the stream that unpacks it first orders everything after it
            if not self.tier.wait(marker, data):
                self._late(r)
        return data

    def _late(self, r: Record) -> None:
        with self.lock:
            if not r.late:
                r.late = True
                self.ledger.late += 1

    def _write(self, job: Record | Deletion) -> None:
        """Writer thread: evict a queued record, or delete a slow copy no longer needed."""
        if isinstance(job, Deletion):
            with spans.timed("evict", f"delete {job.layer}", job.nbytes):
                self.tier.delete(job.key)
            return
        r = job
        with self.lock:
            if r.state != QUEUED:
                return
            r.state, data, nbytes = WRITING, r.data, r.evict_bytes
        try:
            with spans.timed("evict", f"evict {_layer(r)}", nbytes):
                self.tier.evict(r.key, data, nbytes, r.ready)
        except BaseException:
            with self.lock:
                r.state, r.rest = RESIDENT, None  # the data never left
            raise
        with self.lock:
            kept = r.state == KEPT
            if kept:
                r.state, r.rest = RESIDENT, None
            else:
                r.data, r.state, r.back = None, EVICTED, threading.Event()
                r.resident, r.slow = r.nbytes - nbytes, nbytes
                self.ledger.change(fast=-nbytes, slow=nbytes)
                self.ledger.evicted[r.group.layer if r.group is not None else ""] += nbytes
                self.ledger.evictions += 1
        if kept:
            self.tier.delete(r.key)

    def _prefetch(self, jobs: list[tuple[weakref.ref, Any]]) -> None:
        """Reader thread: bring the claimed records back in order, each into its landing buffer."""
        for ref, landing in jobs:
            if (r := ref()) is None:
                continue  # its landing buffer goes unused: no copy was issued into it
            with spans.timed("prefetch", f"prefetch {_layer(r)}", r.slow):
                self._fetch(r, landing)

    def _fetch(self, r: Record, landing: Any) -> None:
        try:
            data, marker = self.tier.fetch(r.key, r.nbytes, r.rest, landing)
        except BaseException as e:  # handed to the unpack waiting for it
            r.error = e
            r.back.set()
            return
        with self.lock:
            r.data, r.rest, r.marker, r.state, r.fetched = data, None, marker, BACK, True
            self.ledger.change(fast=r.slow, slow=-r.slow)
            stored, r.resident, r.slow = r.slow, r.nbytes, 0
        r.back.set()
        if self.tier.directory is None:
            self.tier.delete(r.key)  # memory: its buffer back to its pool, no hand-off
        else:
            self.writer.put(Deletion(r.key, stored, _layer(r)))  # a file goes off the reader's path

    def _failed(self, error: BaseException) -> None:
        with self.lock:
            self.failure = self.failure or error


def _layer(r: Record) -> str:
    return r.group.layer if r.group is not None else "(before the first layer)"
