"""NVMe store: tensors that fit in no faster tier (optimizer states past the AXDIMM, evicted activations), kept in
private files (0600) of one directory, named by the store.

- A write goes to a new file that replaces the key's previous one once complete; a key's operations run in order.
- As with an asynchronous CUDA copy, a write's tensor must stay unchanged, and a read's `out` unused, until done.
- I/O bypasses the page cache (O_DIRECT) where the file system allows (`direct` says which; see direct_io).
- Each record's crc32 is kept in memory and checked on read: a file changed, cut short or removed by anything but
  the store raises `Damaged` (exit 6), never hands on bad data.
- `close()` (idempotent; also on leaving `with`) removes every file, as interpreter exit does for unclosed stores.

torch is not imported here: tensors are recognised only when the caller has imported torch (numpy arrays work too).
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetero.errors import Damaged, HeteroError
from hetero.run import spans
from hetero.run.devices import direct_io, places, workdir


class Handle:
    """Completion of one asynchronous operation: `done()` polls; `wait()` blocks and re-raises the operation's error."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        self._future.result(timeout)


@dataclass(frozen=True, slots=True)
class _File:
    path: Path
    nbytes: int
    shift: int = 0  # file offset of byte 0: the source's offset within a block, so its aligned middle moves direct
    crc: int | None = None  # crc32 of the bytes written; None: the store keeps no checksums


class NvmeStore:
    """Tensors by key in files under `directory` (created, with its missing parents, and removed at close if absent).
    `workers` threads do the `_async` I/O; `chunk_bytes` sizes bounce buffers and single I/O calls; `field` named the
    directory (`optimizer.nvme.path`, `--nvme`), for errors' hints; `checksums=False` skips the crc32s (a benchmark).
    """

    def __init__(self, directory: str | os.PathLike[str], *, workers: int = 2, chunk_bytes: int = 8 << 20,
                 direct: bool = True, field: str | None = None, checksums: bool = True) -> None:
        if chunk_bytes <= 0 or chunk_bytes % direct_io.BLOCK:
            raise HeteroError(f"NVMe chunk size {chunk_bytes} bytes",
                              hint=f"use a positive multiple of {direct_io.BLOCK}")
        self.directory = Path(directory)
        self.field, self._checksums = field, checksums
        self._work: workdir.WorkDir | None = None  # the private work directory close() removes (NvmeStore.private)
        self._made = _make_dirs(self.directory, field)
        self._prefix = f"hetero-{os.getpid()}-{secrets.token_hex(4)}-"  # two stores may share a directory
        try:
            self.direct = direct and direct_io.direct_io_works(self.directory / f"{self._prefix}probe")
        except BaseException:
            workdir.remove_parents(self._made)
            raise
        self._chunks = direct_io.Chunks(chunk_bytes)  # bounce buffers made on first need, one per thread doing I/O
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="hetero-nvme")
        self._lock = threading.Lock()  # guards the four fields below; worker threads update them
        self._files: dict[str, _File] = {}
        self._created: set[Path] = set()  # every file made and not yet removed, whatever state it is in
        self._tail: dict[str, Future[None]] = {}  # each key's last submitted operation
        self._seq = itertools.count()
        self._closed = False
        _OPEN.add(self)

    @classmethod
    def private(cls, base: str | None, kind: str, field: str, **options: Any) -> NvmeStore:
        """A store in a new private work directory under the plan's `base` (see hetero.run.devices.workdir), which
        `close()` removes. `field` names the plan's key for `base`: every error here is a PlanPathError (exit 3)."""
        work = workdir.create(base, kind, field)
        try:
            store = cls(work.path, field=field, **options)
        except BaseException as e:
            work.remove()
            if isinstance(e, HeteroError):
                raise places.PlanPathError(field, e.message) from None
            raise
        store._work = work  # close() removes the files, then the directory and the parents made for it
        return store

    def __repr__(self) -> str:
        return f"NvmeStore({str(self.directory)!r}, {'direct' if self.direct else 'buffered'} I/O, {len(self)} keys)"

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: str) -> bool:
        return key in self._files

    @property
    def stored_bytes(self) -> int:
        """Bytes of the complete versions held (not counting block padding or writes in flight)."""
        with self._lock:
            return sum(f.nbytes for f in self._files.values())

    def write_async(self, key: str, tensor: Any) -> Handle:
        """Store a contiguous CPU tensor (or numpy array) under `key`, replacing any previous version when done."""
        return self._submit(key, self._write_job(key, tensor, self._write))

    def read_async(self, key: str, out: Any) -> Handle:
        """Fill the preallocated contiguous CPU tensor (or numpy array) `out` with the data stored under `key`."""
        job = self._read_job(key, out, self._read)
        with self._lock:
            if key not in self._files and key not in self._tail:
                raise KeyError(f"nothing stored under {key!r}")
        return self._submit(key, job)

    def write(self, key: str, tensor: Any) -> None:
        """`write_async(key, tensor).wait()` on the calling thread, sparing a hand-off's two thread wake-ups."""
        self._inline(key, self._write_job(key, tensor, self._write_file))

    def read(self, key: str, out: Any) -> None:
        """`read_async(key, out).wait()` on the calling thread."""
        self._inline(key, self._read_job(key, out, self._read_file))

    def delete(self, key: str) -> None:
        """Remove `key`'s data, after the key's operations in flight have finished."""
        self._inline(key, lambda: self._delete(key))

    def close(self) -> None:
        """Finish the operations in flight, drop those queued, remove every file and directory the store made.
        Idempotent, and what an interrupted call left is removed by the next."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            leftover = list(self._created)
            self._files.clear()
        for path in leftover:
            self._remove(path)
        if self._work is not None:
            self._work.remove()
        elif self._made:
            workdir.remove_made(self.directory)
        self._made = []
        _OPEN.discard(self)

    # -- worker side -----------------------------------------------------------------------------------------

    def _submit(self, key: str, job: Callable[[], None]) -> Handle:
        with self._lock:
            if self._closed:
                raise HeteroError(f"the NVMe store in {self.directory} is closed", hint="open a new NvmeStore")
            previous = self._tail.get(key)
            future = self._pool.submit(_after, previous, job)
            self._tail[key] = future
        future.add_done_callback(lambda f: self._forget(key, f))
        return Handle(future)

    def _write_job(self, key: str, tensor: Any, write: Callable[[str, np.ndarray, Path], None]) -> Callable[[], None]:
        src = direct_io.byte_view(tensor, writable=False)  # checked now, in the caller's thread
        path = self.directory / f"{self._prefix}{next(self._seq)}.bin"
        return lambda: write(key, src, path)

    def _read_job(self, key: str, out: Any, read: Callable[[str, np.ndarray], None]) -> Callable[[], None]:
        dst = direct_io.byte_view(out, writable=True)
        return lambda: read(key, dst)

    def _inline(self, key: str, job: Callable[[], None]) -> None:
        """Run `job` here, as the key's newest operation: after those in flight, before any submitted later."""
        future: Future[None] = Future()
        with self._lock:
            if self._closed:
                raise HeteroError(f"the NVMe store in {self.directory} is closed", hint="open a new NvmeStore")
            previous = self._tail.get(key)
            self._tail[key] = future
        future.add_done_callback(lambda f: self._forget(key, f))
        try:
            _after(previous, job)
        except BaseException as e:
            future.set_exception(e)
            raise
        future.set_result(None)

    def _forget(self, key: str, future: Future[None]) -> None:
        with self._lock:
            if self._tail.get(key) is future:
                del self._tail[key]

    def _write(self, key: str, src: np.ndarray, path: Path) -> None:
        with spans.timed(_lane(), f"write {key}", src.nbytes):
            self._write_file(key, src, path)

    def _write_file(self, key: str, src: np.ndarray, path: Path) -> None:
        with self._lock:
            self._created.add(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._direct_flag(), 0o600)
            try:
                os.fchmod(fd, 0o600)  # the umask may only clear bits; make the mode exact
                shift = self._chunks.write(fd, src, self.direct)
            finally:
                os.close(fd)
        except BaseException as e:
            self._remove(path)
            if isinstance(e, OSError) and e.errno in direct_io.NO_SPACE:
                raise direct_io.no_space(self.directory, src.nbytes, self.field) from e
            raise
        crc = zlib.crc32(src) if self._checksums else None  # the caller keeps `src` unchanged until we are done
        with self._lock:
            old = self._files.get(key)
            self._files[key] = _File(path, src.nbytes, shift, crc)
        if old is not None:
            self._remove(old.path)

    def _read(self, key: str, dst: np.ndarray) -> None:
        with spans.timed(_lane(), f"read {key}", dst.nbytes):
            self._read_file(key, dst)

    def _read_file(self, key: str, dst: np.ndarray) -> None:
        with self._lock:
            stored = self._files.get(key)
        if stored is None:
            raise KeyError(f"nothing stored under {key!r} (its write failed or it was deleted)")
        if stored.nbytes != dst.nbytes:
            raise ValueError(f"{key!r} holds {stored.nbytes} bytes; the output buffer has {dst.nbytes}")
        try:
            fd = os.open(stored.path, os.O_RDONLY | self._direct_flag())
        except FileNotFoundError:
            raise self._damaged(stored, key, "was removed") from None
        try:
            self._chunks.read(fd, dst, stored.shift, self.direct)
        except OSError as e:
            raise self._damaged(stored, key, f"cannot be read back: {e.strerror}") from None
        finally:
            os.close(fd)
        if stored.crc is not None and zlib.crc32(dst) != stored.crc:
            raise self._damaged(stored, key, "changed since hetero wrote it (checksum mismatch)")

    def _damaged(self, stored: _File, key: str, what: str) -> Damaged:
        where = f"{self.field}: " if self.field else ""
        return Damaged(f"{where}{stored.path}, which holds {key}, {what}",
                       hint=f"something other than hetero changed or removed files in {self.directory} while the run "
                            "needed them (a cleaner of old temporary files, another program): keep it out of there, "
                            "and start again from the last checkpoint")

    def _delete(self, key: str) -> None:
        with self._lock:
            stored = self._files.pop(key, None)
        if stored is None:
            raise KeyError(f"nothing stored under {key!r}")
        self._remove(stored.path)

    def _remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        with self._lock:
            self._created.discard(path)

    def _direct_flag(self) -> int:
        return os.O_DIRECT if self.direct else 0


def _lane() -> str:
    """The trace lane of this pool thread: `nvme 0`, `nvme 1`, ..."""
    return "nvme " + threading.current_thread().name.rpartition("_")[2]


def _after(previous: Future[None] | None, job: Callable[[], None]) -> None:
    # No deadlock: `previous` was taken from the FIFO queue earlier (or runs on a blocking caller's thread), and
    # waits on nothing later. Its failure does not stop this job (a read after a failed write gets the old version).
    if previous is not None:
        wait_all([previous])
    job()


def _make_dirs(directory: Path, field: str | None) -> list[Path]:
    """Create `directory` and its missing parents (mode 0700); return those created, outermost first."""
    try:
        return workdir.make_missing(directory)
    except OSError as e:
        raise HeteroError(f"cannot create the NVMe directory {directory}: {e.strerror}",
                          hint=f"{direct_io.elsewhere(field)}, to a directory you can write in") from e


_OPEN: set[NvmeStore] = set()


@atexit.register
def _close_all() -> None:
    # Stores the program never closed (an exception or Ctrl-C unwound past them): their files must not outlive us.
    for store in list(_OPEN):
        store.close()
