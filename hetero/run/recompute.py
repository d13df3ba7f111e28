"""The plan's `recompute` section: the chosen blocks' forwards run through torch.utils.checkpoint.

Each block the plan names gets an instance `forward` calling `checkpoint(original_forward, ..., use_reentrant=False)`
while gradients are enabled (RNG state preserved), so autograd keeps the block's inputs and backward runs the forward
again. The block's own hooks and those of the modules inside it still run (the latter once more in the
recomputation), so the plan's other mechanisms compose with it. Without gradients the block runs as written; a copy
of the model (an EMA's deepcopy) has none of it (hetero.harness.hooks.forward_override); `close` removes the instance
attribute. The runtime decides nothing: the profile checked the blocks, the plan chose them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetero.errors import STALE_PLAN, HeteroError
from hetero.harness import hooks
from hetero.run.mechanism import Mechanism
from hetero.schema.plan import RecomputePlan


class Recompute(Mechanism):
    """Checkpoints the plan's blocks from `bind` to `close`."""

    def __init__(self, plan: RecomputePlan):
        self.plan = plan
        self.overrides: list[hooks.Override] = []
        self.recomputed = 0  # forwards of a chosen block run through checkpoint

    def bind(self, model: nn.Module) -> None:
        modules = dict(model.named_modules(remove_duplicate=False))
        missing = [name for name in self.plan.blocks if name not in modules]
        if missing:
            raise HeteroError(f"the plan recomputes {', '.join(missing)}, which the model does not have",
                              hint="profile and plan again", exit_code=STALE_PLAN)
        for name in self.plan.blocks:
            block = modules[name]
            self.overrides.append(hooks.forward_override(block, functools.partial(self._checkpointed, block.forward)))

    def _checkpointed(self, forward, *args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        self.recomputed += 1
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    def close(self) -> None:
        self.overrides = hooks.removed(self.overrides)

    def summary(self) -> list[str]:
        if not self.recomputed:
            return []
        return [f"recompute: {len(self.plan.blocks)} blocks kept only their inputs, {self.recomputed} block forwards "
                "recomputed in backward (torch.utils.checkpoint, use_reentrant=False)"]
