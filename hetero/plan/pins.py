"""What the user pinned in an earlier plan (`hetero plan --from OLD_PLAN`): entries marked `pinned: true` survive
re-planning as written, checked against the profile first."""

from __future__ import annotations

from dataclasses import dataclass

from hetero.errors import USAGE, HeteroError
from hetero.plan import axdimm
from hetero.schema.plan import Eviction, LayerPlan, OptimizerPlan, Plan, RoutingPlan
from hetero.schema.profile import Profile


@dataclass(kw_only=True, slots=True)
class Pins:
    layers: dict[str, LayerPlan]
    evictions: dict[str, Eviction]
    optimizer: OptimizerPlan | None
    routing: RoutingPlan | None


def pins_of(profile: Profile, previous: Plan | None) -> Pins:
    if previous is None:
        return Pins(layers={}, evictions={}, optimizer=None, routing=None)
    names = {layer.name for layer in profile.layers}
    layers = {e.name: e for e in previous.layers if e.pinned}
    evictions = {e.layer: e for e in (previous.activations.schedule if previous.activations else []) if e.pinned}
    unknown = sorted((set(layers) | set(evictions)) - names)
    if unknown:
        raise HeteroError(f"--from plan pins layers the profile does not have: {', '.join(unknown[:5])}",
                          hint="unpin or delete those entries in the old plan, then re-plan", exit_code=USAGE)
    optimizer = previous.optimizer if previous.optimizer and previous.optimizer.pinned else None
    if optimizer is not None and {s.param for s in optimizer.states} != {p.name for p in axdimm.params(profile)}:
        raise HeteroError("--from plan pins an optimizer section whose parameters differ from the profile's",
                          hint="unpin the optimizer section of the old plan (pinned: false)", exit_code=USAGE)
    route = previous.routing if previous.routing and previous.routing.pinned else None
    return Pins(layers=layers, evictions=evictions, optimizer=optimizer, routing=route)


def pinned_field(pins: Pins, name: str, field: str) -> str | None:
    entry = pins.layers.get(name)
    return getattr(entry, field) if entry else None
