"""The links between data-parallel ranks (COARSE's per-proxy profile, §III-E): transfer time by size for every pair.

Measured with the script's own process group (its backend), pair by pair with a barrier between them; a pair's time
is half the median round trip of a ping-pong, written once as (lower rank, higher rank). Rank 0 gathers them.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from hetero.profile.machine import HOST_SIZES
from hetero.schema.profile import CurvePoint, Peer
from hetero.units import measured

REPEATS = 7


def rank() -> int:
    """This process's rank: the script's process group's, else torchrun's, else 0."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def measure(device: torch.device, sizes: tuple[int, ...] = HOST_SIZES, repeats: int = REPEATS) -> list[Peer]:
    """Every pair's curve, on rank 0 ([] on the others); [] without a process group of several ranks. Collective:
    every rank of the script's group must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 \
            or (backend := _backend(device)) is None:
        return []
    on = device if backend == "nccl" else torch.device("cpu")
    side = dist.new_group(backend="gloo")  # barriers and the gather on the CPU, whatever the backend
    me, world = dist.get_rank(), dist.get_world_size()
    mine = []
    for a in range(world):
        for b in range(a + 1, world):
            if me in (a, b):
                curve = [CurvePoint(size_bytes=s, time_s=measured(_one_way(a, b, s, on, repeats))) for s in sizes]
                if me == a:
                    mine.append(Peer(src=a, dst=b, backend=backend, transfer=curve))
            dist.barrier(group=side)
    gathered: list = [None] * world if me == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=side)
    dist.destroy_process_group(side)
    return [peer for part in gathered for peer in part] if me == 0 else []


def _backend(device: torch.device) -> str | None:
    """The backend collectives on `device` use ("cpu:gloo,cuda:nccl" names one per device type)."""
    names = dict(part.split(":") if ":" in part else (device.type, part) for part in dist.get_backend().split(","))
    name = names.get(device.type)
    return name if name in ("gloo", "nccl") else None


def _one_way(a: int, b: int, size: int, device: torch.device, repeats: int) -> float:
    """Half the median round trip of `size` bytes between ranks a and b (both call this)."""
    buffer = torch.ones(size, dtype=torch.uint8, device=device)
    me = dist.get_rank()
    times = []
    for _ in range(repeats + 1):  # the first round trip also sets up the connection: dropped
        start = time.perf_counter()
        if me == a:
            dist.send(buffer, b)
            dist.recv(buffer, b)
        else:
            dist.recv(buffer, a)
            dist.send(buffer, a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / 2
