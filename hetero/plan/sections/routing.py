"""The routing section: how each layer's gradient all-reduce travels between data-parallel ranks (small tensors on
the latency path, large ones sharded on the bandwidth path; hetero.plan.routing). Pure: no torch, no I/O."""

from __future__ import annotations

from typing import Any

from hetero.plan import routing
from hetero.plan.section import Section, Step, Translation
from hetero.schema.plan import Plan, RoutingPlan
from hetero.schema.profile import Profile

ONE_PROCESS = "the profile has one process: no gradient synchronization to route"


class Routing(Section):
    name = "routing"
    in_plain = True  # plain DDP pays for its all-reduce alike

    def solve(self, step: Step) -> RoutingPlan | None:
        ctx = step.ctx
        if not ctx.links:
            step.omitted["routing"] = ONE_PROCESS
            return None
        if ctx.profile.model.sharded:
            step.omitted["routing"] = ("FSDP2 reduce-scatters the gradients of the sharded parameters itself: there "
                                       "is no DDP all-reduce to route")
            return None
        if (kept := step.pinned("routing")) is not None:  # pinned in the earlier plan
            return kept
        training = ctx.profile.training
        r = routing.route(ctx.links, ctx.ranks, sum(p.params_bytes for p in ctx.profile.layers), training.forward_s,
                          training.backward_s)
        return RoutingPlan(threshold_bytes=r.threshold_bytes, latency_peer=r.latency_peer,
                           bandwidth_peer=r.bandwidth_peer, shard_bytes=r.shard_bytes,
                           dual_sync_bytes=r.dual_sync_bytes, why=r.why)

    def pinned(self, _: Profile, previous: Plan) -> RoutingPlan | None:
        return previous.routing if previous.routing and previous.routing.pinned else None

    def choose(self, t: Translation) -> dict[str, Any]:
        return dict(sync_s=sync_times(t.profile, t.plan))


def sync_times(profile: Profile, plan: Plan) -> list[float]:
    """Each layer's gradient all-reduce time under the plan's routing; empty without routing."""
    r = plan.routing
    links, ranks = routing.links(profile)
    by_peer = {k.peer: k.curve for k in links}
    if r is None or r.latency_peer not in by_peer or r.bandwidth_peer not in by_peer:
        return []
    lat, bw = by_peer[r.latency_peer], by_peer[r.bandwidth_peer]
    return [routing.sync_time_s(x.params_bytes, ranks, r.threshold_bytes, r.shard_bytes, lat, bw) if x.params_bytes
            else 0.0 for x in profile.layers]
