"""The seam every runtime mechanism sits behind: its phases, the base class with their no-op defaults, the shared
services a mechanism may ask for, and torch's attributes replaced for the run.

A mechanism carries out one section of the plan, driven through the same calls: `install` before the script runs
(swap torch classes, register hooks); `bind` when the model appears (the root module with the plan's fingerprint,
at its first forward, before anything runs on it); `close` after the script, however it ended (an error, Ctrl-C),
which restores torch and removes every file made. `summary` and `resident_bytes` are read after and during the run.
`Phase` orders them: a mechanism is installed, bound and closed after every mechanism of an earlier phase.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeVar

from torch import nn

from hetero.errors import HeteroError
from hetero.schema.plan import Budget, Predicted


class Phase(IntEnum):
    """When a mechanism is installed and bound, relative to the others (a lower phase first)."""

    MEMORY = 0  # malloc's settings must hold before any other mechanism allocates
    PLACEMENT = 1  # the shadow model: the others see parameters where the plan puts them
    OPTIMIZER = 2
    ACTIVATIONS = 3
    COMMUNICATION = 4  # routing, then the one DDP hook the optimizer and routing share
    BUDGET = 5  # the GPU cap
    WATCH = 6  # reads what the mechanisms before it hold
    RECORD = 7  # reads everything: last


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


NeedModel = Callable[[object], None]


class Mechanism:
    """What carries out one section of the plan. Every call is a no-op here: a mechanism defines the ones it uses."""

    def install(self, patches: Patches, need_model: NeedModel) -> None:
        """Before the script runs. `need_model(optimizer)`: the model is needed before its first forward."""

    def bind(self, model: nn.Module) -> None:
        """The model is known (the plan's), before anything runs on it."""

    def close(self) -> None:
        """After the script, however it ended: restore what was changed, remove what was made."""

    def summary(self) -> list[str]:
        """Lines for the run's summary."""
        return []

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes it holds now, by tier (a tier name, or the role `host`, `nvme`, `gpu`) and by what they are."""
        return {}

    def explain(self, error: BaseException) -> HeteroError | None:
        """The one-line error it has for the script's exception (an overrun of its budget), or None."""
        return None


@dataclass(frozen=True)
class Services:
    """What a mechanism's factory may ask for besides its section, each by its field name (`Entry.needs`)."""

    fingerprint: str  # the planned model's
    budget: Budget  # the plan's budgets
    predicted: Predicted  # the plan's predictions
    ddp: Mechanism  # DDP's one communication hook (hetero.run.ddp_sync.DdpSync), shared
    record: object = None  # `hetero run --trace`'s outputs (hetero.run.recorder.Outputs); None: no recording
    earlier: list[Mechanism] = field(default_factory=list)  # the mechanisms built so far (in phase order)


M = TypeVar("M", bound=Mechanism)


def find(mechanisms: list[Mechanism], kind: type[M]) -> M | None:
    """The run's mechanism of type `kind`, or None: never reach one by its position."""
    return next((m for m in mechanisms if isinstance(m, kind)), None)
