"""Plans measured alone: where plain training's own peak was not found with room for malloc's spread below a memory
limit, `hetero profile` runs leaner plans with malloc's defaults in fresh processes of their own, as `hetero run`
carries them out (hetero.profile.fresh), and the planner takes each as a candidate at its measured peak and step
(hetero.plan.fit), not at a prediction made from plain training's, which the profile could not measure.

The leaner plans, in the order the profile runs them (`to_measure`), each only where the one before did not fit:
the script's own updates in backward, which cost no time (where the script allows them: hetero.plan.in_backward);
then every block the profile found recomputable recomputed, with updates in backward where allowed. Nothing else
moves in them: no budget, malloc's defaults (recomputation with freed memory returned is planned from prediction, as
every other lever is). Pure: no torch, no I/O.
"""

from __future__ import annotations

from hetero.plan import in_backward, recompute, routing
from hetero.schema.plan import Plan
from hetero.schema.profile import MeasuredAlone, Profile

NAMES = {"in_backward": "updates in backward", "recompute": "every block recomputed"}  # what the profile says
UPDATES = frozenset({"in_backward"})  # the leaner plan that adds no work


def to_measure(profile: Profile) -> list[frozenset[str]]:
    """The leaner plans' levers (hetero.plan.fit.LEVERS), in the order the profile runs them."""
    updates = not in_backward.refused(profile, routing.links(profile)[1])
    blocks = bool(recompute.units(profile)[0])
    out = [UPDATES] if updates else []
    if blocks:
        out.append(frozenset({"recompute", "in_backward"} if updates else {"recompute"}))
    return out


def named(levers: frozenset[str]) -> str:
    """A leaner plan as the profile names it: `updates in backward and every block recomputed`."""
    return " and ".join(NAMES[x] for x in sorted(levers))


def levers_of(profile: Profile, plan: Plan) -> frozenset[str] | None:
    """The levers `plan` turns on, where it is one of the leaner plans (none else moved, malloc's defaults, every
    recomputable block where it recomputes); None where it is not."""
    if plan.allocator is not None or plan.optimizer is not None or plan.activations is not None:
        return None
    levers = set()
    if plan.update_in_backward is not None:
        levers.add("in_backward")
    if plan.recompute is not None:
        if set(plan.recompute.blocks) != {u.name for u in recompute.units(profile)[0]}:
            return None
        levers.add("recompute")
    return frozenset(levers) if levers else None


def measured(profile: Profile, plan: Plan) -> MeasuredAlone | None:
    """What the profile measured of `plan` alone (None: `plan` is no leaner plan, or it was not measured)."""
    m, levers = profile.memory, levers_of(profile, plan)
    if m is None or levers is None or m.returned_step_s is None:
        return None
    return next((r for r in m.measured_alone if frozenset(r.levers) == levers), None)


# What a leaner plan that recomputes must be measured faster by, one process against the one of memory returned, to be
# taken as faster: it does checkpointing's recomputation on top of plain training's work, and on this VM one process's
# step is off by as much (heldout_lm under 512 MiB and 1 GiB: measured 4% and 6% faster than memory returned in the
# profile, then 8% and ~10% slower side by side and in bench/cap.py; docs/benchmarks.md, rounds fifteen and sixteen).
RECOMPUTE_MARGIN = 0.10


def cost_s(profile: Profile, plan: Plan) -> float:
    """What a measured leaner plan adds to the profile's iteration: its step less plain training's with freed memory
    returned, measured beside it (the profile's own steps returned freed memory: the difference may be a saving).
    Updates in backward alone add no work, and malloc's defaults fault less than memory returned: for them only a
    saving is taken, a step measured above is the machine's noise (train_gpt 1 x 768 under 512 MiB: measured alone
    at 1.09x the step with memory returned, one process each; 0.80x in 4 interleaved rounds, docs/benchmarks.md
    round thirteen). One that recomputes is counted `RECOMPUTE_MARGIN` of that step slower than measured."""
    found = measured(profile, plan)
    if found is None or taken_as_free(profile, found):
        return 0.0
    margin = RECOMPUTE_MARGIN * profile.memory.returned_step_s if "recompute" in found.levers else 0.0
    return found.step_s - profile.memory.returned_step_s + margin


def taken_as_free(profile: Profile, found: MeasuredAlone) -> bool:
    """Whether `found`, measured slower than the step with freed memory returned, is taken at no cost (`cost_s`)."""
    return "recompute" not in found.levers and found.step_s > profile.memory.returned_step_s
