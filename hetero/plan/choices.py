"""A plan in the simulator's terms: what `hetero plan` chose, or what a user edited, as `Choices` over the profile's
`Costs`. `hetero plan` and `hetero show --timeline` simulate a plan through this one translation.
"""

from __future__ import annotations

from typing import Any

from hetero.plan.model import GPU, Choices, Costs, costs, timed
from hetero.plan.section import Translation
from hetero.plan.sections import TABLE
from hetero.schema import tiers
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile

# The simulator sums the loads of busy background lanes in this order (then the others, in the sections' order):
# kept, so that a plan simulates to the last bit as it always has.
LANES_FIRST = ("evict", "prefetch")


def build(profile: Profile, plan: Plan) -> tuple[Costs, Choices]:
    """`plan` (possibly edited by hand) in the simulator's terms; entries naming unknown layers are ignored. Each
    section sets its own fields (hetero.plan.section); what none sets is plain training's."""
    evict, prefetch = next((c for s in TABLE if (c := s.curves(profile, plan)) is not None), (None, None))
    profiled = costs(profile, evict, prefetch)
    n, host = len(profiled.layers), host_tier(profile)
    index = {c.name: i for i, c in enumerate(profiled.layers)}
    t = Translation(profile=profile, plan=plan, costs=profiled, index=index, host=host,
                    static_bytes=static_bytes(profile, plan))
    fields: dict[str, Any] = dict(evict_bytes=[0] * n, trigger=[None] * n, prefetch_at_s=[0.0] * n,
                                  fast=GPU if profile.machine.gpu is not None else host, slow=None,
                                  static_bytes=t.static_bytes)
    shares: dict[str, float] = {}
    for section in TABLE:
        chosen = section.choose(t)
        shares.update(chosen.pop("cpu_share", {}))
        fields.update(chosen)
    fields["cpu_share"] = {k: shares[k] for k in LANES_FIRST if k in shares} | shares
    return profiled, timed(profiled, Choices(**fields))


def static_bytes(profile: Profile, plan: Plan) -> dict[str, int]:
    """Bytes each tier holds for the whole iteration, besides the GPU's parameter and gradient buffers (which depend
    on the layer modes: the simulator adds them) and activations: every section's, summed."""
    host, out = host_tier(profile), {}
    for section in TABLE:
        for tier, held in section.static_bytes(profile, plan, host).items():
            out[tier] = out.get(tier, 0) + held
    return out


def host_tier(profile: Profile) -> str:
    """The name of the profile's host-memory tier (hetero.schema.tiers)."""
    return tiers.host_tier(profile.machine.tiers).name
