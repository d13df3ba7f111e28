"""The runtime of `hetero run`: carry out a plan on a script while it runs, deciding nothing itself.

Each plan section is carried out by one mechanism (the offloaded optimizer, activation tiering, ...), driven
through the same phases: `install` before the script runs (swap torch classes, register hooks); `bind` when the
model appears (the root module with the plan's fingerprint, at its first forward, before anything runs on it);
`close` after the script, however it ended (an error, Ctrl-C), which restores torch and removes every file made.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

from torch import nn

from hetero.errors import STALE_PLAN, HeteroError
from hetero.harness.capture import Capture, fingerprint
from hetero.run.recorder import Outputs, Recorder
from hetero.schema.plan import Plan


class Patches:
    """Attributes of torch replaced for the run, restored in reverse order at the end."""

    def __init__(self):
        self._saved: list[tuple[object, str, object]] = []

    def set(self, owner: object, name: str, value: object) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)


class Mechanism(Protocol):
    """What carries out one section of the plan."""

    def install(self, patches: Patches, need_model: Callable[[object], None]) -> None: ...
    def bind(self, model: nn.Module) -> None: ...
    def close(self) -> None: ...
    def summary(self) -> list[str]: ...
    def resident_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes it holds now, by tier (a tier name, or the role `host`, `nvme`, `gpu`) and by what they are."""


def mechanisms(plan: Plan) -> list[Mechanism]:
    """The mechanisms this plan asks for."""
    from hetero.run.allocator import ReturnFreedMemory
    from hetero.run.budget_watch import BudgetWatch
    from hetero.run.ddp_sync import DdpSync
    from hetero.run.gpu_budget import GpuBudget
    from hetero.run.optimizer import OptimizerOffload
    from hetero.run.recompute import Recompute
    from hetero.run.routing import GradientRouting
    from hetero.run.shadow import shadow_model
    from hetero.run.tiering import ActivationTiering
    from hetero.run.update_in_backward import UpdatesInBackward

    ddp = DdpSync()  # DDP's one communication hook, shared by routing and the optimizer's overlapped updates
    found: list[Mechanism] = [*shadow_model(plan)]  # bound first: the others see parameters where the plan puts them
    if plan.optimizer is not None and plan.optimizer.device != "gpu":
        found.append(OptimizerOffload(plan.optimizer, ddp))
    found += [UpdatesInBackward(plan.update_in_backward)] if plan.update_in_backward is not None else []
    found += [ActivationTiering(plan.activations)] if plan.activations is not None else []
    found += [Recompute(plan.recompute)] if plan.recompute is not None else []
    found += [GradientRouting(plan, ddp)] if plan.routing is not None else []
    overlapped = plan.optimizer is not None and plan.optimizer.device != "gpu" and plan.optimizer.overlap_backward
    found += [ddp] if overlapped or plan.routing is not None else []
    # first: malloc's settings must hold before any other mechanism allocates
    found[:0] = [ReturnFreedMemory(plan.allocator)] if plan.allocator is not None else []
    found += [GpuBudget(plan)] if plan.budget.gpu_memory_bytes else []
    return found + ([BudgetWatch(plan, list(found))] if plan.budget.dram_budget_bytes else [])


class Runtime:
    def __init__(self, plan: Plan, *, script: str, allow_stale: bool = False, record: Outputs | None = None):
        self.plan, self.allow_stale = plan, allow_stale
        self.capture = Capture(self._found, script, fingerprint=plan.source.model_fingerprint,
                               parts=[(m.name, m.fingerprint) for m in plan.source.models])
        self.mechanisms = mechanisms(plan)
        if record is not None:  # last: it reads the others' bytes
            self.mechanisms.append(Recorder(plan, record, list(self.mechanisms)))
        self.patches = Patches()
        self.model: nn.Module | None = None

    def __enter__(self) -> Runtime:
        self.capture.__enter__()
        for m in self.mechanisms:
            m.install(self.patches, self._need_model)
        return self

    def __exit__(self, *exc) -> None:
        self.patches.restore()
        self.capture.__exit__()
        for m in self.mechanisms:
            m.close()

    def _need_model(self, optimizer) -> None:
        """A mechanism needs the model before its first forward was seen: decide among the roots seen so far."""
        if self.model is None:
            self.capture.resolve(optimizer)

    def _found(self, model: nn.Module, optimizer) -> None:
        """The model is known: check it is the planned one, then bind every mechanism to it."""
        actual, wanted = fingerprint(model), self.plan.source.model_fingerprint
        if actual != wanted:
            if not self.allow_stale:
                raise HeteroError(f"the script's model ({actual[:19]}...) is not the one the plan was made for "
                                  f"({wanted[:19]}...)", hint="profile and plan again, or pass --allow-stale",
                                  exit_code=STALE_PLAN)
            print(f"hetero: warning: running a plan made for another model ({wanted[:19]}...)", file=sys.stderr)
        self.model = model
        for m in self.mechanisms:
            m.bind(model)

    def summary(self) -> list[str]:
        return [line for m in self.mechanisms for line in m.summary()]

    def explain(self, error: BaseException) -> HeteroError | None:
        """The one-line error a mechanism has for the script's exception (an overrun of its budget), or None."""
        return next((e for m in self.mechanisms if hasattr(m, "explain") and (e := m.explain(error)) is not None),
                    None)
