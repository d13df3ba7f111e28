"""The runtime of `hetero run`: carry out a plan on a script while it runs, deciding nothing itself.

Each plan section is carried out by one mechanism (hetero.run.mechanism), built by the factory `MECHANISMS` names
for it from that section alone and the shared services it declares, and driven in the order of its `Phase`.
A new mechanism is a `Mechanism` subclass in its own module, defining only the calls it uses, and one `Entry` here;
the run reaches it by type (`Runtime.find`), never by its position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from hetero.errors import HeteroError
from hetero.harness.capture import Capture, check_planned
from hetero.run.allocator import ReturnFreedMemory
from hetero.run.budget_watch import BudgetWatch
from hetero.run.ddp_sync import DdpSync
from hetero.run.gpu_budget import GpuBudget
from hetero.run.mechanism import M, Mechanism, Patches, Phase, Services, find
from hetero.run.optimizer import OptimizerOffload
from hetero.run.recompute import Recompute
from hetero.run.recorder import Outputs, Recorder
from hetero.run.routing import GradientRouting
from hetero.run.shadow import ShadowConfig, shadow_model
from hetero.run.tiering import ActivationTiering
from hetero.run.update_in_backward import InBackwardPlan, UpdatesInBackward
from hetero.schema.plan import Plan


@dataclass(frozen=True)
class Entry:
    """One mechanism of the table: `section(plan)` is what it carries out (None: the plan asks for none), and
    `build(section, **services)` makes it (None: nothing to carry out), given the `Services` fields in `needs`."""

    phase: Phase
    section: Callable[[Plan], object | None]
    build: Callable[..., Mechanism | None]
    needs: tuple[str, ...] = ()


def _offloaded(plan: Plan):
    return plan.optimizer if plan.optimizer is not None and plan.optimizer.device != "gpu" else None


def _synced(plan: Plan) -> bool | None:
    """DDP's hook is needed by routing and by updates overlapped with backward."""
    offloaded = _offloaded(plan)
    return True if plan.routing is not None or (offloaded is not None and offloaded.overlap_backward) else None


MECHANISMS: tuple[Entry, ...] = (  # within a phase, in this order
    Entry(Phase.MEMORY, lambda plan: plan.allocator, ReturnFreedMemory),
    Entry(Phase.PLACEMENT, ShadowConfig.of, shadow_model),
    Entry(Phase.OPTIMIZER, _offloaded, OptimizerOffload, needs=("ddp",)),
    Entry(Phase.OPTIMIZER, InBackwardPlan.of, UpdatesInBackward),
    Entry(Phase.ACTIVATIONS, lambda plan: plan.activations, ActivationTiering),
    Entry(Phase.ACTIVATIONS, lambda plan: plan.recompute, Recompute),
    Entry(Phase.COMMUNICATION, lambda plan: plan.routing, GradientRouting, needs=("ddp", "fingerprint", "predicted")),
    Entry(Phase.COMMUNICATION, _synced, lambda _, ddp: ddp, needs=("ddp",)),
    Entry(Phase.BUDGET, lambda plan: plan.budget if plan.budget.gpu_memory_bytes else None, GpuBudget,
          needs=("predicted",)),
    Entry(Phase.WATCH, lambda plan: plan.budget if plan.budget.dram_budget_bytes else None, BudgetWatch,
          needs=("predicted", "earlier")),
    Entry(Phase.RECORD, lambda plan: plan, lambda plan, record, earlier: Recorder(plan, record, earlier)
          if record is not None else None, needs=("record", "earlier")),  # the digest of the whole plan
)


def mechanisms(plan: Plan, record: Outputs | None = None, table: tuple[Entry, ...] = MECHANISMS) -> list[Mechanism]:
    """The mechanisms this plan asks for (and the recorder, given `record`), in the order of their phases."""
    services = Services(fingerprint=plan.source.model_fingerprint, budget=plan.budget, predicted=plan.predicted,
                        ddp=DdpSync(), record=record)
    found: list[Mechanism] = []
    for entry in sorted(table, key=lambda e: e.phase):
        if (section := entry.section(plan)) is None:
            continue
        given = replace(services, earlier=list(found))
        made = entry.build(section, **{name: getattr(given, name) for name in entry.needs})
        found += [made] if made is not None else []
    return found


class Runtime:
    def __init__(self, plan: Plan, *, script: str, allow_stale: bool = False, record: Outputs | None = None):
        self.plan, self.allow_stale = plan, allow_stale
        self.capture = Capture(self._found, script, fingerprint=plan.source.model_fingerprint,
                               parts=[(m.name, m.fingerprint) for m in plan.source.models])
        self.mechanisms = mechanisms(plan, record)
        self.patches = Patches()
        self.model: nn.Module | None = None

    def find(self, kind: type[M]) -> M | None:
        """The run's mechanism of type `kind` (None: the plan has none)."""
        return find(self.mechanisms, kind)

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
        check_planned(model, self.plan.source.model_fingerprint, self.allow_stale)
        self.model = model
        for m in self.mechanisms:
            m.bind(model)

    def summary(self) -> list[str]:
        return [line for m in self.mechanisms for line in m.summary()]

    def explain(self, error: BaseException) -> HeteroError | None:
        """The one-line error a mechanism has for the script's exception (an overrun of its budget), or None."""
        return next((e for m in self.mechanisms if (e := m.explain(error)) is not None), None)
