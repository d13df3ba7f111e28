"""The allocator section: glibc returns the memory freed tensors leave (a lever of the DRAM-budget fit,
hetero.plan.fit), its cost the page faults the profile measured, and from when on it does so. Pure: no torch, no
I/O."""

from __future__ import annotations

from dataclasses import replace

from hetero.plan import fit
from hetero.plan.context import Context
from hetero.plan.section import Section, Step
from hetero.schema.plan import AllocatorPlan, Plan
from hetero.schema.profile import Profile
from hetero.units import SIZE, short_time

BELOW_SWITCH = "malloc's defaults below the switch"  # its host-memory account entry, from `from_bytes` on
# Under 512 MiB a switch 20 MiB below the budget less headroom was passed before it took hold (a width-768 model of
# 6 layers, killed at 512 MiB with the plan predicting 477): the switch needs at least this share of the budget above.
SWITCH_SHARE = 16


def solve(step: Step) -> AllocatorPlan | None:
    if "allocator" not in step.levers:
        return None
    plan = _allocator(step.ctx)
    if "recompute" not in step.levers:
        return plan
    return replace(plan, why=f"{plan.why}; recomputed blocks need it (hetero.plan.fit.NEEDS): with malloc's "
                             "defaults the heap keeps much of what their rebuilds free, and the peak falls by far less")


def cost_s(profile: Profile, plan: Plan) -> float:
    return fit.allocator_cost_s(profile) if plan.allocator is not None else 0.0


def _allocator(ctx: Context) -> AllocatorPlan:
    m = ctx.profile.memory
    if m.dram_peak_estimated:  # from when on is decided once the plan's peak is predicted (settle)
        return fit.allocator_plan(
            f"glibc returns the memory freed tensors leave as it did throughout the profile ({m.profiled_under}): "
            f"plain training peaked at {SIZE.format_short(m.dram_peak_returned_bytes)} that way")
    return fit.allocator_plan(
        f"glibc returns the memory freed tensors leave: plain training peaks at "
        f"{SIZE.format_short(m.dram_peak_returned_bytes)} this way against {SIZE.format_short(m.dram_peak_bytes)} "
        f"by default, for {short_time(fit.allocator_cost_s(ctx.profile))} more per step (page faults), as the "
        "profile measured it in a fresh process")


def settle(ctx: Context, out: Plan) -> Plan:
    """Without plain's own peak, freed memory is returned only from halfway between the plan's predicted peak (with
    it returned) and the budget less headroom: below, malloc's defaults cost few page faults (the runtime returns
    what the heaps hold free after a backward that grew them, so that they do not grow from iteration to
    iteration); the other half is for what the process adds after the switch (what the heaps hold free then, and
    what the next allocations cannot take from it). Where that half is under a `SWITCH_SHARE` of the budget, or
    under the saved activations of a step (what backward frees into the heaps: a script saving 489 MiB a step grew
    by 60-130 MiB past a switch 80 MiB under the room, and was killed; docs/benchmarks.md, round seven), memory is
    returned from the start, as the profile did."""
    if out.allocator is None or not ctx.profile.memory.dram_peak_estimated:
        return out
    host = ctx.host.name
    peak, room = out.predicted.peak_bytes[host], fit.room_bytes(ctx)
    start = max(peak, (peak + room) // 2 >> 20 << 20)  # whole MiB, as a user would write it
    activations = sum(x.saved_bytes for x in ctx.profile.layers)
    if room - start < max(ctx.dram_budget_bytes // SWITCH_SHARE, activations):
        return replace(out, allocator=replace(out.allocator, from_bytes=None, why=(
            f"{out.allocator.why}; from the start: a switch halfway to the budget would leave "
            f"{SIZE.format_short(room - start)}, less than 1/{SWITCH_SHARE} of it or a step's saved activations "
            f"({SIZE.format_short(activations)}), for what malloc's defaults add after the switch")))
    # malloc's defaults may take the process up to the switch: the prediction says so (its own account entry)
    predicted = replace(out.predicted, peak_bytes=out.predicted.peak_bytes | {host: start},
                        dram=out.predicted.dram | ({BELOW_SWITCH: start - peak} if start > peak else {}))
    return replace(out, predicted=predicted, allocator=replace(out.allocator, from_bytes=start, why=(
        f"{out.allocator.why}; with malloc's defaults, whose peak the profile could not measure, until the process "
        f"holds {SIZE.format_short(start)}, halfway from the predicted {SIZE.format_short(peak)} to the budget less "
        f"headroom ({SIZE.format_short(room)}): fewer page faults below it, and the process may hold up to it")))


SECTION = Section(name="allocator", phase="draft", solve=solve, cost_s=cost_s, settle=settle)
