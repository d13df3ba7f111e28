"""Where the shadow model (hetero.run.shadow) puts each parameter and what it does when, from the plan's `layers`
section and the model's names alone: pure, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from hetero.errors import STALE_PLAN, HeteroError
from hetero.schema.plan import GradPlace, LayerGrad, LayerMode, LayerPlan, Mode
from hetero.schema.profile import ROOT_LAYER


@dataclass(frozen=True, slots=True)
class LayerStorage:
    name: str
    mode: Mode
    grad: GradPlace
    params: tuple[str, ...]  # qualified names of the parameters this layer places


@dataclass(frozen=True, slots=True)
class Schedule:
    """What the shadow model does and when, for the layers (in forward order) that own parameters."""

    layers: tuple[LayerStorage, ...]

    def storage(self) -> dict[str, Mode]:
        """Each placed parameter's mode."""
        return {p: x.mode for x in self.layers for p in x.params}

    def copies_after_step(self) -> list[str]:
        """GFGB layers, in forward order: copied on the copy stream after the step, one event each."""
        return [x.name for x in self.layers if x.mode == LayerMode.GFGB]

    def waits_before_forward(self) -> list[str]:
        """Layers whose forward waits for their own copy event."""
        return self.copies_after_step()

    def copies_after_forward(self) -> list[str]:
        """DFGB layers, in backward order: copied at the model's forward end, each after its own forward ended."""
        return [x.name for x in reversed(self.layers) if x.mode == LayerMode.DFGB]

    def switches_before_backward(self) -> list[str]:
        """Layers whose storage switches from the host view to the device copy when their backward starts."""
        return [x.name for x in self.layers if x.mode == LayerMode.DFGB]

    def host_grads(self) -> list[str]:
        return [p for x in self.layers if x.grad == LayerGrad.HOST for p in x.params]


def schedule(entries: list[LayerPlan], modules: list[str], params: list[str]) -> Schedule:
    """Each parameter (by qualified name) belongs to the deepest plan layer whose module contains it: the module
    owning it directly (module granularity) or its repeated block (block granularity); none leaves it as it is."""
    known = {name or ROOT_LAYER for name in modules}
    unknown = [e.name for e in entries if e.name not in known]
    if unknown:
        raise HeteroError(f"the plan's layers section names {len(unknown)} layer(s) the model does not have: "
                          f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}",
                          hint="profile and plan again for this model", exit_code=STALE_PLAN)
    by_module = {"" if e.name == ROOT_LAYER else e.name: e for e in entries}
    owned: dict[str, list[str]] = {e.name: [] for e in entries}
    for param in params:
        path = param.split(".")[:-1]
        owner = next((by_module[".".join(path[:k])] for k in range(len(path), -1, -1)
                      if ".".join(path[:k]) in by_module), None)
        if owner is not None:
            owned[owner.name].append(param)
    return Schedule(tuple(LayerStorage(e.name, e.mode, e.grad, tuple(owned[e.name])) for e in entries
                          if owned[e.name]))
