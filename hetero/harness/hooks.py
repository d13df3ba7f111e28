"""Module hooks that `copy.deepcopy(model)` and `torch.save(model)` do not see.

torch keeps a module's hooks in its `__dict__`, so a copy or pickle would carry hetero's bound methods (which hold
locks and threads, and which an EMA copy must not report into). While any hook registered here lives, the
`__getstate__` each hooked module's class resolves to (nn.Module's, or a class's own, e.g. RNNBase's) leaves hetero's
hooks and `forward_override`s out of the state, after running hetero's `state_dict_pre` hooks as `state_dict()`
does. The patches come with the first live hook and go with the last, so torch is untouched otherwise.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Callable

from torch import nn

# The dicts of a module's state that are keyed by hook id (torch.utils.hooks.RemovableHandle.id, unique per process).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_state_dict_pre_hooks")

_lock = threading.RLock()  # reentrant: a module collected while the lock is held forgets its hooks in this thread
_ids: dict[int, weakref.ref] = {}  # ids of hetero's live hooks -> their module
_originals: dict[type, Callable] = {}  # class -> its own __getstate__, while patched
_overridden: dict[int, int] = {}  # id(module) -> the id of its forward override
_override_ids = itertools.count(-1, -1)  # negative: never one of torch's handle ids


class Handle:
    """Removes the hook, as torch's RemovableHandle does, and forgets it (the last one restores torch)."""

    __slots__ = ("_handle",)

    def __init__(self, handle):
        self._handle = handle

    def remove(self) -> None:
        self._handle.remove()
        _forget(self._handle.id)


def _forget(hook_id: int) -> None:
    with _lock:
        _ids.pop(hook_id, None)
        for module_id in [m for m, i in _overridden.items() if i == hook_id]:
            del _overridden[module_id]
        if not _ids:
            for cls, original in _originals.items():
                cls.__getstate__ = original
            _originals.clear()


def forward_pre(module: nn.Module, hook: Callable, **kwargs) -> Handle:
    """`module.register_forward_pre_hook(hook, **kwargs)`, left out of copies and pickles of the module."""
    return _track(module, module.register_forward_pre_hook(hook, **kwargs))


def forward(module: nn.Module, hook: Callable, **kwargs) -> Handle:
    """`module.register_forward_hook(hook, **kwargs)`, left out of copies and pickles of the module."""
    return _track(module, module.register_forward_hook(hook, **kwargs))


class Override:
    """Removes a forward override: the module's class's `forward` is its own again."""

    __slots__ = ("_module", "id")

    def __init__(self, module: nn.Module, override_id: int):
        self._module, self.id = weakref.ref(module), override_id

    def remove(self) -> None:
        module = self._module()
        if module is not None and "forward" in module.__dict__:
            del module.forward
        _forget(self.id)


def forward_override(module: nn.Module, forward: Callable) -> Override:
    """`module.forward = forward` for this instance, left out of copies and pickles of the module."""
    override_id = next(_override_ids)
    with _lock:
        _ids[override_id] = weakref.ref(module, lambda _, i=override_id: _forget(i))
        _overridden[id(module)] = override_id
        _patch(type(module))
    module.forward = forward
    return Override(module, override_id)


def state_dict_pre(module: nn.Module, hook: Callable) -> Handle:
    """`module.register_state_dict_pre_hook(hook)`, left out of copies and pickles of the module."""
    return _track(module, module.register_state_dict_pre_hook(hook))


def removed(handles: list) -> list:
    """Remove every handle (hetero's or torch's, hooks or overrides); the empty list the holder keeps instead."""
    for handle in handles:
        handle.remove()
    return []


def _track(module: nn.Module, handle) -> Handle:
    with _lock:
        _ids[handle.id] = weakref.ref(module, lambda _, hook_id=handle.id: _forget(hook_id))
        _patch(type(module))
    return Handle(handle)


def _patch(cls: type) -> None:
    """Filter hetero's hooks out of the `__getstate__` that `cls` resolves to (under `_lock`)."""
    owner = next(c for c in cls.__mro__ if "__getstate__" in c.__dict__)  # nn.Module at the latest
    if owner not in _originals:
        _originals[owner] = owner.__dict__["__getstate__"]
        owner.__getstate__ = functools.partialmethod(_getstate, _originals[owner])


def _getstate(self: nn.Module, original: Callable):
    for i, hook in list(self.__dict__.get("_state_dict_pre_hooks", {}).items()):
        if i in _ids:  # what state_dict() would wait for first (weights in flight), a copy waits for too
            hook(self, "", False)
    state = original(self)
    if not isinstance(state, dict):
        return state  # a class's own state of another shape: nothing of hetero's is known to be in it
    if _overridden.get(id(self)) in _ids:
        state.pop("forward", None)
    for key in _HOOK_DICTS:
        hooks = state.get(key)
        if hooks and any(i in _ids for i in hooks):
            # a new dict of the same type (OrderedDict): the original keeps hetero's hooks
            state[key] = type(hooks)((i, h) for i, h in hooks.items() if i not in _ids)
    return state
