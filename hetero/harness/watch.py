"""The moments, besides `optimizer.step()`, at which a script reveals how it trains, which torch has no global hooks
for: an optimizer being built, a backward call returning, a GradScaler unscaling an optimizer's gradients. Each
torch function is wrapped while someone listens (installed with the first listener, removed with the last).
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


def _after(heard: Callable[..., tuple]) -> Callable[[Callable, Callable[..., None]], Callable]:
    """A wrapper of a torch function that calls `call(*heard(*args, **kwargs))` once the original returned."""
    def wrap(original: Callable, call: Callable[..., None]) -> Callable:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            call(*heard(*args, **kwargs))
            return out
        return wrapper
    return wrap


_BACKWARD = _Listeners(torch.autograd, "backward", _after(lambda *args, **kwargs: ()))
_BUILT = _Listeners(torch.optim.Optimizer, "__init__", _after(lambda optimizer, *args, **kwargs: (optimizer,)))
# the in-place unscale of torch's AMP op does not advance the gradients' version counters (hetero.harness.grads)
_UNSCALED = _Listeners(torch.amp.GradScaler, "unscale_", _after(lambda scaler, optimizer: (optimizer,)))


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
