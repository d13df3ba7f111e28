"""Gradients written straight to pinned host memory (GO-MemFerry §IV-D) for the parameters of `grad: host` layers.

Each such parameter's `.grad` is a device view of a pinned host buffer (hetero.kernels.dha), so no device gradient
buffer exists between micro-batches or steps. Three ways in, cheapest first:
- Linear layers whose weight and bias are theirs alone run through `LinearToHost`, whose backward GEMM (and bias
  reduction) writes into the host view itself.
- Any other op: a hook on the parameter writes the backward's transient device gradient into the host view once, and
  AccumulateGrad adopts the view as `.grad`.
- Later micro-batches of a step find `.grad` defined, and AccumulateGrad adds into the host view in place.
A post-accumulate hook moves `.grad` into the host view where it is not (autograd cloned it, or the script set it).
Double backward (`create_graph=True`) through these gradients is not supported. The gradients stay device views across
`optimizer.step()`: an optimizer on the host reads the host bytes behind them (`Device.host_view`) without a copy.
"""

from __future__ import annotations

import types
from collections import Counter
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hetero.harness import hooks
from hetero.kernels.dha import Device, carve, offsets, same_memory
from hetero.units import SIZE


@dataclass(eq=False, slots=True)
class HostGrad:
    param: nn.Parameter
    host: torch.Tensor  # pinned
    alias: torch.Tensor  # the device view of `host`

    def view(self) -> torch.Tensor:
        """A new tensor over the host bytes: autograd adopts a tensor nobody else holds as `.grad`."""
        return self.alias.view(self.param.shape)


class HostGrads:
    def __init__(self, device: Device, params: list[tuple[str, nn.Parameter]], model: nn.Module):
        self.device = device
        self.slots: dict[int, HostGrad] = {}
        self.handles: list = []
        self.counts: Counter = Counter()  # direct (written by the kernel), copied (by the hook), fallback
        live = [p for _, p in params if p.requires_grad]
        where, total = offsets([p.numel() * p.element_size() for p in live])
        self.host = device.pinned(total)  # one flat buffer for every host gradient, one mapping of it
        self.alias = device.alias(self.host)
        for p, offset in zip(live, where):
            slot = self.slots[id(p)] = HostGrad(p, carve(self.host, offset, p), carve(self.alias, offset, p))
            self.handles += [p.register_hook(partial(self._arrive, slot)),
                             p.register_post_accumulate_grad_hook(partial(self._landed, slot))]
        users = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
        self.patched = [m for m in model.modules() if self._direct(m, users)]
        # instance forwards left out of the model's copies and pickles (torch.save(model), an EMA's deepcopy)
        self.overrides = [hooks.forward_override(m, types.MethodType(partial(_linear_to_host, sink=self), m))
                          for m in self.patched]

    def _direct(self, m: nn.Module, users: Counter) -> bool:
        """A Linear whose parameters all go to host memory and belong to it alone (a tied weight sums the gradients
        of several modules first, which the generic hook handles)."""
        if type(m) is not nn.Linear or "forward" in m.__dict__:
            return False
        own = [p for p in (m.weight, m.bias) if p is not None]
        return all(id(p) in self.slots and users[id(p)] == 1 for p in own)

    def target(self, p: torch.Tensor | None) -> torch.Tensor | None:
        """Where a backward kernel may write `p`'s gradient directly: its host view on the first micro-batch of a
        step (`.grad` unset), else None (AccumulateGrad adds later micro-batches in place)."""
        slot = self.slots.get(id(p)) if p is not None else None
        return slot.view() if slot is not None and p.grad is None else None

    def host_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The host tensor holding `p`'s gradient (what an optimizer on the host can read without a copy)."""
        slot = self.slots.get(id(p))
        return slot.host if slot is not None else None

    def _arrive(self, slot: HostGrad, grad: torch.Tensor) -> torch.Tensor:
        if slot.param.grad is not None:
            return grad
        if same_memory(grad, slot.alias):
            self.counts["direct"] += 1
            return grad
        out = slot.view()
        self.device.write(out, grad)
        self.counts["copied"] += 1
        return out

    def _landed(self, slot: HostGrad, p: nn.Parameter) -> None:
        if p.grad is not None and not same_memory(p.grad, slot.alias):
            self.device.write(slot.alias, p.grad.detach())
            p.grad = slot.view()
            self.counts["fallback"] += 1

    def close(self) -> None:
        self.handles, self.overrides, self.patched = hooks.removed(self.handles), hooks.removed(self.overrides), []

    def summary(self) -> list[str]:
        size = sum(s.param.numel() * s.param.element_size() for s in self.slots.values())
        c = self.counts
        return [f"gradients of {len(self.slots)} parameters ({SIZE.format_short(size)}) in pinned host memory: "
                f"{c['direct']} written by the backward GEMM, {c['copied']} by a hook, {c['fallback']} moved after"]


def _linear_to_host(module: nn.Linear, input: torch.Tensor, *, sink: HostGrads) -> torch.Tensor:  # noqa: A002
    """nn.Linear.forward (same signature) through LinearToHost."""
    if not torch.is_grad_enabled() or torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
        return F.linear(input, module.weight, module.bias)  # autocast changes the dtypes the backward below assumes
    return LinearToHost.apply(input, module.weight, module.bias, sink)


class LinearToHost(torch.autograd.Function):
    """F.linear whose backward writes the weight and bias gradients where `sink.target` says (host memory)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sink: HostGrads):
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.sink = bias, sink
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        # out=: into host memory where the sink says, else a fresh tensor
        gw = torch.mm(g.t(), x.reshape(-1, x.shape[-1]), out=ctx.sink.target(weight)) \
            if ctx.needs_input_grad[1] else None
        gb = torch.sum(g, 0, out=ctx.sink.target(ctx.bias)) if ctx.needs_input_grad[2] else None
        return gx, gw, gb, None
