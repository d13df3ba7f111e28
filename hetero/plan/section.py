"""The one seam between the planner and a plan section: what each section (optimizer, activations, routing,
allocator, update_in_backward, recompute, layers) contributes to planning, as a `Section` of functions.

A section contributes, each through one field: the section itself (`solve`, run in its `phase`), what an earlier
plan pinned of it (`pinned`), what it holds in each tier for the whole iteration (`static_bytes`), its part of the
simulator's choices (`curves`, `choose`), its entries of the host-memory account (`host_bytes`), time it adds
beyond the simulated iteration (`cost_s`), and what it decides once the plan is predicted (`settle`). Every field
but `name`, `phase` and `solve` defaults to contributing nothing. `hetero.plan.sections` lists them in a table;
`solve`, `pins`, `choices` and `footprint` loop over that table and name no section. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from hetero.plan.context import Context
from hetero.plan.model import Choices, Costs, Curve
from hetero.plan.simulate import Result
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile

# `draft`: solved from the context and the sections before it in the table; `whole`: after every draft section,
# from the whole draft (what it simulates includes them).
Phase = Literal["draft", "whole"]


@dataclass(frozen=True, slots=True)
class Pins:
    """What the user pinned in an earlier plan (`hetero plan --from OLD_PLAN`), by section name: each section's
    own `pinned` value (None, or an empty collection, where nothing of it is pinned)."""

    entries: dict[str, Any]

    def get(self, section: str) -> Any:
        return self.entries.get(section)


@dataclass(frozen=True, slots=True)
class Step:
    """What a section's `solve` reads."""

    ctx: Context
    pins: Pins
    levers: frozenset[str]  # what the fit turned on (hetero.plan.fit.LEVERS, hetero.plan.gpu_fit.LEVERS)
    blocks: int | None  # how many blocks `recompute` takes (all it can: None)
    draft: Plan  # the sections solved before this one; the later ones absent
    omitted: dict[str, str]  # a section the plan leaves out writes why here, under its name
    predict: Callable[[Plan], Result]  # a plan's simulated iteration on the profiled machine
    build: Callable[[Plan], tuple[Costs, Choices]]  # a plan in the simulator's terms (hetero.plan.choices.build)
    plain_of: Callable[[Plan], Plan]  # the plan with nothing moved (hetero.plan.sections.plain_of)

    def pinned(self, section: str) -> Any:
        return self.pins.get(section)


@dataclass(frozen=True, slots=True)
class Translation:
    """What a section's `choose` reads: the plan in the simulator's terms so far."""

    profile: Profile
    plan: Plan
    costs: Costs
    index: dict[str, int]  # layer name -> index in `costs.layers`
    host: str  # the host-memory tier's name
    static_bytes: dict[str, int]  # what each tier holds for the whole iteration (hetero.plan.choices.static_bytes)


@dataclass(frozen=True, slots=True)
class HostPeak:
    """The simulator's figures a section's host-memory account entries start from (hetero.plan.footprint)."""

    host: str  # the host-memory tier's name
    simulated_bytes: int  # the simulated host peak: static bytes plus activations there
    evicted_from_peak: int  # saved-activation bytes of that peak where host memory is the fast tier (0 with a GPU)
    evicted_saving: int  # how much tiering lowers the saved-activation peak in host memory
    memory_returned: bool  # the account starts from plain training's peak with freed memory returned


def ns(seconds: float) -> float:
    """Times in the plan to the nanosecond: readable, and far below any clock the runtime keeps."""
    return round(seconds, 9)


def _nothing(*_: Any) -> None:
    return None


def _no_bytes(*_: Any) -> dict[str, int]:
    return {}


def _no_choices(_: Translation) -> dict[str, Any]:
    return {}


def _no_time(*_: Any) -> float:
    return 0.0


@dataclass(frozen=True, slots=True)
class Section:
    """One plan section's part in planning; see the module."""

    name: str  # the Plan field it fills
    phase: Phase
    solve: Callable[[Step], Any]  # the section, or None (then `omitted[name]` says why, unless a fit does)
    pinned: Callable[[Profile, Plan], Any] = _nothing  # of the earlier plan, checked against the profile
    curves: Callable[[Profile, Plan], tuple[Curve, Curve] | None] = _nothing  # eviction and prefetch times
    static_bytes: Callable[[Profile, Plan, str], dict[str, int]] = _no_bytes  # per tier, beyond the model's
    choose: Callable[[Translation], dict[str, Any]] = _no_choices  # `Choices` fields it sets
    host_bytes: Callable[[Profile, Plan, HostPeak], dict[str, int]] = _no_bytes  # account entries, by name
    cost_s: Callable[[Profile, Plan], float] = _no_time  # per iteration, beyond the simulated one
    settle: Callable[[Context, Plan], Plan] | None = None  # the predicted plan, revised by this section
    absent: Callable[[], Any] = _nothing  # the section's value where the plan leaves it out
    in_plain: bool = False  # plain training has it too (a DDP all-reduce's routing: plain DDP pays for one alike)
