"""Gradients the script changes between backward and `optimizer.step()`: the one rule the profile and the runtime
share for whether an update may use a gradient before `step()` sees it.

Each gradient is marked (tensor and version counter) when a backward call returns, and compared with its mark where
an update would use it: another tensor, or the same at another version, is an edit (clipping, foreach ops, any
in-place op or assignment). Two edits keep the version: `GradScaler.unscale_`, watched by name
(hetero.harness.watch.unscaled), and writes through `.grad.data`, which `by_value` catches on the first step by
comparing each gradient's sum and norm.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch

from hetero.harness import hooks, watch

Mark = tuple[weakref.ref, int] | None  # the gradient tensor (weakly: the script may free it) and its version


class GradEdits:
    """Marks the gradients of `params()` each time a backward call returns, until `close()`; `edited` names the
    parameters whose gradient has changed since. `by_value`: until the first `edited` call, values are compared too."""

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]], by_value: bool = False):
        self.params, self.by_value = params, by_value
        self.marks: dict[int, Mark] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.unscaled: set[int] = set()  # parameters a GradScaler unscaled since the last mark
        self.handles = [watch.backward_calls(self.mark), watch.unscaled(self._unscaled)]

    def mark(self) -> None:
        """Every watched gradient as it is now (called when a backward call returns)."""
        params = list(self.params())
        # The version counter is how torch itself tells a saved tensor was changed in place (autograd's check).
        self.marks = {id(p): None if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in params}
        self.values = _values(params) if self.by_value else {}
        self.unscaled = set()

    def _unscaled(self, optimizer: torch.optim.Optimizer) -> None:
        self.unscaled |= {id(p) for group in optimizer.param_groups for p in group["params"]}

    def edited(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Those of `params` whose gradient is not the one marked (a parameter never marked counts as unedited)."""
        params = [p for p in params if id(p) in self.marks]
        before, self.values, self.by_value = self.values, {}, False
        now = _values([p for p in params if id(p) in before])
        return [p for p in params if id(p) in self.unscaled or not _same(self.marks[id(p)], p.grad)
                or (id(p) in now and not torch.equal(now[id(p)], before[id(p)]))]

    def close(self) -> None:
        self.handles = hooks.removed(self.handles)


def _values(params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each dense gradient's sum and 2-norm in float64 (reductions: no copy of the gradient)."""
    out = {}
    for p in params:
        g = p.grad
        if type(g) is torch.Tensor and g.layout == torch.strided:  # not sparse, not a DTensor shard
            out[id(p)] = torch.stack([g.sum(dtype=torch.float64), torch.linalg.vector_norm(g, dtype=torch.float64)])
    return out


def _same(mark: Mark, grad: torch.Tensor | None) -> bool:
    if mark is None or grad is None:
        return mark is None and grad is None
    ref, version = mark
    return ref() is grad and grad._version == version


def closure_of(args: tuple, kwargs: dict) -> Callable | None:
    """The closure an `optimizer.step(...)` call passes (positional or keyword), if any, from the arguments torch
    gives a step pre-hook (`args` starts with the optimizer)."""
    return kwargs.get("closure", args[1] if len(args) > 1 else None)


def after_closure(args: tuple, kwargs: dict, then: Callable[[], None]) -> tuple[tuple, dict]:
    """`optimizer.step`'s arguments with its closure made to call `then()` once it has returned (its backward is
    done): what an optimizer step pre-hook returns to see the step's gradients where the script makes them inside
    `step()` (PyTorch Lightning, LBFGS-style loops)."""
    closure = closure_of(args, kwargs)

    def closure_then(*a, **kw):
        out = closure(*a, **kw)
        then()
        return out

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then}
    return (args[0], closure_then, *args[2:]), kwargs
