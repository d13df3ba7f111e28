"""The script's DDP models' gradient synchronization, shared by the mechanisms that need a say in it.

DDP allows one communication hook per model; routing (COARSE) replaces the all-reduce, and the offloaded optimizer
must start an overlapped update only once a gradient is averaged (its post-accumulate-grad hook fires before DDP's
all-reduce). So one hook per DDP model, registered right after DDP builds it:
  1. the all-reduce: routing's, else the script's own (a later `register_comm_hook` replaces ours instead of
     failing), else DDP's default (`allreduce_hook`);
  2. when its future completes (on the communication thread), every listener gets the bucket's parameters with their
     averaged gradients, read from the tensor the all-reduce returned. DDP's end of backward waits for it, callbacks
     included, so what a listener starts has started before `optimizer.step()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from hetero.run.mechanism import Mechanism

CommHook = Callable[[object, object], torch.futures.Future]


class BucketListener(Protocol):
    def bucket_synced(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
        """`grads[i]` is `params[i]`'s gradient averaged over the ranks; called on the communication thread."""


class BucketSync:
    """One DDP model's communication hook: the all-reduce, then the listeners."""

    def __init__(self, ddp: DistributedDataParallel, listeners: list[BucketListener]):
        self.state, self.reduce = ddp.process_group, allreduce_hook
        self.listeners = listeners
        self.params = {id(p) for p in ddp.module.parameters()}

    def use(self, state: object, hook: CommHook) -> None:
        self.state, self.reduce = state, hook

    def __call__(self, bucket) -> torch.futures.Future:
        future = self.reduce(self.state, bucket)
        if not self.listeners:
            return future
        base = bucket.buffer().storage_offset()
        params = bucket.parameters()
        places = [(g.storage_offset() - base, g.numel()) for g in bucket.gradients()]

        def synced(done: torch.futures.Future) -> torch.Tensor:
            out = done.value()
            grads = [out[start:start + n].view_as(p) for (start, n), p in zip(places, params)]
            for listener in self.listeners:
                listener.bucket_synced(params, grads)
            return out

        return future.then(synced)


def _hook(state, bucket):  # unannotated: DDP rejects the string annotations `from __future__` would make
    return state(bucket)


Attach = Callable[[DistributedDataParallel], "tuple[object, CommHook] | None"]


class DdpSync(Mechanism):
    """Installs the one hook on every DDP model built during the run, when some mechanism needs it."""

    def __init__(self):
        self.listeners: list[BucketListener] = []
        self.attachers: list[Attach] = []
        self.syncs: dict[int, BucketSync] = {}  # by id of the DDP model

    def listen(self, listener: BucketListener) -> None:
        self.listeners.append(listener)

    def on_build(self, attach: Attach) -> None:
        """`attach(ddp)` runs right after a DDP model is built; it returns the all-reduce to use, or None."""
        self.attachers.append(attach)

    def synced(self, p: nn.Parameter) -> bool:
        """Whether `p`'s gradient is averaged by a hooked DDP model (its listeners hear when)."""
        return any(id(p) in sync.params for sync in self.syncs.values())

    def install(self, patches, need_model) -> None:
        built, register = DistributedDataParallel.__init__, DistributedDataParallel.register_comm_hook

        def __init__(ddp, *args, **kwargs) -> None:
            built(ddp, *args, **kwargs)
            reducers = [r for r in (attach(ddp) for attach in self.attachers) if r is not None]
            if not (reducers or self.listeners):
                return
            sync = BucketSync(ddp, self.listeners)
            if reducers:
                sync.use(*reducers[0])
            register(ddp, sync, _hook)
            self.syncs[id(ddp)] = sync

        def register_comm_hook(ddp, state, hook) -> None:
            if (sync := self.syncs.get(id(ddp))) is None:
                return register(ddp, state, hook)
            sync.use(state, hook)  # the script's all-reduce, still followed by the listeners

        patches.set(DistributedDataParallel, "__init__", __init__)
        patches.set(DistributedDataParallel, "register_comm_hook", register_comm_hook)
