"""Which memory tier plays which role: host memory, the NVMe tier, the GPU. The planner names tiers from the
profile's machine, the runtime from the plan; both ask here. Pure: no torch, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from hetero.schema.plan import Plan

GPU = "gpu"  # the GPU's tier name, in a plan's `predicted.peak_bytes` and its activations' `fast`
HOST_KIND = "dram"  # a profile tier's `kind` for host memory


class Kinded(Protocol):
    name: str
    kind: str


T = TypeVar("T", bound=Kinded)


def host_tier(tiers: Sequence[T]) -> T:
    """The host-memory tier of a profile's machine: its first DRAM tier, else its first tier."""
    return next((t for t in tiers if t.kind == HOST_KIND), tiers[0])


def plan_tiers(plan: Plan) -> dict[str, str]:
    """The plan's tier name for each role (`host`, `nvme`, `gpu`): host memory is where the activations stay
    when not on the GPU, else the first tier the plan predicts a peak for besides the GPU; the NVMe tier is the one
    the optimizer's states overflow to (`optimizer.nvme.tier`), else the activations' slow tier, else the next tier
    the plan predicts a peak for."""
    acts, peaks = plan.activations, list(plan.predicted.peak_bytes)
    host = acts.fast if acts is not None and acts.fast != GPU else next((k for k in peaks if k != GPU), "dram")
    overflow = plan.optimizer.nvme if plan.optimizer is not None else None
    if overflow is not None and overflow.tier is not None:
        nvme = overflow.tier
    elif acts is not None and (overflow is None or acts.slow_path == overflow.path):
        nvme = acts.slow  # a plan written before `optimizer.nvme.tier`: the same directory is the same tier
    else:
        nvme = next((k for k in peaks if k not in (GPU, host)), "nvme")
    return {"host": host, "nvme": nvme, "gpu": GPU}
