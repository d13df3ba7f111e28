"""What the NVMe store's per-record crc32 costs on the read of a 100M-parameter state (400 MB of fp32), read as the
optimizer's NVMe staging reads it: pieces of `NvmeOverflow.STAGING_PIECE_PARAMS` elements (1 MiB), each its own
record, submitted to the store's two I/O workers with 1 MiB bounce buffers (hetero.run.homes), all in flight.

    .venv/bin/python bench/checksum.py [DIR] [--rounds N] [--params N]

DIR (default: the system temp directory) should be on the disk the plan's `optimizer.nvme.path` names. Each round
writes the state once per store, then reads it back with checksums on and off, in alternating order; it reports the
median and range of wall time and of this process's CPU time (all its threads) per read, the same for writes, and
zlib.crc32 alone over the 400 MB on one thread. On a shared machine, CPU time is the figure to compare: wall time
there includes waiting for a core. Reads are O_DIRECT where the file system allows (as the runtime's are): the page
cache does not serve them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib

import numpy as np

from hetero.run.devices.nvme import NvmeStore
from hetero.schema.plan import NvmeOverflow

PIECE = NvmeOverflow.STAGING_PIECE_PARAMS


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of `fn()`."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def write_all(store: NvmeStore, state: np.ndarray) -> None:
    handles = [store.write_async(f"p.{k}.m", state[a:a + PIECE]) for k, a in enumerate(range(0, state.size, PIECE))]
    for h in handles:
        h.wait()


def read_all(store: NvmeStore, out: np.ndarray) -> None:
    handles = [store.read_async(f"p.{k}.m", out[a:a + PIECE]) for k, a in enumerate(range(0, out.size, PIECE))]
    for h in handles:
        h.wait()


def summary(name: str, values: list[float]) -> str:
    return f"{name} {statistics.median(values) * 1e3:7.0f} ms ({min(values) * 1e3:.0f}-{max(values) * 1e3:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", nargs="?", default=tempfile.gettempdir())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--params", type=int, default=100_000_000)
    args = parser.parse_args()
    state = np.random.default_rng(0).standard_normal(args.params, dtype=np.float32)
    out = np.empty_like(state)
    out.fill(0)  # first touch now, not inside the first timed read
    crc = [timed(lambda: zlib.crc32(state)) for _ in range(args.rounds)]
    stores = {on: NvmeStore.private(args.dir, "states", "bench", chunk_bytes=NvmeOverflow.STORE_CHUNK_BYTES,
                                    checksums=on) for on in (True, False)}
    results: dict[tuple[bool, str], list[tuple[float, float]]] = {(on, op): [] for on in stores
                                                                    for op in ("read", "write")}
    try:
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                results[(on, "write")].append(timed(lambda: write_all(stores[on], state)))
                results[(on, "read")].append(timed(lambda: read_all(stores[on], out)))
                assert np.array_equal(out, state)
        direct = stores[True].direct
    finally:
        for store in stores.values():
            store.close()
    print(f"{args.params / 1e6:.0f}M params ({state.nbytes / 1e6:.0f} MB) in {state.size // PIECE + 1} records of "
          f"{PIECE * 4 >> 20} MiB, {'O_DIRECT' if direct else 'buffered'} I/O, {args.rounds} rounds in {args.dir}")
    cpu = statistics.median(c for _, c in crc)
    print(f"zlib.crc32 alone, one thread: {summary('wall', [w for w, _ in crc])}, {summary('cpu', [c for _, c in crc])}"
          f" = {state.nbytes / cpu / 1e9:.2f} GB/s of CPU time")
    for op in ("read", "write"):
        for on in (False, True):
            runs = results[(on, op)]
            print(f"{op:5} checksums {'on ' if on else 'off'}: {summary('wall', [w for w, _ in runs])}, "
                  f"{summary('cpu', [c for _, c in runs])}")


if __name__ == "__main__":
    main()
