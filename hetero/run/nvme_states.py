"""Optimizer states kept in NVMe files between steps (ZeRO-Infinity's optimizer on NVMe; the AXDIMM paper's overflow,
§5.3), updated inside `optimizer.step()` through two staging slots on the update device.

While one slot's piece is updated the next is read into the other, and an updated piece is written out before its
slot takes the next: the schedule hetero.plan.simulate predicts, so a change here changes the plan's predictions. On an
AXDIMM channel (memcpy only) reads land in a host bounce buffer first; in host memory, in the slot itself.

A host-trained parameter is staged in pieces of at most `NvmeOverflow.STAGING_PIECE_PARAMS` elements (Adam is
elementwise), so the slots cost the same few MiB whatever the largest parameter (hetero.plan.footprint); a GPU's
parameter is staged whole, its gradient coming down in one copy.

With the plan's `nvme.grads`, a host-trained parameter's final gradient joins its states in the store (`keep_grad`),
added to a kept one as AccumulateGrad would (bit-equal); `update_all` reads it with the states into the slot's fourth
buffer.
"""

from __future__ import annotations

import torch

from hetero.kernels import dha
from hetero.kernels.adam import Hyperparameters
from hetero.run.states import flat
from hetero.schema.plan import NvmeOverflow

Job = tuple[str, torch.Tensor, torch.Tensor | None, Hyperparameters, int]  # key, param, grad (None: kept), hp, step


def pieces(numel: int, on_cpu: bool) -> list[tuple[int, int]]:
    """[start, end) of each staged piece of a tensor of `numel` elements."""
    step = NvmeOverflow.STAGING_PIECE_PARAMS if on_cpu else max(numel, 1)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)] or [(0, 0)]


def on_host(t: torch.Tensor) -> bool:
    """The tensor is trained in host memory (no GPU makes its gradient): it is staged in pieces."""
    return dha.devices.of(t) is None


def slot_numel(largest: torch.Tensor) -> int:
    """Elements a staging slot holds: the largest staged piece."""
    return max(b - a for a, b in pieces(largest.numel(), on_host(largest)))


class NvmeStaging:
    """States of the parameters `add`ed, in files of `store`, updated through `slots` (two homes of `slot_numel`
    elements: AxdimmHome or HostHome)."""

    def __init__(self, store, slots: list, numel: int, grads: bool = False):
        self.store, self.slots = store, slots
        # the host side of each slot: the home's own buffers where it has them (no copy), else a bounce buffer
        self.bounce = [tuple(home.host_buffers() or [torch.empty(numel) for _ in range(3)]) for home in slots]
        self.grad_bounce = [torch.empty(numel) for _ in slots] if grads else []
        self.writes: list[list] = [[] for _ in slots]
        self.spans: dict[str, list[tuple[int, int]]] = {}
        self.kept: set[str] = set()  # keys whose gradient waits in the store for the next step

    def host_bytes(self) -> int:
        """Host memory the slots hold (a host home's buffers, or the bounce buffers beside a channel's)."""
        return sum(b.nbytes for bounce in self.bounce for b in bounce) + sum(b.nbytes for b in self.grad_bounce)

    def keep_grad(self, key: str, grad: torch.Tensor) -> None:
        """Write `grad` (the parameter's whole gradient, host memory) to the store, added to the one kept since the
        last step if any. The caller then drops its own reference."""
        data, accumulate = flat(grad), key in self.kept
        for k, (a, b) in enumerate(self.spans[key]):
            piece = data[a:b]
            if accumulate:
                kept = self.grad_bounce[0][:b - a]
                self.store.read(f"{key}.{k}.g", kept)
                piece = kept.add_(piece)
            self.store.write(f"{key}.{k}.g", piece)
        self.kept.add(key)

    def take_grad(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The kept gradient of `key`, read back into a new tensor shaped as `like`; it is no longer kept."""
        out = torch.empty(like.numel())
        for k, (a, b) in enumerate(self.spans[key]):
            self.store.read(f"{key}.{k}.g", out[a:b])
        self.kept.discard(key)
        return out.view_as(like)

    def add(self, key: str, param: torch.Tensor) -> None:
        self.spans[key] = pieces(param.numel(), on_host(param))
        data = flat(param)
        for k, (a, b) in enumerate(self.spans[key]):
            zeros = torch.zeros(b - a)
            for part, values in zip("pmv", (data[a:b], zeros, zeros)):
                self.store.write(f"{key}.{k}.{part}", values.clone())

    def update_all(self, jobs: list[Job]) -> None:
        """`jobs` in update order; params change here, in step(). Each job's pieces go through the slots in turn, the
        next piece's read overlapping the current one's update. A job with no gradient updates from the kept one."""
        staged = [(f"{key}.{k}", p if b - a == p.numel() else flat(p.data)[a:b],
                   g if g is None or b - a == p.numel() else flat(g)[a:b], hp, step)
                  for key, p, g, hp, step in jobs for k, (a, b) in enumerate(self.spans[key])]
        self.kept -= {key for key, _, g, _, _ in jobs if g is None}
        reads = {0: self._read(0, staged[0])} if staged else {}
        for j, (key, param, grad, hp, step) in enumerate(staged):
            if j + 1 < len(staged):
                reads[j + 1] = self._read((j + 1) % len(self.slots), staged[j + 1])  # prefetch the next
            for handle in reads.pop(j):
                handle.wait()
            self._update(j % len(self.slots), key, param, grad, hp, step)
        for slot in range(len(self.slots)):
            self._wait_writes(slot)

    def _read(self, slot: int, job: Job) -> list:
        key, param = job[0], job[1]
        self._wait_writes(slot)  # the slot's previous piece has left
        n = param.numel()
        grad = [] if job[2] is not None else [self.store.read_async(f"{key}.g", self.grad_bounce[slot][:n])]
        return [self.store.read_async(f"{key}.{part}", buf[:n]) for part, buf in zip("pmv", self.bounce[slot])] + grad

    def _update(self, slot: int, key: str, param, grad, hp: Hyperparameters, step: int) -> None:
        home, n = self.slots[slot], param.numel()
        grad = self.grad_bounce[slot][:n] if grad is None else grad
        ready = home.source.ready(grad)  # here: the driver thread's current stream is not the compute stream
        master, exp_avg, exp_avg_sq = (b[:n] for b in self.bounce[slot])

        def staged() -> None:  # one job on the slot's driver, the only thread switching its channel
            home.quiesce()
            home.load(master, exp_avg, exp_avg_sq)
            home.run_update(grad, hp, step, ready)
            home.quiesce()
            home.copy_back(param)
            home.store(master, exp_avg, exp_avg_sq)

        home.driver.submit(staged)
        home.driver.drain()
        self.writes[slot] = [self.store.write_async(f"{key}.{part}", b) for part, b in
                             zip("pmv", (master, exp_avg, exp_avg_sq))]

    def _wait_writes(self, slot: int) -> None:
        for handle in self.writes[slot]:
            handle.wait()
        self.writes[slot] = []

    def states(self, key: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(numel), torch.empty(numel)
        for k, (a, b) in enumerate(self.spans[key]):
            for part, buf in zip("mv", out):
                self.store.read(f"{key}.{k}.{part}", buf[a:b])
        return out

    def load(self, key: str, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        for k, (a, b) in enumerate(self.spans[key]):
            for part, data in zip("pmv", (master, exp_avg, exp_avg_sq)):
                self.store.write(f"{key}.{k}.{part}", data.reshape(-1)[a:b].contiguous().clone())
