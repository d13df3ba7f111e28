"""The plan's `update_in_backward`: the script's own Adam(W) steps each parameter as soon as backward makes its
gradient final, and frees the gradient there, so host memory never holds every gradient at once.

Each update is torch's own `step()` on a param group holding that parameter alone: the same state and arithmetic (on
CPU torch's default Adam loops over parameters anyway, so the weights are plain training's bit for bit). The
post-accumulate-grad hook follows the parameter's last use in backward. The script's `step()` then finds no gradient
and changes nothing; its step hooks and LR schedulers run as before.

Refused rather than trained differently: a second backward into a parameter before `step()`, gradient clipping or
unscaling, a gradient set again before `step()`, several ranks. A script reading `.grad` between backward and step
finds None; the planner writes this section only where the profile saw neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetero.errors import STALE_PLAN, HeteroError
from hetero.harness.script import StopScript
from hetero.plan.backward import update_piece_bytes
from hetero.run.mechanism import Mechanism
from hetero.run.torch_optim import (ids, parameters, refusing_clipping, replace_adam, replace_clipping, several_ranks,
                                    torch_step, updates_the_model)
from hetero.schema.plan import Plan, UpdateInBackward
from hetero.units import SIZE

AGAIN = "profile and plan again: hetero plan updates in backward only "  # a refusal's hint, continued
LANES = 64  # elements: a multiple of any vector loop's width (AVX-512: 16 fp32 per register, unrolled twice)


@dataclass(frozen=True, slots=True)
class InBackwardConfig:
    on_first_use: Callable[[object], None]  # (optimizer): the runtime binds the model's parameters before an update
    piece_bytes: int  # the most of a parameter one update steps at once (hetero.plan.backward.update_piece_bytes)


@dataclass(frozen=True, slots=True)
class InBackwardPlan:
    """The plan's updates in backward as the runtime reads them: the section, and its allocator's piece size."""

    section: UpdateInBackward
    piece_bytes: int

    @classmethod
    def of(cls, plan: Plan) -> InBackwardPlan | None:
        if plan.update_in_backward is None:
            return None
        threshold = plan.allocator.mmap_threshold_bytes if plan.allocator is not None else None
        return cls(plan.update_in_backward, update_piece_bytes(threshold))


class InBackward:
    """Mixed into torch's Adam/AdamW by `UpdatesInBackward` (hetero.run.torch_optim.replace_adam), which gives the
    class its `config` and `replaces` (the torch class it stands in for) for the run."""

    config: InBackwardConfig
    replaces: type

    def __init__(self, *args, **kwargs):
        self._group_of: dict[torch.nn.Parameter, dict] = {}
        self._updated: set[torch.nn.Parameter] = set()  # in backward since the script's last step()
        self._mine: bool | None = None  # None: not bound yet; False: not the planned model's, torch's own
        super().__init__(*args, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # torch's __init__ adds every group through here too
        group = self.param_groups[-1]
        for p in group["params"]:
            self._group_of[p] = group
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_final)

    def bind(self, model_params: set[int]) -> None:
        if self._mine is None:
            self._mine = updates_the_model(self, model_params)

    def _grad_final(self, p: torch.nn.Parameter) -> None:
        if self._mine is None:
            self.config.on_first_use(self)
        if not self._mine:
            return
        if p in self._updated:
            raise _refused("a second backward reached a parameter before step() (gradient accumulation, or one "
                           "model's loss reaching another's parameters)", f"{AGAIN}for one backward per step")
        if several_ranks():
            raise _refused("this script trains on several ranks, whose gradient all-reduce needs the gradients",
                           "plan again from a profile of this run")
        self._update(p, self._group_of[p])
        self._updated.add(p)
        p.grad = None

    def _update(self, p: torch.nn.Parameter, group: dict) -> None:
        """torch's step of `p` alone: whole, or as views of its pieces (`pieces`) sharing its state, the step count
        each piece advances (to the same value) written back once."""
        bounds = pieces(p, group, self.config.piece_bytes)
        if bounds is not None and not self.state.get(p):
            self._initial_state(p, group)
        state = self.state.get(p)
        if bounds is None or not all(t.is_contiguous() for t in state.values() if t.shape == p.shape):
            return self._step([p], group)
        views = []
        try:
            for a, b in bounds:
                view = p.detach().view(-1)[a:b]
                view.grad = p.grad.view(-1)[a:b]
                self.state[view] = {k: t.view(-1)[a:b] if t.shape == p.shape else t.clone() for k, t in state.items()}
                views.append(view)
            self._step(views, group)
            for k, t in state.items():
                if t.shape != p.shape:
                    t.copy_(self.state[views[0]][k])
        finally:
            for view in views:
                del self.state[view]

    def _initial_state(self, p: torch.nn.Parameter, group: dict) -> None:
        """torch's own first state for `p`, made before its first step so that that step runs in pieces too: what torch
        makes for a one-element stand-in of p's dtype, each tensor of the stand-in's shape at p's (Adam's state starts
        at zero: its step count and moments; the stand-in's step, of a zero gradient, moves none but the count)."""
        probe = torch.zeros(1, dtype=p.dtype, device=p.device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        self._step([probe], group)
        made = self.state.pop(probe)
        self.state[p] = {k: torch.zeros_like(p, memory_format=torch.preserve_format) if t.shape == probe.shape
                         else torch.zeros_like(t) for k, t in made.items()}

    def _step(self, params: list[torch.Tensor], group: dict) -> None:
        groups = self.param_groups
        self.param_groups = [{**group, "params": params}]
        try:
            torch_step(self.replaces, self)
        finally:
            self.param_groups = groups

    def step(self, closure=None):
        if any(p.grad is not None for p in self._updated):  # the script set a gradient its update had freed
            raise _refused("the script set a gradient again between backward and step()",
                           f"{AGAIN}where the script leaves gradients as backward made them")
        self._updated.clear()  # before the closure: its backward belongs to this step
        return torch_step(self.replaces, self, closure)


def pieces(p: torch.Tensor, group: dict, piece_bytes: int) -> list[tuple[int, int]] | None:
    """The flat element ranges `p` is stepped in, each at most `piece_bytes` and, but the last, a multiple of `LANES`
    elements; None where it is stepped whole: it fits one piece, or torch would not loop over it element by element
    alone (a foreach or fused group, whose temporaries span the group anyway; not on the CPU; complex; sparse or
    strided gradient or weight)."""
    size = max(LANES, piece_bytes // p.element_size() // LANES * LANES)
    grad = p.grad
    if p.numel() <= size or p.device.type != "cpu" or p.is_complex() or grad is None or grad.is_sparse or \
            grad.dtype != p.dtype or not (p.is_contiguous() and grad.is_contiguous() and grad.shape == p.shape) or \
            group.get("foreach") or group.get("fused") or group.get("differentiable"):
        return None
    return [(a, min(a + size, p.numel())) for a in range(0, p.numel(), size)]


class UpdatesInBackward(Mechanism):
    """Carries out the plan's `update_in_backward` (a runtime Mechanism)."""

    def __init__(self, plan: InBackwardPlan):
        self.section, self.piece_bytes = plan.section, plan.piece_bytes
        self.optimizers: list[InBackward] = []
        self.model_params: set[int] | None = None  # ids (hetero.run.torch_optim.ids)

    def install(self, patches, need_model) -> None:
        def first_use(opt: InBackward) -> None:
            need_model(opt)  # binds every optimizer through bind() below
            opt.bind(self.model_params)

        replace_adam(patches, InBackward, InBackwardConfig(first_use, self.piece_bytes), self.optimizers,
                     lambda opt: opt.bind(self.model_params) if self.model_params is not None else None)
        refuse = refusing_clipping("the plan updates each parameter during backward (update_in_backward)",
                                   "hetero plan updates in backward only for scripts that do not clip")
        replace_clipping(patches, lambda clip: refuse)

    def bind(self, model: torch.nn.Module) -> None:
        self.model_params = ids(model.parameters())
        for opt in self.optimizers:
            opt.bind(self.model_params)

    def summary(self) -> list[str]:
        mine = [opt for opt in self.optimizers if opt._mine]
        if not mine:
            return []
        params = sum(p.numel() for opt in mine for p in parameters(opt))
        return [(f"the script's {self.section.kind} updated {params / 1e6:.2f}M parameters during backward, each "
                 f"gradient freed once used, in pieces of {SIZE.format_short(self.piece_bytes)} at most (torch's own "
                 "arithmetic)")]


def _refused(but: str, hint: str) -> StopScript:
    """Raised inside the script: its `except Exception` must not hide it."""
    return StopScript(HeteroError(f"the plan updates each parameter during backward, but {but}", hint=hint,
                                  exit_code=STALE_PLAN))
