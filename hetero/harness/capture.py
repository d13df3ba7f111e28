"""Find the model(s) and their optimizers inside a script we did not write.

The model is the root module (called outside any other module's forward) whose parameters the first optimizer to
step owns, seen through global module hooks until that first `optimizer.step()` (or the end of the closure it runs);
DDP, FSDP and `torch.compile` wrappers are unwrapped. Several candidates are an error listing them by the script's
names, for `--model NAME`. What `hetero run` could not carry out is refused here (UNSUPPORTED_SCRIPT); an optimizer
hetero's Adam cannot replace stays the script's own (`offloadable`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hetero.errors import STALE_PLAN, UNSUPPORTED_SCRIPT, USAGE, HeteroError
from hetero.harness import hooks, watch
from hetero.harness.grads import after_closure, closure_of
from hetero.harness.layers import sharded
from hetero.harness.models import combine, names, roots, script_values
from hetero.harness.script import StopScript
from hetero.kernels.adam import Hyperparameters

_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")
_binding: list[nn.Module] = []  # the modules whose call found the model, while it is being bound


def calling(model: nn.Module) -> bool:
    """Whether `model` is being bound from inside its own call: its forward pre-hooks are running, so a pre-hook
    registered now misses this call, while a forward hook registered now sees it end."""
    return any(m is model for m in _binding)


def unwrap(module: nn.Module) -> nn.Module:
    """The user's model inside DDP/FSDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        wrapped = getattr(module, "module", None) if type(module).__name__ in _WRAPPERS else None
        inner = getattr(module, "_orig_mod", None) or wrapped
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def fingerprint(model: nn.Module) -> str:
    """`sha256:` over (name, shape, dtype) of every parameter in order: the identity a plan is made for."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
    return "sha256:" + h.hexdigest()


def check_planned(model: nn.Module, planned: str, allow_stale: bool) -> None:
    """The model found in `hetero run` has the fingerprint `planned`: else a HeteroError (STALE_PLAN), or with
    `allow_stale` a warning on stderr."""
    actual = fingerprint(model)
    if actual == planned:
        return
    if not allow_stale:
        raise HeteroError(f"the script's model ({actual[:19]}...) is not the one the plan was made for "
                          f"({planned[:19]}...)", hint="profile and plan again, or pass --allow-stale",
                          exit_code=STALE_PLAN)
    print(f"hetero: warning: running a plan made for another model ({planned[:19]}...)", file=sys.stderr)


class Capture:
    """Watches the script until it knows the model(s), then calls `on_found(model, optimizers)` once.

    `hetero profile` (no `fingerprint`): at the first `optimizer.step()`, each optimizer built so far whose parameters
    one root owns makes that root a model (several: one `Models` view), its optimizer listed, the stepping one first;
    or, with no optimizer of the roots that got gradients (a hand-written update), at the end of a backward call.
    `hetero run` (`fingerprint`; `parts`: the plan's (name, fingerprint) of each model): a root with the plan's
    fingerprint (or a part's) as its first forward with gradients starts, the other parts found among the roots seen
    and the script's variables; `on_found(model, [])` then.
    """

    def __init__(self, on_found: Callable[[nn.Module, list[torch.optim.Optimizer]], None], script: str,
                 model_name: str | None = None, fingerprint: str | None = None,
                 parts: list[tuple[str, str]] | None = None):
        self.on_found, self.model_name, self.fingerprint = on_found, model_name, fingerprint
        self.script = os.path.abspath(script)
        self.parts = parts or []
        self.checked: set[int] = set()  # roots whose fingerprint was compared already
        self.roots: list[nn.Module] = []  # modules called at depth 0, in order of first call
        self.depth = 0
        self.found = False
        self.built: list[weakref.ref] = []  # optimizers built while watching (hetero profile)
        self.handles: list = []

    def __enter__(self) -> Capture:
        # torch warns that global hooks fire for a compiled wrapper too: `unwrap` sees through it
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING)
        self.handles = [nn.modules.module.register_module_forward_pre_hook(self._pre),
                        nn.modules.module.register_module_forward_hook(self._post, always_call=True),
                        register_optimizer_step_pre_hook(self._step)]
        if self.fingerprint is None:
            self.handles += [watch.optimizers_built(self._built), watch.backward_calls(self._backward_ended)]
        return self

    def __exit__(self, *exc) -> None:
        self.handles = hooks.removed(self.handles)
        with contextlib.suppress(ValueError):  # already removed (the model was found earlier)
            warnings.filters.remove(("ignore", re.compile(_COMPILE_WARNING, re.I), Warning, None, 0))

    def _pre(self, module: nn.Module, args) -> None:
        if self.depth == 0 and not any(module is r for r in self.roots):
            self.roots.append(module)
        self.depth += 1
        # an evaluation forward (an EMA copy, which has the model's fingerprint) does not pick the trained model
        if self.fingerprint and self.depth == 1 and id(module) not in self.checked and torch.is_grad_enabled():
            self.checked.add(id(module))
            _binding.append(module)  # a wrapper's (DDP, torch.compile): the model's own call is still to come
            try:
                self._planned(unwrap(module))
            finally:
                _binding.pop()

    def _post(self, module: nn.Module, args, output) -> None:
        self.depth = max(0, self.depth - 1)

    def _step(self, optimizer: torch.optim.Optimizer, args, kwargs):
        if closure_of(args, kwargs) is not None and not self.candidates(optimizer):
            # the script calls its model inside the closure `step()` runs first (PyTorch Lightning, LBFGS-style)
            return after_closure(args, kwargs, lambda: self.resolve(optimizer))
        self.resolve(optimizer)
        return None

    def _built(self, optimizer: torch.optim.Optimizer) -> None:
        self.built.append(weakref.ref(optimizer))

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers built so far, in order."""
        return [opt for opt in (ref() for ref in self.built) if opt is not None]

    def _planned(self, model: nn.Module) -> None:
        """A root's first training forward: the plan's model, or one of its parts (then with all the others)."""
        if not self.parts:
            if fingerprint(model) == self.fingerprint:
                self._found(lambda: (model, []))
        elif any(fingerprint(model) == wanted for _, wanted in self.parts):
            if (found := self.planned_parts(model)) is not None:
                self._found(lambda: (combine(found), []))

    def planned_parts(self, first: nn.Module | None) -> dict[str, nn.Module] | None:
        """The plan's models by name, found among `first`, the roots seen and the script's variables (among twins,
        e.g. an EMA copy: the variable of the part's name, else the first); None while one is missing."""
        pool = [("", m) for m in ([first] if first is not None else []) + [unwrap(r) for r in self.roots]]
        pool += script_values(self.script, nn.Module, unwrap)
        prints: dict[int, str] = {}
        out: dict[str, nn.Module] = {}
        for name, wanted in self.parts:
            matches = [(var, m) for var, m in pool if not any(m is o for o in out.values())
                       and prints.setdefault(id(m), fingerprint(m)) == wanted]
            if not matches:
                return None
            out[name] = next((m for var, m in matches if var == name), matches[0][1])
        return out

    def _backward_ended(self) -> None:
        """A backward call returned: where no optimizer built so far updates what got gradients, the script updates
        its parameters by hand, and its models are known."""
        if self.found:
            return
        graded = self._roots_where(lambda root: any(p.grad is not None for p in root.parameters()))
        owned = {id(p) for opt in self.optimizers() for group in opt.param_groups for p in group["params"]}
        if graded and not any(id(p) in owned for root in graded for p in root.parameters()):
            self._found(lambda: (self._named([self.chosen(graded)] if self.model_name else graded), []))

    def resolve(self, optimizer: torch.optim.Optimizer) -> None:
        """Decide now (the first step, or hetero needs the model earlier), among the roots seen so far."""
        if self.found:
            return
        if self.fingerprint is None:
            self._found(lambda: self.models(optimizer))
            return
        parts = self.planned_parts(None) if self.parts else None  # the plan's: whatever was called so far
        self._found(lambda: (combine(parts) if parts else self.choose(optimizer), []))

    def _found(self, decide: Callable[[], tuple[nn.Module, list[torch.optim.Optimizer]]]) -> None:
        """`decide()` gives the model(s) and their optimizers; then `on_found` is called with them."""
        self.found = True
        self.__exit__()  # global hooks cost every module call: drop them as soon as the model is known
        try:
            self.on_found(*decide())
        except HeteroError as e:
            raise StopScript(e) from None  # an Exception here could be swallowed by the script

    def models(self, stepping: torch.optim.Optimizer) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        """The model(s) and their optimizers, `stepping` first: every optimizer built so far whose parameters one
        root seen so far owns makes that root a model (`--model` keeps the one it names)."""
        owners = [(stepping, self.choose(stepping))]
        for opt in self.optimizers():
            candidates = self.candidates(opt)
            if opt is not stepping and len(candidates) == 1:  # others have no model yet: refused if they step
                owners.append((opt, candidates[0]))
        if self.model_name is not None:
            owners = [(opt, m) for opt, m in owners if m is owners[0][1]]
        parts = self._roots_where(lambda root: any(m is root for _, m in owners))
        return self._named(parts), [opt for opt, _ in owners]

    def _named(self, parts: list[nn.Module]) -> nn.Module:
        return combine(dict(zip(names(parts, self.script, unwrap), parts)))

    def every_optimizer_has_a_model(self) -> bool:
        """Whether each optimizer built so far updates parameters of a root called so far: where one does not (a
        GAN's generator before its first call), deciding the model now would leave that optimizer without one."""
        return all(self.candidates(opt) for opt in self.optimizers())

    def candidates(self, optimizer: torch.optim.Optimizer) -> list[nn.Module]:
        """The roots seen so far (unwrapped) that own parameters `optimizer` updates, in order of first call."""
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return self._roots_where(lambda root: any(id(p) in owned for p in root.parameters()))

    def _roots_where(self, keep: Callable[[nn.Module], bool]) -> list[nn.Module]:
        """The roots seen so far (unwrapped, each once) that `keep` accepts, in order of first call."""
        out: list[nn.Module] = []
        for root in map(unwrap, self.roots):
            if keep(root) and not any(root is o for o in out):
                out.append(root)
        return out

    def choose(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        candidates = self.candidates(optimizer)
        if self.model_name is not None:
            return self.chosen(candidates)
        if len(candidates) == 1:
            return candidates[0]
        if not candidates:
            raise HeteroError(
                "no model found: the parameters of the first optimizer to step belong to no module called "
                "before that step (or inside the closure it was given)",
                hint="hetero needs the script to call the model (an nn.Module) before or inside optimizer.step()",
                exit_code=UNSUPPORTED_SCRIPT)
        raise _error("several models own parameters of the optimizer", candidates, self.script)

    def chosen(self, candidates: list[nn.Module]) -> nn.Module:
        """The candidate `--model` names."""
        found = names(candidates, self.script, unwrap)
        chosen = [c for c, n in zip(candidates, found) if self.model_name in (n, type(c).__name__)]
        if len(chosen) != 1:
            raise _error(f"--model {self.model_name} matches {len(chosen)} of the candidates", candidates, self.script)
        return chosen[0]


def _error(message: str, candidates: list[nn.Module], script: str) -> HeteroError:
    found = names(candidates, script, unwrap)
    listed = ", ".join(f"{n} ({type(c).__name__})" for n, c in zip(found, candidates))
    return HeteroError(f"{message}: {listed}", hint=f"choose one with --model NAME, e.g. --model {found[0]}",
                       exit_code=USAGE)


def offloadable(optimizer: torch.optim.Optimizer, model: nn.Module) -> str | None:
    """None where hetero's offloaded Adam can take this optimizer's place; else why not (it stays the script's)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return f"{type(optimizer).__name__} is not Adam or AdamW"
    if sharded(model):
        return (f"the model's parameters are sharded across ranks (FSDP2's fully_shard): hetero's Adam places whole "
                f"parameters, while the {type(optimizer).__name__} steps the shards")
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


def no_training() -> HeteroError:
    """The script ran to its end without an optimizer step or a backward call of a module it called."""
    return HeteroError("the script ended without training: no optimizer step and no backward call that gave a "
                       "module's parameters gradients", exit_code=UNSUPPORTED_SCRIPT,
                       hint="hetero profiles a training script: call the model, then loss.backward() (and, usually, "
                            "optimizer.step())")


class OtherOptimizers:
    """Refuses an optimizer stepping that is not one of the models' (its model was not called by the first step,
    or the script updates its parameters by hand). With `--model`, other models' optimizers step untouched."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], model: nn.Module, chosen: bool):
        self.optimizers, self.model, self.chosen = optimizers, model, chosen
        self.params = {id(p) for p in model.parameters()}
        self.others_stepped = False  # with --model: another model's optimizer stepped
        self.handle = register_optimizer_step_pre_hook(self._step)

    def _step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if any(optimizer is o for o in self.optimizers):
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.chosen and not any(id(p) in self.params for p in params):
            self.others_stepped = True
            return
        self.close()
        count = sum(p.numel() for p in params)
        if not self.optimizers:
            raise StopScript(HeteroError(
                f"the script stepped a {type(optimizer).__name__} (over {count:,} values) after updating its "
                f"parameters by hand: hetero counted its steps from backward calls", exit_code=UNSUPPORTED_SCRIPT,
                hint="build the optimizer before the first backward call, or run this script without hetero"))
        raise StopScript(HeteroError(
            f"the script steps an optimizer ({type(optimizer).__name__} over {count:,} values) whose model it had not "
            f"called by its first optimizer step: hetero profiles and runs the models it finds then "
            f"({', '.join(type(o).__name__ for o in self.optimizers)} over {len(self.params):,} tensors)",
            exit_code=UNSUPPORTED_SCRIPT, hint="call every model the script trains before the first optimizer step, "
                                               "or run this script without hetero"))

    def close(self) -> None:
        self.handle.remove()


def compiled(model: nn.Module, called: list[nn.Module]) -> bool:
    """Whether the script calls `model` (or part of it) through torch.compile (a compiled wrapper, model.compile())."""
    return any(getattr(m, "_compiled_call_impl", None) is not None or
               any(type(r).__name__ == "OptimizedModule" and unwrap(r) is m for r in called) for m in roots(model))
