"""The plan's sections, one module each, in the order the planner goes through them (hetero.plan.section says what
each contributes). Adding a section on the plan side: its module, with its `Section` subclass, and one instance
of it here. `draft` sections are solved in this order, each from the ones before, then the `whole` ones; omitted
sections say why, and the iteration adds their costs, in it too.
"""

from __future__ import annotations

from dataclasses import replace

from hetero.plan.section import Section
from hetero.plan.sections import activations, allocator, layers, optimizer, recompute, routing, update_in_backward
from hetero.schema.plan import Plan

TABLE: tuple[Section, ...] = (optimizer.Optimizer(), allocator.Allocator(), update_in_backward.UpdatesInBackward(),
                              recompute.Recompute(), activations.Activations(), routing.Routing(), layers.Layers())


def plain_of(plan: Plan) -> Plan:
    """`plan` with nothing moved: the script as it is (what plain training has too, such as its routing, kept)."""
    return replace(plan, **{s.name: s.absent() for s in TABLE if not s.in_plain})
