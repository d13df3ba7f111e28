"""The moments, besides `optimizer.step()`, at which a script we did not write reveals how it trains: an optimizer being
built, a backward call returning, and a GradScaler unscaling an optimizer's gradients.

torch has global hooks for module calls and optimizer steps, none for these. Every torch.optim optimizer's constructor
runs `torch.optim.Optimizer.__init__`, `loss.backward()` runs `torch.autograd.backward`, and `GradScaler.step` calls
`unscale_` through its class (each looked up at each call), so each is wrapped while someone listens: the wrapper is
installed with the first listener and removed with the last, and torch is untouched otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


class _Listeners:
    """Callbacks sharing one wrapper of a torch function."""

    def __init__(self, owner: object, name: str, wrap: Callable[[Callable, Callable[..., None]], Callable]):
        self.owner, self.name, self.wrap = owner, name, wrap
        self.listeners: list[Callable] = []
        self.original: Callable | None = None

    def add(self, listener: Callable) -> Handle:
        if not self.listeners:
            self.original = getattr(self.owner, self.name)
            setattr(self.owner, self.name, self.wrap(self.original, self._call))
        self.listeners.append(listener)
        return Handle(self, listener)

    def _call(self, *args) -> None:
        for listener in list(self.listeners):  # a listener added by one of them hears the next call, not this one
            listener(*args)

    def remove(self, listener: Callable) -> None:
        if any(x is listener for x in self.listeners):
            self.listeners = [x for x in self.listeners if x is not listener]
            if not self.listeners:
                setattr(self.owner, self.name, self.original)
                self.original = None


class Handle:
    """Stops one listener, as torch's RemovableHandle does for a hook."""

    def __init__(self, listeners: _Listeners, listener: Callable):
        self.listeners, self.listener = listeners, listener

    def remove(self) -> None:
        self.listeners.remove(self.listener)


def _after_backward(original: Callable, call: Callable[[], None]) -> Callable:
    @functools.wraps(original)
    def backward(*args, **kwargs):
        out = original(*args, **kwargs)
        call()
        return out
    return backward


def _after_init(original: Callable, call: Callable[[torch.optim.Optimizer], None]) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        call(self)
    return __init__


def _after_unscale(original: Callable, call: Callable[[torch.optim.Optimizer], None]) -> Callable:
    @functools.wraps(original)
    def unscale_(self, optimizer):
        original(self, optimizer)
        call(optimizer)
    return unscale_


_BACKWARD = _Listeners(torch.autograd, "backward", _after_backward)
_BUILT = _Listeners(torch.optim.Optimizer, "__init__", _after_init)
# the in-place unscale of torch's AMP op does not advance the gradients' version counters (hetero.harness.grads)
_UNSCALED = _Listeners(torch.amp.GradScaler, "unscale_", _after_unscale)


def backward_calls(listener: Callable[[], None]) -> Handle:
    """Call `listener()` each time a backward call (`loss.backward()`, `torch.autograd.backward`) returns, until the
    handle is removed. A listener may raise (hetero.harness.script.StopScript): the backward is complete then."""
    return _BACKWARD.add(listener)


def optimizers_built(listener: Callable[[torch.optim.Optimizer], None]) -> Handle:
    """Call `listener(optimizer)` each time a torch.optim optimizer's constructor ran, until the handle is removed."""
    return _BUILT.add(listener)


def unscaled(listener: Callable[[torch.optim.Optimizer], None]) -> Handle:
    """Call `listener(optimizer)` each time a GradScaler (`torch.amp`'s, or `torch.cuda.amp`'s, its subclass) has
    unscaled `optimizer`'s gradients in place, until the handle is removed."""
    return _UNSCALED.add(listener)
