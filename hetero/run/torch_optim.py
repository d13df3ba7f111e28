"""hetero's optimizers standing in for torch's for a run: Adam and AdamW replaced by subclasses, torch's own step run
without its hooks, gradient clipping replaced, and what hetero.run.optimizer and hetero.run.update_in_backward ask of
an optimizer: whether it updates the planned model, whether the script trains on several ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from hetero.errors import STALE_PLAN, UNSUPPORTED_SCRIPT, HeteroError
from hetero.harness.script import StopScript
from hetero.run.mechanism import Patches

TORCH_ADAM = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}  # before any run replaces them
# torch's functions that read every gradient and scale them in place, under each name a script may call them by
# (get_total_norm and clip_grads_with_norm_ since torch 2.6), and GradScaler's unscale_
CLIPPING = tuple((owner, name) for owner in (torch.nn.utils, torch.nn.utils.clip_grad)
                 for name in ("clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_")
                 if hasattr(owner, name)) + ((torch.amp.GradScaler, "unscale_"),)


def replace_adam(patches: Patches, mixin: type, config: object, created: list, built: Callable[[object], None]) -> None:
    """For the run, torch.optim.Adam and AdamW are subclasses with `mixin` first, `config` as their `config` and
    the torch class they stand in for as `replaces`; each one the script builds joins `created`, then goes to
    `built`. A HeteroError from its construction stops the script (its own `except Exception` must not hide it)."""
    for name, base in TORCH_ADAM.items():
        patches.set(torch.optim, name, _standing_in(name, mixin, base, config, created, built))


def _standing_in(name: str, mixin: type, base: type, given: object, created: list,
                 built: Callable[[object], None]) -> type:
    class StandIn(mixin, base):
        config = given
        replaces = base

        def __init__(self, *args, **kwargs):
            try:
                super().__init__(*args, **kwargs)
            except HeteroError as e:
                raise StopScript(e) from None
            created.append(self)
            built(self)

    StandIn.__name__ = StandIn.__qualname__ = name
    StandIn.__module__ = mixin.__module__
    return StandIn


def replace_clipping(patches: Patches, wrap: Callable[[Callable], Callable]) -> None:
    """Each of `CLIPPING` (torch's gradient clipping, GradScaler's unscale_) replaced by `wrap(original)`."""
    for owner, name in CLIPPING:
        patches.set(owner, name, wrap(getattr(owner, name)))


def refusing_clipping(why: str, hint: str) -> Callable:
    """A stand-in for torch's gradient clipping where the plan's updates ran before a clip could scale their
    gradients: it refuses rather than train differently."""
    def refuse(*args, **kwargs):
        raise StopScript(HeteroError(f"the script clips or unscales gradients, but {why}",
                                     hint=f"plan again from a profile of this script: {hint}",
                                     exit_code=STALE_PLAN))
    return refuse


def parameters(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """What `optimizer` updates, in its groups' order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def ids(params: Iterable[torch.nn.Parameter]) -> set[int]:
    """What `updates_any` and `updates_the_model` take: the parameters' identities (tensors compare by value)."""
    return {id(p) for p in params}


def updates_any(optimizer: torch.optim.Optimizer, model: set[int]) -> bool:
    """Whether `optimizer` updates any of the planned model's parameters (`ids(...)`): the one way the runtime tells
    the model's optimizer from a second model's."""
    return any(id(p) in model for p in parameters(optimizer))


def updates_the_model(optimizer: torch.optim.Optimizer, model: set[int]) -> bool:
    """True when `optimizer` updates only the model's parameters (`ids(...)`), False for none of them (a second
    model's optimizer stays torch's own); one that updates both is refused."""
    mine = parameters(optimizer)
    outside = [p for p in mine if id(p) not in model]
    if outside and len(outside) < len(mine):
        raise HeteroError(f"the script's {type(optimizer).__name__} also updates {len(outside)} parameter(s) outside "
                          "the planned model", exit_code=UNSUPPORTED_SCRIPT,
                          hint="make the parameters it updates submodules of the one model the script trains")
    return not outside


def several_ranks() -> bool:
    """The script trains on several ranks (a process group of more than one)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def torch_step(base: type, optimizer: torch.optim.Optimizer, closure=None):
    """torch's own `base.step` on `optimizer`, without the step hooks torch wraps it in (they run once per step)."""
    step = base.step
    hooked = getattr(step, "hooked", False)  # torch.optim.Optimizer._patch_step_function's mark
    return (step.__wrapped__ if hooked else step)(optimizer, closure)
