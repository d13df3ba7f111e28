"""hetero's module hooks stay out of deep copies and pickles of the script's model."""

import copy
import gc
import io
import pickle
import threading

import pytest
import torch
from torch import nn

from hetero.harness import hooks


class Watcher:
    """Holds a lock, as hetero's mechanisms do: a bound method of it cannot be pickled."""

    def __init__(self):
        self.lock = threading.RLock()
        self.calls = 0

    def pre(self, module, args):
        self.calls += 1


def user_hook(module, args, output):  # a module-level function: picklable, and the copy must keep it
    return output


def test_copies_and_pickles_leave_heteros_hooks_out_and_keep_the_scripts():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    watcher = Watcher()
    handles = [hooks.forward_pre(m, watcher.pre) for m in model] + [hooks.forward(model, lambda *a: None,
                                                                                    always_call=True)]
    model[0].register_forward_hook(user_hook)

    twin = copy.deepcopy(model)
    loaded = torch.load(io.BytesIO(_saved(model)), weights_only=False)
    for other in (twin, loaded, pickle.loads(pickle.dumps(model))):
        assert not other._forward_pre_hooks and not other[0]._forward_pre_hooks
        assert not other._forward_hooks and not other._forward_hooks_always_called
        assert list(other[0]._forward_hooks.values()) == [user_hook]
        other(torch.randn(3, 4))
    assert watcher.calls == 0  # the copies never call hetero's hooks
    model(torch.randn(3, 4))
    assert watcher.calls == 3  # the original keeps them
    torch.testing.assert_close(twin[0].weight, model[0].weight)

    for h in handles:
        h.remove()
    assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks
    assert not any(h._handle.id in hooks._ids for h in handles)


@pytest.fixture
def fresh(monkeypatch):
    """The hook registry as in a new process: earlier tests may keep modules that still carry hetero's hooks."""
    for owner, original in hooks._originals.items():  # every class an earlier test's hooks patched (nn.LSTM's too)
        monkeypatch.setattr(owner, "__getstate__", original)
    monkeypatch.setattr(hooks, "_ids", {})
    monkeypatch.setattr(hooks, "_originals", {})


def test_torch_is_restored_when_the_last_hook_goes_with_its_handle_or_its_module(fresh):
    torchs = nn.Module.__getstate__
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    handle = hooks.forward_pre(first, Watcher().pre)
    hooks.forward(second, lambda *a: None)
    assert nn.Module.__getstate__ is not torchs
    handle.remove()
    assert nn.Module.__getstate__ is not torchs  # `second` still has one
    del second
    gc.collect()
    assert not hooks._ids and nn.Module.__getstate__ is torchs


def _saved(model: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    return buffer.getvalue()


class OwnState(nn.Module):
    """A module class with its own `__getstate__` that copies `__dict__` without calling nn.Module's, as
    nn.LSTM's (RNNBase) and DDP's do."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x)

    def __getstate__(self):
        return self.__dict__.copy()


@pytest.mark.parametrize("make", [lambda: nn.LSTM(4, 4), OwnState], ids=["lstm", "own-getstate"])
def test_a_module_class_with_its_own_getstate_is_copied_and_pickled_without_heteros_hooks(make, fresh):
    module = make()
    own = type(module).__getstate__
    watcher = Watcher()
    handles = [hooks.forward_pre(module, watcher.pre), hooks.forward(module, lambda *a: None, always_call=True),
               hooks.forward_override(module, module.forward)]
    module.register_forward_hook(user_hook)
    for other in (copy.deepcopy(module), torch.load(io.BytesIO(_saved(module)), weights_only=False)):
        assert not other._forward_pre_hooks and not other._forward_hooks_always_called
        assert list(other._forward_hooks.values()) == [user_hook] and "forward" not in other.__dict__
        other(torch.randn(2, 4))
    assert watcher.calls == 0
    for h in handles:
        h.remove()
    assert type(module).__getstate__ is own and not module._forward_pre_hooks  # the class's own again
