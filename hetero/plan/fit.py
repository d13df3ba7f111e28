"""Keeping a DRAM budget on a machine without a GPU: the plan's predicted whole-process peak (hetero.plan.footprint)
must not exceed it. When plain training's does, the planner tries every combination of what can lower host memory
here, each simulated as a whole plan, and keeps the fastest combination that fits:

- `allocator`: glibc returns the memory freed tensors leave (the plan's `allocator` section); the profile measures
  the peak and the step time that way, so its cost is measured page faults, not a guess;
- `in_backward`: the script's own Adam(W) updates each parameter as soon as backward makes its gradient final and
  frees the gradient (the plan's `update_in_backward`): all gradients but one never coexist, at no cost in time,
  for a script with one backward per step, no clipping, one process;
- `states`: every Adam state (and its fp32 master copy) on NVMe, staged through host memory inside `step()`;
- `grads`: with `states`, each gradient joins its states on NVMe as soon as backward makes it final, and `step()`
  reads it back with them (MemFerry's "a gradient leaves when it is final", with NVMe as the slow tier); only for one
  process (a data-parallel all-reduce needs the gradients in memory);
- `tiering`: saved activations evicted to the slow tier after each layer's forward (lowers the peak only where
  freed memory is returned, which the footprint counts);
- `recompute`: the blocks the profile found recomputable keep only their inputs, and backward runs their forward
  again (hetero.plan.recompute), with freed memory returned (`NEEDS`): time for memory, like the disk levers, so the
  fastest combination that fits decides between them; with it, the fewest blocks (most bytes saved per second
  first) that keep the budget.

Where the profile measured leaner plans with malloc's defaults alone (under a memory limit that plain training's own
peak did not settle under with room for their spread; hetero.plan.alone: updates in backward, then every block
recomputed), each is one more candidate, at its measured peak and step. A peak measured alone (plain's, or such
a plan's) keeps malloc's spread above it under the budget, less the mapped files; a simulated one keeps the room
(`room_of`: the simulation's headroom too).

A budget comes from `--dram-budget` or, by default, from the memory cgroup the profile ran in. Pure: no torch, no
I/O; `solve` builds and simulates each candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import combinations

from hetero.errors import USAGE, HeteroError
from hetero.plan import alone, in_backward, recompute
from hetero.schema.plan import AllocatorPlan, Plan
from hetero.units import SIZE, short_time

LEVERS = ("allocator", "in_backward", "states", "grads", "tiering", "recompute")  # in the order of their lines
# A lever that works only with another. Recomputed blocks with malloc's defaults: the heap keeps what their rebuilds
# free, and train_gpt 6 x 256 with every block recomputed peaked at 931-1020 MiB from run to run against 526 MiB,
# twice, with freed memory returned (plain: 1.27-1.32 GiB, 970 MiB; docs/benchmarks.md, round five).
NEEDS = {"grads": "states", "recompute": "allocator"}
EXCLUDES = (frozenset({"in_backward", "states"}),)  # levers that cannot work together (both drive the optimizer)
# On this CPU-only VM, evicted activations left host memory far later than the simulator has them leave (a width-128
# LM with 1024-token context under a 520 MiB budget: tiering predicted to save 92 MiB of the peak saved ~15, and the
# run passed its budget; docs/benchmarks.md): where blocks can be recomputed instead, they are, and tiering is left out.
TIERING_LEFT_OUT = ("the blocks can be recomputed instead, which frees what they save at once, while evicted "
                    "activations were measured to leave host memory far later than simulated on a CPU")
# The predicted peak must stay this far under the budget: measured peaks of planned runs came out up to 2% above
# their predictions, and 1% apart from run to run (docs/benchmarks.md, "Training under a DRAM budget").
HEADROOM = 0.03
# What a memory limit charges beside the predicted peak (anonymous memory): the mapped files a running process cannot
# do without, its libraries' pages in use, which the limit's reclaim leaves it. A planned run killed with 14 MiB left
# under a 1 GiB limit; plain training with 27-33 MiB left under 768 MiB never was (docs/benchmarks.md, round six).
MAPPED_BYTES = 16 << 20
# What a plan that keeps malloc's defaults must leave above its predicted peak as well: that peak moves from process
# to process with where the heap's pieces land (address and hash randomization together; docs/benchmarks.md, round
# fifteen), where freed memory returned peaks within 1% run to run. The widest seen above the median of processes
# measured alone: 11% (train_gpt 1 x 768's updates in backward, 419-481 MiB over 28 processes against 433;
# heldout_lm 6 x 256 x 2 x 1024's plain training, 1020 MiB against the profile's 918, one of four planned runs killed
# under 1 GiB where 5% was allowed; round sixteen).
DEFAULTS_SPREAD = 0.12


@dataclass(frozen=True, slots=True)
class Candidate:
    levers: frozenset[str]
    plan: Plan
    peak_bytes: int
    iteration_s: float
    measured: bool = False  # its peak is the median of processes measured alone, not a simulation's

    @property
    def held_bytes(self) -> int:
        """The most its process may hold: the prediction, and with malloc's defaults their spread above it."""
        return self.peak_bytes if self.plan.allocator is not None else with_spread(self.peak_bytes)

    def fits(self, budget_bytes: int) -> bool:
        """Whether it keeps `budget_bytes`: a measured peak with malloc's spread above it (`measured_fits`), any
        other within the room the predictions' error leaves (`room_of`)."""
        if self.measured:
            return measured_fits(self.peak_bytes, budget_bytes)
        return self.held_bytes <= room_of(budget_bytes)


def applies(profile, gpu, budget_source: str | None) -> bool:
    """Fitting is done without a GPU, under a budget, from a profile that measured plain training's peak."""
    return gpu is None and budget_source is not None and profile.memory is not None


def available(ctx) -> tuple[list[str], dict[str, str]]:
    """The levers this profile and these options allow, and why each other one is not."""
    memory, out, why = ctx.profile.memory, [], {}
    if memory.dram_peak_returned_bytes is None:
        why["allocator"] = "the profile did not measure the peak with freed memory returned (re-profile)"
    else:
        out.append("allocator")
    why_not = in_backward.refused(ctx.profile, ctx.ranks, ctx.options.optimizer_device)
    if why_not:
        why["in_backward"] = why_not
    else:
        out.append("in_backward")
    theirs = ctx.profile.training.optimizer not in ("adam", "adamw")
    if theirs or ctx.device != "host" or ctx.nvme is None:
        why["states"] = ("the script's optimizer is not hetero's to move" if ctx.device != "host" or theirs
                         else "the profile has no NVMe tier")
    else:
        out.append("states")
    if "states" not in out:
        why["grads"] = "the optimizer states cannot move to NVMe, and the gradients go with them"
    elif ctx.ranks > 1:
        why["grads"] = f"{ctx.ranks} ranks all-reduce their gradients in memory"
    elif ctx.profile.training.edits_grads:
        why["grads"] = "the script changes the gradients after backward: they must be in memory then"
    else:
        out.append("grads")
    refused = recompute.refused_text(ctx.profile)
    if refused:
        why["recompute"] = refused
    elif "allocator" not in out:
        why["recompute"] = "recomputed blocks need freed memory returned, " + why["allocator"]
    else:
        out.append("recompute")
    if ctx.slow is None or "layers" in ctx.profile.unmeasured:
        why["tiering"] = "no slower tier to evict saved activations to"
    elif not refused:
        why["tiering"] = TIERING_LEFT_OUT
    else:
        out.append("tiering")
    return out, why


def fit(ctx, solve: Callable[..., Plan], host: str) -> Plan:
    """The plan under `ctx.dram_budget_bytes`: plain training's when it fits, else the fastest combination of levers
    that fits; HeteroError (exit 2) when none does. `solve(levers, blocks=None)`: the plan with `levers`, and with
    `recompute` among them the first `blocks` blocks (all: None)."""
    levers, unusable = available(ctx)
    forced = frozenset({"allocator"}) if ctx.profile.memory.dram_peak_estimated and "allocator" in levers \
        else frozenset()
    forced |= recompute_levers(ctx) if ctx.options.recompute and "recompute" in levers else set()
    seen: dict[frozenset[str], Candidate] = {}
    for k in range(len(levers) + 1):
        for combo in combinations(levers, k):
            chosen = frozenset(combo) | forced
            if any(lever in chosen and NEEDS[lever] not in chosen for lever in NEEDS) or \
                    any(pair <= chosen for pair in EXCLUDES):
                continue
            if chosen not in seen:
                seen[chosen] = _candidate(ctx, chosen, solve(chosen), host)
    for lean in ctx.profile.memory.measured_alone:  # as the profile measured them alone: malloc's defaults
        chosen = frozenset(lean.levers)
        if chosen <= set(levers) and forced <= chosen | {"allocator"} and chosen not in seen:
            found = _candidate(ctx, chosen, solve(chosen), host)
            if found.measured:
                seen[chosen] = found
    budget, room = ctx.dram_budget_bytes, room_bytes(ctx)
    base = seen[forced]
    fitting = [c for c in seen.values() if c.fits(budget)]
    if not fitting:
        least = min(seen.values(), key=lambda c: c.held_bytes)
        raise HeteroError(
            f"below the floor: no plan keeps the budget {SIZE.format_short(budget, 5)} ({ctx.budget_source}, less "
            f"{HEADROOM:.0%} headroom and {SIZE.format_short(MAPPED_BYTES)} for mapped files); the least any plan "
            f"needs is {SIZE.format_short(least.held_bytes, 5)} of "
            f"{host}, with {_names(least.levers) or 'nothing moved'}: {floor_text(least.plan)}"
            + _unusable_text(unusable),
            hint=f"raise --dram-budget to {SIZE.format_short(budget_for(least.held_bytes), 5)} or "
                 "more, or train a smaller model or batch", exit_code=USAGE)
    # Equally fast: one that evicts activations last (the disk's workers take their share of the cores, which the
    # simulator hides behind compute, and evictions left host memory later than simulated: TIERING_LEFT_OUT); then
    # one that keeps malloc's defaults (a leaner plan measured alone: with plain training's own peak not known,
    # `forced`, returning memory is predicted at no cost, but costs page faults); then, where `forced`, the lower peak
    # first; then the fewer levers.
    best = base if base.fits(budget) and not forced else min(
        fitting, key=lambda c: (c.iteration_s, "tiering" in c.levers, c.plan.allocator is not None,
                                c.peak_bytes if forced else 0, len(c.levers), c.peak_bytes))
    best = _fewest_blocks(ctx, solve, best, host, room)
    why = _why(ctx, best, seen, base, len(fitting), forced) + _unusable_text(unusable)
    return replace(best.plan, budget=replace(best.plan.budget, why=why))


def _candidate(ctx, levers: frozenset[str], plan: Plan, host: str) -> Candidate:
    """`plan` as a candidate; measured where its peak is plain training's own or a leaner plan's the profile measured
    alone (the footprint takes that peak: hetero.plan.alone)."""
    measured = (not levers and not ctx.profile.memory.dram_peak_estimated) or \
        alone.measured(ctx.profile, plan) is not None
    return Candidate(levers, plan, plan.predicted.peak_bytes[host], plan.predicted.iteration_s, measured)


def recompute_levers(ctx) -> frozenset[str]:
    """--recompute: every block it can, with freed memory returned (`NEEDS`) where the profile measured its cost."""
    memory = ctx.profile.memory
    returned = memory is not None and memory.dram_peak_returned_bytes is not None
    return frozenset({"recompute", "allocator"} if returned else {"recompute"})


def _fewest_blocks(ctx, solve: Callable[..., Plan], best: Candidate, host: str, room: int) -> Candidate:
    """With recomputation chosen, the fewest blocks that keep the budget: each one more costs its forward."""
    # --recompute: every block it can; with malloc's defaults, every block, as measured
    if "recompute" not in best.levers or ctx.options.recompute or "allocator" not in best.levers:
        return best
    units, _ = recompute.units(ctx.profile)
    plans: dict[int, Plan] = {len(units): best.plan}

    def fits(k: int) -> bool:
        plans.setdefault(k, solve(best.levers, blocks=k))
        return plans[k].predicted.peak_bytes[host] <= room

    k = recompute.fewest(fits, len(units))
    p = plans[k]
    return Candidate(best.levers, p, p.predicted.peak_bytes[host], p.predicted.iteration_s)


def floor_text(plan: Plan) -> str:
    """What the floor is made of, by the plan's account: `plain training, memory returned 700MiB, hetero optimizer
    20MiB, less script's adam states 200MiB`."""
    held = ", ".join(f"{what} {SIZE.format_short(b)}" for what, b in plan.predicted.dram.items())
    saved = ", ".join(f"{what} {SIZE.format_short(b)}" for what, b in plan.predicted.dram_saved.items())
    return held + (f", less {saved}" if saved else "")


def allocator_plan(why: str, from_bytes: int | None = None) -> AllocatorPlan:
    return AllocatorPlan(mmap_threshold_bytes=AllocatorPlan.RETURNING, trim_threshold_bytes=AllocatorPlan.RETURNING,
                         from_bytes=from_bytes, why=why)


def with_spread(peak_bytes: int) -> int:
    """What a process that keeps malloc's defaults and is predicted at `peak_bytes` may hold (`DEFAULTS_SPREAD`)."""
    return int(peak_bytes * (1 + DEFAULTS_SPREAD))


def measured_fits(peak_bytes: int, budget_bytes: int) -> bool:
    """Whether a peak measured alone (the median of fresh processes with malloc's defaults) keeps `budget_bytes`
    with malloc's spread above it (`with_spread`) and the mapped files beside it (`MAPPED_BYTES`): without the
    `HEADROOM` that is kept for a simulation's error, which a measured peak has not."""
    return with_spread(peak_bytes) <= budget_bytes - MAPPED_BYTES


def room_bytes(ctx) -> int:
    """The most the predicted peak may be under the budget."""
    return room_of(ctx.dram_budget_bytes)


def room_of(budget_bytes: int) -> int:
    """The most a predicted peak may be under `budget_bytes`: `HEADROOM` for the predictions' error, `MAPPED_BYTES`
    for the mapped files a memory limit charges too."""
    return int(budget_bytes * (1 - HEADROOM)) - MAPPED_BYTES


def budget_for(peak_bytes: int) -> int:
    """The least budget whose room holds `peak_bytes` (`room_of` reversed, to the MiB above)."""
    return ((int((peak_bytes + MAPPED_BYTES) / (1 - HEADROOM)) >> 20) + 1) << 20


def allocator_cost_s(profile) -> float:
    """What returning freed memory adds to a step, as the profile measured it (0 where it could not compare)."""
    m = profile.memory
    if m is None or m.returned_step_s is None or m.dram_peak_estimated:
        return 0.0
    reference = m.default_step_s if m.default_step_s is not None else profile.training.iteration_s
    return max(0.0, m.returned_step_s - reference)


def _why(ctx, best: Candidate, seen: dict, base: Candidate, fitting: int, forced: frozenset[str]) -> str:
    source = (f"DRAM budget {SIZE.format_short(ctx.dram_budget_bytes)} ({ctx.budget_source}; the prediction keeps "
              f"{HEADROOM:.0%} and {SIZE.format_short(MAPPED_BYTES)} for mapped files under it)")
    if best is base and not best.levers:
        return (f"{source}: plain training's predicted peak {SIZE.format_short(base.peak_bytes)} fits with "
                f"{DEFAULTS_SPREAD:.0%} more for malloc's defaults' spread, nothing moved")
    lean = alone.measured(ctx.profile, best.plan)
    if lean is not None:
        return (f"{source}: {_names(best.levers)}{', every block' if 'recompute' in best.levers else ''}, with "
                f"malloc's defaults, measured alone after the profile: peak {SIZE.format_short(lean.peak_bytes)} "
                f"({SIZE.format_short(best.held_bytes)} with their {DEFAULTS_SPREAD:.0%} spread), "
                f"{short_time(lean.step_s)} per step against "
                f"{short_time(ctx.profile.memory.returned_step_s)} with freed memory returned instead"
                f"{_noise(ctx.profile, lean)}; the fastest of {fitting} combinations that fit (of {len(seen)} "
                "simulated)")
    parts = []
    for lever in (x for x in LEVERS if x in best.levers):
        # a lever's saving is counted without the levers that need it (they have their own line)
        dependents = {x for x, needed in NEEDS.items() if needed == lever}
        with_it, without = seen.get(best.levers - dependents), seen.get(best.levers - {lever} - dependents)
        with_it = best if lever == "recompute" else with_it  # with the fewest blocks, not every block
        if without is None:
            parts.append(f"{_NAMES[lever]} (--recompute)" if lever == "recompute" else
                         f"{_NAMES[lever]} (always: the profile returned freed memory throughout to keep the "
                         "budget, so plain training's own peak is not known)")
            continue
        parts.append(f"{_NAMES[lever]} saves {SIZE.format_short(without.peak_bytes - with_it.peak_bytes)} for "
                     f"{short_time(with_it.iteration_s - without.iteration_s)} per iteration")
    plain = "" if forced else (f"plain training's peak {SIZE.format_short(seen[frozenset()].peak_bytes)} (with "
                               f"{DEFAULTS_SPREAD:.0%} for malloc's defaults' spread) exceeds it; ")
    return (f"{source}: {plain}{'; '.join(parts)}: predicted {SIZE.format_short(best.peak_bytes)} at "
            f"{short_time(best.iteration_s)} per iteration, the fastest of {fitting} combinations that fit "
            f"(of {len(seen)} simulated)")


def _noise(profile, lean) -> str:
    if not alone.taken_as_free(profile, lean):
        return ""
    return " (taken as no slower: it adds no work and faults less, so that is the machine's noise)"


_NAMES = {"allocator": "returning freed memory",
          "in_backward": "updating each parameter in backward (for a script that reads no gradient before step)",
          "states": "optimizer states on NVMe",
          "grads": "gradients on NVMe from backward to step (for a script that zeroes them each step)",
          "tiering": "evicting saved activations",
          "recompute": "recomputing blocks in backward"}


def _names(levers: frozenset[str]) -> str:
    return ", ".join(_NAMES[x] for x in LEVERS if x in levers)


def _unusable_text(unusable: dict[str, str]) -> str:
    return "".join(f"; not {_NAMES[k]}: {v}" for k, v in unusable.items())
