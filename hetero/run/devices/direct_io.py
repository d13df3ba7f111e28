"""Block I/O for the NVMe store: whole files in one `pwritev`, and O_DIRECT transfers that keep a buffer's offset
within its 4 KiB block, so that a large buffer's aligned middle moves straight between memory and disk and only its
first and last blocks pass through a bounce buffer."""

from __future__ import annotations

import errno
import os
import queue
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hetero.errors import HeteroError

IOV_MAX = 1024  # buffers one pwritev takes (Linux's IOV_MAX)
BLOCK = 4096  # O_DIRECT alignment of buffer, offset and length; a multiple of every common logical block size
NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


def write_direct(fd: int, src: np.ndarray, chunk: int, bounce: np.ndarray) -> int:
    """Write `src` at its address's offset within a block, so that its aligned middle goes to disk straight from it
    and only its first and last blocks pass through the bounce buffer; that offset (where its byte 0 went)."""
    shift = src.ctypes.data % BLOCK
    head = min(src.nbytes, -shift % BLOCK)
    middle = head + (src.nbytes - head) // BLOCK * BLOCK  # where the block-aligned middle ends
    parts = [_in_block(bounce[:BLOCK], src[:head], shift)] if head else []
    parts += [src[o:min(o + chunk, middle)] for o in range(head, middle, chunk)]
    if middle < src.nbytes:
        tail = bounce[BLOCK:2 * BLOCK] if bounce.nbytes >= 2 * BLOCK else aligned_buffer(BLOCK)
        parts.append(_in_block(tail, src[middle:], 0))
    # One call for the whole file: on a busy machine every blocking call costs the writer a wake-up.
    pwritev_all(fd, parts, 0)
    return shift

def read_direct(fd: int, dst: np.ndarray, shift: int, chunk: int, bounce: np.ndarray) -> None:
    """Read into `dst`: its block-aligned middle straight from the file when `dst` sits at the same offset
    within a block as the written buffer did (large torch tensors all do), the rest through the bounce."""
    head = min(dst.nbytes, -shift % BLOCK)
    middle = (dst.nbytes - head) // BLOCK * BLOCK if dst.ctypes.data % BLOCK == shift else 0
    for offset in range(head, head + middle, chunk):
        pread_exact(fd, dst[offset:min(offset + chunk, head + middle)], shift + offset)
    for start, end in ((0, head), (head + middle, dst.nbytes)) if middle else ((0, dst.nbytes),):
        for offset in range(start, end, chunk - BLOCK):
            n = min(chunk - BLOCK, end - offset)
            first = (shift + offset) // BLOCK * BLOCK  # the block the data starts in
            skip = shift + offset - first
            pread_exact(fd, bounce[:-(-(skip + n) // BLOCK) * BLOCK], first)
            dst[offset:offset + n] = bounce[skip:skip + n]

def pwritev_all(fd: int, parts: list[np.ndarray], offset: int) -> None:
    """`parts` one after the other from `offset`, in as few system calls as the kernel allows."""
    views = [p.data.cast("B") for p in parts if p.nbytes]
    while views:
        written = os.pwritev(fd, views[:IOV_MAX], offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views.pop(0))
        if written:
            views[0] = views[0][written:]


def _in_block(block: np.ndarray, data: np.ndarray, at: int) -> np.ndarray:
    """`block` (one aligned block) holding `data` from `at`, zeros around it (never read back)."""
    block[:at] = 0
    block[at:at + data.nbytes] = data
    block[at + data.nbytes:] = 0
    return block


def pread_exact(fd: int, out: np.ndarray, offset: int) -> None:
    view = out.data.cast("B")
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise OSError(errno.EIO, f"NVMe store file ended {len(view)} bytes early")
        view, offset = view[got:], offset + got


def aligned_buffer(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + BLOCK, dtype=np.uint8)
    start = -raw.ctypes.data % BLOCK
    buffer = raw[start:start + nbytes]
    buffer.fill(0)  # first touch now, not inside the first timed write
    return buffer


def direct_io_works(probe: Path) -> bool:
    """Whether this file system takes aligned O_DIRECT writes (tmpfs before Linux 6.6 and some FUSE ones do not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            pwritev_all(fd, [aligned_buffer(BLOCK)], 0)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        if e.errno in NO_SPACE:
            raise no_space(probe.parent, BLOCK) from e
        raise HeteroError(f"cannot write in {probe.parent}: {e.strerror}",
                          hint="use a directory you can write in") from e
    return True


def no_space(directory: Path, nbytes: int, field: str | None = None) -> HeteroError:
    return HeteroError(f"no space left in {directory} for {nbytes} bytes",
                       hint=f"free space there, or {elsewhere(field)}, on a disk with room")


def elsewhere(field: str | None) -> str:
    """How the user moves the directory: the option (`--nvme`) or the plan's key (`optimizer.nvme.path`) that named
    it; None: a store made by a program, not named by the user."""
    if field is None:
        return "give the store another directory"
    if field.startswith("-"):
        return f"point {field} elsewhere"
    if field.isupper():  # an environment variable, e.g. TMPDIR
        return f"set {field} elsewhere"
    return f"set {field} in the plan elsewhere"


class Chunks:
    """Whole-buffer transfers in `chunk`-byte pieces, buffered or O_DIRECT; O_DIRECT ones through bounce buffers made
    on first need and reused: one per thread doing I/O at once (the pool's workers, the store's blocking callers)."""

    def __init__(self, chunk: int):
        self.chunk = chunk
        self.bounces: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()

    def write(self, fd: int, src: np.ndarray, direct: bool) -> int:
        """`src` written from offset 0; the shift a later read passes back (see write_direct; 0 when buffered)."""
        if not direct:
            pwritev_all(fd, [src[o:o + self.chunk] for o in range(0, src.nbytes, self.chunk)], 0)
            return 0
        bounce = self._take()
        try:
            return write_direct(fd, src, self.chunk, bounce)
        finally:
            self.bounces.put(bounce)

    def read(self, fd: int, dst: np.ndarray, shift: int, direct: bool) -> None:
        if not direct:
            for offset in range(0, dst.nbytes, self.chunk):
                pread_exact(fd, dst[offset:offset + self.chunk], offset)
            return
        bounce = self._take()
        try:
            read_direct(fd, dst, shift, self.chunk, bounce)
        finally:
            self.bounces.put(bounce)

    def _take(self) -> np.ndarray:
        try:
            return self.bounces.get_nowait()
        except queue.Empty:
            return aligned_buffer(self.chunk)


def byte_view(x: Any, *, writable: bool) -> np.ndarray:
    """The bytes of a contiguous CPU tensor or numpy array as a flat uint8 array sharing its memory."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"the NVMe store takes contiguous CPU tensors, not a {x.device} tensor with strides "
                             f"{x.stride()}")
        x = x.detach().reshape(-1).view(torch.uint8).numpy()
    if not isinstance(x, np.ndarray) or not x.flags.c_contiguous or (writable and not x.flags.writeable):
        raise ValueError(f"the NVMe store takes contiguous{' writable' if writable else ''} tensors, not {type(x)}")
    return x.reshape(-1).view(np.uint8)
