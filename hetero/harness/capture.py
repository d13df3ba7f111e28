"""Find the model and its optimizer inside a script we did not write.

The model is the root module (one called outside any other module's forward) whose parameters the first
optimizer to step owns. Roots are seen through global module hooks until that first `optimizer.step()`; DDP,
FSDP and `torch.compile` wrappers are unwrapped. Several candidates are an error that lists them by the names the
script gives them, so `--model NAME` can choose.

What hetero cannot carry out is found here, at profile time, so that `hetero run` never meets it first (exit code
UNSUPPORTED_SCRIPT): a script that never steps a `torch.optim` optimizer, or a second optimizer stepping. An
optimizer hetero's Adam cannot replace (amsgrad, or parameters outside the model) is not refused: it stays the
script's own (`offloadable`), and the plan says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from hetero.errors import UNSUPPORTED_SCRIPT, USAGE, HeteroError
from hetero.harness.script import StopScript
from hetero.kernels.adam import Hyperparameters

_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"
_binding: list[nn.Module] = []  # the modules whose call found the model, while it is being bound


def calling(model: nn.Module) -> bool:
    """Whether `model` is being bound from inside its own call: its forward pre-hooks are running, so a pre-hook
    registered now misses this call, while a forward hook registered now sees it end."""
    return any(m is model for m in _binding)


def unwrap(module: nn.Module) -> nn.Module:
    """The user's model inside DDP/FSDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(module, "_orig_mod", None) or _wrapped(module)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _wrapped(module: nn.Module) -> nn.Module | None:
    wrappers = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")
    return getattr(module, "module", None) if type(module).__name__ in wrappers else None


def fingerprint(model: nn.Module) -> str:
    """`sha256:` over (name, shape, dtype) of every parameter in order: the identity a plan is made for."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
    return "sha256:" + h.hexdigest()


class Capture:
    """Watches the script until its first optimizer step, then calls `on_found(model, optimizer)` once.

    With `fingerprint` (hetero run: the plan's model), a root module with that fingerprint is taken as soon as its
    first forward with gradients enabled starts (an evaluation of an EMA copy with the same fingerprint does not
    count), before anything runs on it, and `on_found(model, None)` is called then.
    """

    def __init__(self, on_found: Callable[[nn.Module, torch.optim.Optimizer | None], None], script: str,
                 model_name: str | None = None, fingerprint: str | None = None):
        self.on_found = on_found
        self.script = os.path.abspath(script)
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.checked: set[int] = set()  # roots whose fingerprint was compared already
        self.roots: list[nn.Module] = []  # modules called at depth 0, in order of first call
        self.depth = 0
        self.found = False
        self.handles: list[RemovableHandle] = []

    def __enter__(self) -> Capture:
        # torch warns that global hooks fire once more for a compiled wrapper: ours do, and `unwrap` sees through it.
        # The warning would name no culprit the user can act on.
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING)
        self.handles = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post, always_call=True),
            register_optimizer_step_pre_hook(self._step),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        with contextlib.suppress(ValueError):  # already removed (the model was found earlier)
            warnings.filters.remove(("ignore", re.compile(_COMPILE_WARNING, re.I), Warning, None, 0))

    def _pre(self, module: nn.Module, args) -> None:
        if self.depth == 0 and not any(module is r for r in self.roots):
            self.roots.append(module)
        self.depth += 1
        # an evaluation forward (an EMA copy, which has the model's fingerprint) does not pick the trained model
        if self.fingerprint and self.depth == 1 and id(module) not in self.checked and torch.is_grad_enabled():
            self.checked.add(id(module))
            model = unwrap(module)
            if fingerprint(model) == self.fingerprint:
                _binding.append(module)  # a wrapper's (DDP, torch.compile): the model's own call is still to come
                try:
                    self._found(model, None)
                finally:
                    _binding.pop()

    def _post(self, module: nn.Module, args, output) -> None:
        self.depth = max(0, self.depth - 1)

    def _step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        self.resolve(optimizer)

    def resolve(self, optimizer: torch.optim.Optimizer) -> None:
        """Decide now (the first step, or hetero needs the model earlier), among the roots seen so far."""
        if not self.found:
            self._found(None, optimizer)

    def _found(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
        self.found = True
        self.__exit__()  # global hooks cost every module call: drop them as soon as the model is known
        try:
            self.on_found(model if model is not None else self.choose(optimizer), optimizer)
        except HeteroError as e:
            raise StopScript(e) from None  # an Exception here could be swallowed by the script

    def choose(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        candidates = []
        for root in map(unwrap, self.roots):
            if any(id(p) in owned for p in root.parameters()) and not any(root is c for c in candidates):
                candidates.append(root)
        names = _names(candidates, self.script)
        if self.model_name is not None:
            chosen = [c for c, n in zip(candidates, names) if self.model_name in (n, type(c).__name__)]
            if len(chosen) != 1:
                raise _error(f"--model {self.model_name} matches {len(chosen)} of the candidates", names, candidates)
            return chosen[0]
        if len(candidates) == 1:
            return candidates[0]
        if not candidates:
            raise HeteroError(
                "no model found: the parameters of the first optimizer to step belong to no module called "
                "before that step",
                hint="hetero needs the script to call the model (an nn.Module) before optimizer.step()",
            )
        raise _error("several models own parameters of the optimizer", names, candidates)


def _error(message: str, names: list[str], candidates: list[nn.Module]) -> HeteroError:
    listed = ", ".join(f"{n} ({type(c).__name__})" for n, c in zip(names, candidates))
    return HeteroError(f"{message}: {listed}", hint=f"choose one with --model NAME, e.g. --model {names[0]}",
                       exit_code=USAGE)


def _names(modules: list[nn.Module], script: str) -> list[str]:
    """The variable name each module has in the script's frames (innermost first), else its class name."""
    names = [type(m).__name__ for m in modules]
    frame = sys._getframe()
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) != script:
            frame = frame.f_back
            continue
        for var, value in {**frame.f_globals, **frame.f_locals}.items():
            for i, m in enumerate(modules):
                if names[i] == type(m).__name__ and isinstance(value, nn.Module) and unwrap(value) is m:
                    names[i] = var
        frame = frame.f_back
    return names


def offloadable(optimizer: torch.optim.Optimizer, model: nn.Module) -> str | None:
    """None where hetero's offloaded Adam can take this optimizer's place; else why not (it stays the script's)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return f"{type(optimizer).__name__} is not Adam or AdamW"
    mine = {id(p) for p in model.parameters()}
    outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in mine]
    if outside:  # the plan places states by the model's parameter names
        return (f"the {type(optimizer).__name__} also updates {len(outside)} parameter(s) outside the model "
                f"{type(model).__name__}")
    for group in optimizer.param_groups:
        try:
            Hyperparameters.from_param_group(group)
        except HeteroError as e:
            return e.message
    return None


def no_optimizer() -> HeteroError:
    """The script ran to its end and never stepped a torch.optim optimizer (a hand-written update loop)."""
    return HeteroError("the script ended without calling step() of a torch.optim optimizer: hetero finds the model "
                       "and the training steps through it", exit_code=UNSUPPORTED_SCRIPT,
                       hint="train with a torch.optim optimizer (e.g. torch.optim.SGD for a hand-written SGD loop)")


class OtherOptimizers:
    """Refuses a second optimizer stepping (a GAN's generator and discriminator): the profile, the plan and the
    runtime follow one model and its one optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module):
        self.optimizer, self.model = optimizer, model
        self.handle = register_optimizer_step_pre_hook(self._step)

    def _step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if optimizer is self.optimizer:
            return
        self.close()
        count = lambda opt: sum(p.numel() for g in opt.param_groups for p in g["params"])  # noqa: E731
        raise StopScript(HeteroError(
            f"the script steps a second optimizer ({type(optimizer).__name__} over {count(optimizer):,} values) "
            f"besides the {type(self.optimizer).__name__} of its model {type(self.model).__name__} "
            f"({count(self.optimizer):,} values): hetero profiles and runs scripts with one model and one optimizer",
            exit_code=UNSUPPORTED_SCRIPT,
            hint="run this script without hetero, or train all its parameters with one optimizer "
                 "(param groups may differ in lr and weight decay)"))

    def close(self) -> None:
        self.handle.remove()


def compiled(model: nn.Module, roots: list[nn.Module]) -> bool:
    """Whether the script calls `model` through torch.compile (a compiled wrapper, or `model.compile()`)."""
    return getattr(model, "_compiled_call_impl", None) is not None or \
        any(type(r).__name__ == "OptimizedModule" and unwrap(r) is model for r in roots)
