"""The slow tier evicted activations wait in, behind one small interface the tiering workers drive.

Bytes move as flat uint8 tensors (a saved tensor's whole storage, or its first part for a partial eviction). One
writer and one reader thread call a tier; `ready` and `wait` are called from the threads that run the model.
- CPU-only (`fast` is host memory): files in a private work directory (devices/workdir.py).
- GPU (`fast: gpu`): pinned host buffers filled and drained on side streams (host_pool), over the NVMe store when
  the plan names a directory.
"""

from __future__ import annotations

import tempfile
from typing import Any, Protocol

import torch

from hetero.errors import STALE_PLAN, HeteroError
from hetero.kernels import dha
from hetero.kernels.dha import Device
from hetero.run.devices.host_pool import HostPool, PinnedTier
from hetero.run.devices.nvme import NvmeStore
from hetero.schema.plan import ActivationPlan

GPU = "gpu"  # the plan's name for GPU memory as the fast tier


class SlowTier(Protocol):
    """Where evicted bytes wait. `evict`, `fetch` and `delete` block their worker until the caller may drop the
    buffers given; the GPU tier's copies may still be in flight on its streams, ordered by the markers, and it keeps
    an evicted buffer itself until its copy is done."""

    name: str
    device: torch.device  # where the fast-tier copies live
    directory: str | None  # the files' directory; None for a memory tier

    def ready(self) -> Any:
        """Hook thread: a marker that the bytes to evict are final (the compute stream's work so far)."""

    def split(self, data: torch.Tensor, evict_bytes: int) -> torch.Tensor | None:
        """Hook thread, on queueing: a fast-tier copy of `data[evict_bytes:]`, which a partial eviction keeps."""

    def evict(self, key: str, data: torch.Tensor, evict_bytes: int, ready: Any) -> None:
        """Writer: store `data[:evict_bytes]` under `key`; then the caller may drop `data`."""

    def reclaim(self) -> None:
        """Any thread: drop what the tier still keeps of evicted data whose copies are done, waiting for none."""

    def landings(self, sizes: list[int]) -> list[Any]:
        """Hook thread, when fetches are requested: where each will put its bytes (None: the tier chooses)."""

    def fetch(self, key: str, nbytes: int, rest: torch.Tensor | None, landing: Any = None) -> tuple[torch.Tensor, Any]:
        """Reader: a fast-tier buffer of `nbytes` (`landing`'s) holding the stored bytes followed by `rest`, and the
        marker the user of the buffer waits for."""

    def wait(self, marker: Any, data: torch.Tensor) -> bool:
        """User thread: order the work to come after the fetch marked; False when the fetch was not complete."""

    def release(self, data: torch.Tensor, marker: Any = None) -> None:
        """Its record is done with a buffer `fetch` returned (views may live on); `marker`: the fetch's, unwaited."""

    def delete(self, key: str) -> None: ...
    def close(self) -> None: ...


class NvmeTier:
    """Host memory over files: the NVMe store does the I/O; every call here is complete when it returns."""

    device = torch.device("cpu")

    def __init__(self, name: str, directory: str | NvmeStore):
        """Over a store of its own in `directory`, or over `directory` when it is a store already."""
        self.name = name
        # The writer and the reader do their own I/O, so a prefetch never queues behind the evictions (TierTrain).
        self.store = directory if isinstance(directory, NvmeStore) else NvmeStore(directory, workers=1)
        self.directory: str | None = str(self.store.directory)
        self.pool = HostPool()  # fetched buffers, reused from step to step once nothing views them

    def ready(self) -> None:
        return None

    def split(self, data: torch.Tensor, evict_bytes: int) -> torch.Tensor | None:
        return data[evict_bytes:].clone() if evict_bytes < data.numel() else None

    def evict(self, key: str, data: torch.Tensor, evict_bytes: int, ready: None) -> None:
        self.store.write(key, data[:evict_bytes])

    def reclaim(self) -> None:
        """Nothing: `evict` keeps nothing once it returns."""

    def landings(self, sizes: list[int]) -> list[None]:
        return [None] * len(sizes)

    def fetch(self, key: str, nbytes: int, rest: torch.Tensor | None,
              landing: None = None) -> tuple[torch.Tensor, None]:
        out = self.pool.take(nbytes)
        stored = nbytes - (0 if rest is None else rest.numel())
        if rest is not None:
            out[stored:].copy_(rest)
        self.store.read(key, out[:stored])
        return out, None

    def wait(self, marker: None, data: torch.Tensor) -> bool:
        return True

    def release(self, data: torch.Tensor, marker: None = None) -> None:
        """Nothing: the pool takes the buffer back once no view of it is left."""

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def close(self) -> None:
        self.store.close()
        self.pool.close()


def open_tier(plan: ActivationPlan, gpu: Device | None = None) -> tuple[SlowTier, str | None]:
    """The plan's slow tier, and a note for the run summary when the plan left its place to us. `gpu`: the model's
    device, for a plan that tiers GPU memory (None: no GPU here)."""
    path = plan.slow_path
    if plan.fast == GPU:
        if gpu is None:
            raise HeteroError("the plan tiers activations in GPU memory, and this machine has no CUDA device",
                              hint="profile and plan again on this machine", exit_code=STALE_PLAN)
        return PinnedTier(plan.slow, gpu, _private(path, workers=2) if path is not None else None), None
    note = None if path is not None else \
        f"the plan gives no directory for {plan.slow}: evicted activations go to {tempfile.gettempdir()}"
    return NvmeTier(plan.slow, _private(path, workers=1)), note


def _private(path: str | None, workers: int) -> NvmeStore:
    # a private work directory per process (hetero.run.devices.workdir)
    return NvmeStore.private(path, "activations", FIELD, workers=workers, chunk_bytes=ActivationPlan.STORE_CHUNK_BYTES)


FIELD = "activations.slow_path"  # the plan's key for the directory, for errors that name its line


def model_gpu(plan: ActivationPlan, model: torch.nn.Module) -> Device | None:
    """The model's GPU, where the plan tiers GPU memory and there is one."""
    if plan.fast != GPU:
        return None
    try:
        dha.devices.check()
    except HeteroError:
        return None
    return dha.devices.for_model(model)
