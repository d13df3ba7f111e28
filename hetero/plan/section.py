"""The one seam between the planner and a plan section (optimizer, activations, routing, allocator,
update_in_backward, recompute, layers): a subclass of `Section` overrides the methods it contributes through; here
each contributes nothing. `hetero.plan.sections` holds one instance of each in a table; `solve`, `pins`, `choices`
and `footprint` loop over it and name no section. Pure: no torch, no I/O.
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


def busy_share(measured: float | None) -> float:
    """A background worker's measured share of a core; an unmeasured one counts as busy all the time."""
    return 1.0 if measured is None else measured


def ns(seconds: float) -> float:
    """Times in the plan to the nanosecond: readable, and far below any clock the runtime keeps."""
    return round(seconds, 9)


class Section:
    """One plan section's part in planning; see the module."""

    name: str  # the Plan field it fills
    phase: Phase = "draft"
    in_plain = False  # plain training has it too (a DDP all-reduce's routing: plain DDP pays for one alike)

    def solve(self, step: Step) -> Any:
        """The section, or None (then `step.omitted[name]` says why, unless a fit does)."""
        return None

    def pinned(self, profile: Profile, previous: Plan) -> Any:
        """What `previous` pinned of it, checked against the profile; None where nothing is."""
        return None

    def curves(self, profile: Profile, plan: Plan) -> tuple[Curve, Curve] | None:
        """The eviction and prefetch times the simulator's costs use, or None."""
        return None

    def static_bytes(self, profile: Profile, plan: Plan, host: str) -> dict[str, int]:
        """Bytes it holds per tier for the whole iteration, beyond the model's (`host`: the host-memory tier)."""
        return {}

    def choose(self, t: Translation) -> dict[str, Any]:
        """The `Choices` fields it sets."""
        return {}

    def host_bytes(self, profile: Profile, plan: Plan, peak: HostPeak) -> dict[str, int]:
        """Its entries of the host-memory account, by name (negative: what it saves)."""
        return {}

    def cost_s(self, profile: Profile, plan: Plan) -> float:
        """Time it adds per iteration beyond the simulated one."""
        return 0.0

    def settle(self, ctx: Context, plan: Plan) -> Plan:
        """The predicted plan, revised by this section."""
        return plan

    def absent(self) -> Any:
        """Its value where the plan leaves it out."""
        return None
