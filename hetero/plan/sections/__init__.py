"""The plan's sections, one module each, in the order the planner goes through them (hetero.plan.section says what
each contributes). Adding a section on the plan side: its module, and its entry here.

The order: `draft` sections are solved in it, each from the ones before (update_in_backward only where the
optimizer section left the script's optimizer), then the `whole` ones; sections left out say why in this order;
the iteration adds their costs in it.
"""

from __future__ import annotations

from hetero.plan.section import Section
from hetero.plan.sections import activations, allocator, layers, optimizer, recompute, routing, update_in_backward

TABLE: tuple[Section, ...] = (optimizer.SECTION, allocator.SECTION, update_in_backward.SECTION, recompute.SECTION,
                              activations.SECTION, routing.SECTION, layers.SECTION)
