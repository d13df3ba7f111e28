"""The Adam/AdamW step over flat fp32 buffers, in place, with exactly the math of `torch.optim.Adam`/`AdamW`.

`AdamKernel` is the fast path: torch's fused CPU/CUDA op through its functional API (`fused=True`), one pass over
param, grad, exp_avg and exp_avg_sq; `many` updates several tensors in one call, each exactly as alone.
`adam_reference` is the spec the tests hold it to: torch's single-tensor algorithm in plain ops (slow).

`step` is the 1-based number of this update (torch's `state["step"]` after it increments it).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.adamw import adamw

from hetero.errors import HeteroError


@dataclass(frozen=True, slots=True)
class Hyperparameters:
    """One Adam(W) update's constants. `decoupled_weight_decay=True` is AdamW (param *= 1 - lr * weight_decay);
    False is Adam (grad += wd * param)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        # Same bounds torch.optim.Adam checks, reported the hetero way.
        checks = [("lr", self.lr, self.lr >= 0, "lr must be >= 0"),
                  ("eps", self.eps, self.eps >= 0, "eps must be >= 0"),
                  ("beta1", self.betas[0], 0 <= self.betas[0] < 1, "betas must lie in [0, 1)"),
                  ("beta2", self.betas[1], 0 <= self.betas[1] < 1, "betas must lie in [0, 1)"),
                  ("weight_decay", self.weight_decay, self.weight_decay >= 0, "weight_decay must be >= 0")]
        for name, value, ok, rule in checks:
            if not ok:
                raise HeteroError(f"invalid Adam {name} {value!r}", hint=rule)

    @classmethod
    def from_param_group(cls, group: Mapping[str, Any]) -> Hyperparameters:
        """The constants of a `torch.optim.Adam`/`AdamW` param group (AdamW groups carry decoupled_weight_decay)."""
        if group.get("amsgrad", False):
            raise HeteroError("amsgrad=True is not supported by hetero's offloaded Adam",
                              hint="construct the optimizer with amsgrad=False, or run without an offloaded optimizer")
        beta1, beta2 = group["betas"]
        return cls(lr=float(group["lr"]),  # a tensor lr (capturable setups) becomes the float the CPU op takes
                   betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
                   weight_decay=float(group["weight_decay"]),
                   decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
                   maximize=bool(group.get("maximize", False)))


class AdamKernel:
    """The fused Adam(W) step, owning the step scalars the fused op reads (a step allocates nothing). Not
    thread-safe: give each thread that runs updates its own kernel."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = device
        self.steps: list[torch.Tensor] = []  # one per tensor of the largest call so far

    def many(self, params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
             exp_avg_sqs: list[torch.Tensor], *, hyperparameters: Hyperparameters, steps: list[int]) -> None:
        """Update each params[i] with grads[i], exp_avgs[i], exp_avg_sqs[i] at its own 1-based step, in place."""
        for args in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            _check_buffers(*args)
        while len(self.steps) < len(params):
            # float32, like torch's own state["step"], so bias corrections round exactly as torch's do.
            self.steps.append(torch.zeros((), dtype=torch.float32, device=self.device))
        state_steps = self.steps[:len(params)]
        for t, step in zip(state_steps, steps):
            t.fill_(step - 1)  # the functional API counts the step itself
        hp = hyperparameters
        update = adamw if hp.decoupled_weight_decay else adam
        update(params, grads, exp_avgs, exp_avg_sqs, [], state_steps, fused=True, amsgrad=False, lr=hp.lr,
               beta1=hp.betas[0], beta2=hp.betas[1], weight_decay=hp.weight_decay, eps=hp.eps, maximize=hp.maximize)

    def __call__(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 hyperparameters: Hyperparameters, step: int) -> None:
        """Update param, exp_avg and exp_avg_sq in place. Views into larger flat buffers are updated in place."""
        self.many([param], [grad], [exp_avg], [exp_avg_sq], hyperparameters=hyperparameters, steps=[step])


def adam_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                   hyperparameters: Hyperparameters, step: int) -> None:
    """torch.optim.Adam(W)'s single-tensor algorithm (non-capturable branch), in place. The spec, not the fast path."""
    hp = hyperparameters
    beta1, beta2 = hp.betas
    g = -grad if hp.maximize else grad
    if hp.weight_decay != 0:
        if hp.decoupled_weight_decay:
            param.mul_(1 - hp.lr * hp.weight_decay)
        else:
            g = g.add(param, alpha=hp.weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = hp.lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(hp.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _check_buffers(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   step: int) -> None:
    # Cheap per-call checks: a shape or dtype mismatch would otherwise surface as an opaque ATen error, or not at all.
    if step < 1:
        raise HeteroError(f"Adam step {step} is not a 1-based update number", hint="the first update uses step=1")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or t.device != param.device:
            raise HeteroError(f"Adam {name} has shape {tuple(t.shape)} on {t.device}, param has {tuple(param.shape)} "
                              f"on {param.device}", hint="pass four buffers of the same shape on the same device")
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise HeteroError(f"Adam {name} is {t.dtype}", hint="the kernel updates fp32 buffers; convert to float32")
