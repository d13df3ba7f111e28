"""Keeping a DRAM budget without a GPU: the plan's predicted whole-process peak (hetero.plan.footprint) must not
exceed it. Where plain training's does, every allowed combination of levers is simulated as a whole plan, and the
fastest that fits is kept:

- `allocator`: glibc returns freed memory (the plan's `allocator`); its cost is the profile's measured page faults;
- `in_backward`: the script's Adam(W) updates each parameter as soon as backward makes its gradient final, and frees
  the gradient (`update_in_backward`): at no cost in time, for one backward per step, no clipping, one process;
- `states`: every Adam state (and its fp32 master copy) on NVMe, staged through host memory inside `step()`;
- `grads`: with `states`, each gradient joins its states on NVMe once final, and `step()` reads it back with them
  (MemFerry's "a gradient leaves when it is final"); one process only;
- `tiering`: saved activations evicted to the slow tier after each layer's forward;
- `recompute`: recomputable blocks keep only their inputs and backward reruns their forward
  (hetero.plan.recompute), with freed memory returned (`NEEDS`); the fewest blocks that keep the budget.

`hetero plan` runs the chosen candidate in fresh processes (a trial, hetero.launch.trials) and plans again with
what they measured (`PlanOptions.trials`): a tried candidate counts at its measured peak, with the margins of
hetero.plan.policy, and at its measured step; a verified plan that returns freed memory is tried at malloc's next
threshold (`_next_rung`) and kept where faster. After `MemoryPolicy.max_trials` trials only tried candidates are
chosen. Where none fits, the planner refuses, naming the floor: the least any candidate needs, measured where tried.
The budget is `--dram-budget`, else the profile's memory cgroup's. Pure: `solve` builds and simulates each candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import combinations

from hetero.errors import USAGE, HeteroError
from hetero.plan import in_backward, recompute
from hetero.plan.policy import POLICY
from hetero.schema.plan import AllocatorPlan, Plan, Trial
from hetero.units import SIZE, short_time

LEVERS = ("allocator", "in_backward", "states", "grads", "tiering", "recompute")  # in the order of their lines
# A lever that works only with another: recomputed blocks with malloc's defaults leave what their rebuilds free in
# the heap, so the peak barely falls unless freed memory is returned.
NEEDS = {"grads": "states", "recompute": "allocator"}
EXCLUDES = (frozenset({"in_backward", "states"}),)  # levers that cannot work together (both drive the optimizer)
TRIED = "measured by the trial, beyond the parts"  # the host-memory account's entry for a trial's margins
TIERING_LEFT_OUT = ("the blocks can be recomputed instead, which frees what they save at once, while evicted "
                    "activations were measured to leave host memory far later than simulated on a CPU")
@dataclass(frozen=True, slots=True)
class Candidate:
    levers: frozenset[str]
    plan: Plan
    predicted_bytes: int
    iteration_s: float  # predicted, or measured by its trial
    trial: Trial | None = None  # what `hetero plan` measured of it, if it was tried
    margin_bytes: int = 0  # untried: what trials of plans with the same malloc settings measured above prediction

    @property
    def held_bytes(self) -> int:
        """The most its process is taken to hold: measured with the trial's margins, else as predicted with what
        trials measured beyond their predictions."""
        return POLICY.held_bytes(self.trial) if self.trial is not None else self.predicted_bytes + self.margin_bytes

    def fits(self, budget_bytes: int) -> bool:
        """Whether it keeps `budget_bytes`: as its trial verified, or, untried, as predicted with the margin."""
        if self.trial is not None:
            return POLICY.fits(self.trial, budget_bytes)
        return self.held_bytes <= budget_bytes


def margins(trials: list[Trial]) -> dict[bool, int]:
    """The most trials measured above their plans' predictions (margins included), by whether the plan returns
    freed memory; without such a trial, the most file pages any trial used beside its peak. A trial at a rung the
    profile did not measure (`at_rung`) counts for none."""
    beside = max((t.mapped_bytes for t in trials), default=0)
    predicted = [t for t in trials if t.mmap_threshold_bytes in (None, AllocatorPlan.RETURNING)]
    out = {}
    for returning in (False, True):
        errors = [POLICY.held_bytes(t) - t.predicted_bytes for t in predicted if ("allocator" in t.levers) == returning]
        out[returning] = max(errors, default=beside)
    return out


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
    """The plan under `ctx.dram_budget_bytes`: the fastest candidate that fits, counted as its trial measured it where
    `hetero plan` tried it (`ctx.options.trials`), else as predicted; HeteroError (exit 2) naming the floor when none
    does. `solve(levers, blocks=None)`: the plan with `levers`, and with `recompute` among them the first `blocks`
    blocks (all: None)."""
    levers, unusable = available(ctx)
    forced = recompute_levers(ctx) if ctx.options.recompute and "recompute" in levers else frozenset()
    trials = list(ctx.options.trials)
    seen: dict[frozenset[str], Candidate] = {}
    for k in range(len(levers) + 1):
        for combo in combinations(levers, k):
            chosen = frozenset(combo) | forced
            if any(lever in chosen and NEEDS[lever] not in chosen for lever in NEEDS) or \
                    any(pair <= chosen for pair in EXCLUDES) or chosen in seen:
                continue
            seen[chosen] = _candidate(chosen, solve(chosen), host, trials)
    # a trial of fewer recomputed blocks than all (`_fewest_blocks` chose them), or of malloc's thresholds a rung
    # higher (`_next_rung`), is a candidate of its own
    other = [_candidate(levers, at_rung(solve(levers, blocks=t.blocks), t.mmap_threshold_bytes), host, trials)
             for t in trials if (levers := frozenset(t.levers)) in seen and not _same(t, levers, seen[levers].plan)]
    budget, every = ctx.dram_budget_bytes, [*seen.values(), *other]
    pool = [c for c in every if c.trial is not None or len(trials) < POLICY.max_trials]
    fitting = [c for c in pool if c.fits(budget)]
    if not fitting:
        untried = [c for c in pool if c.trial is None]
        if not (ctx.options.measuring and untried):
            raise _floor(ctx, every, host, unusable)
        # `hetero plan` measures before it writes: the least predicted is tried, rather than the floor predicted
        least = min(untried, key=lambda c: c.held_bytes)
        why = f"{_why(ctx, least, seen, 0)}; predicted over the budget, tried before written" + _unusable_text(unusable)
        return replace(least.plan, budget=replace(least.plan.budget, why=why, trials=trials))
    # the script as it is wherever it fits (DESIGN: a mechanism only where the budget needs it); else the fastest,
    # and of equally fast ones, one that evicts activations last (the disk's workers take their share of the cores,
    # which the simulator hides behind compute: TIERING_LEFT_OUT), then one that keeps malloc's defaults
    base = seen[forced]
    best = base if base in fitting else min(fitting, key=lambda c: (
        c.iteration_s, "tiering" in c.levers, c.plan.allocator is not None, len(c.levers), c.held_bytes))
    best = _fewest_blocks(ctx, solve, best, host, trials)
    why = _why(ctx, best, seen, len(fitting)) + _unusable_text(unusable)
    if (higher := _next_rung(ctx, solve, best, host, trials)) is not None:
        why = (f"{why}; its trial's processes spent {short_time(best.trial.system_s)} of a step in the kernel (page "
               "faults, mostly): malloc's thresholds a rung higher, tried before written, kept where faster")
        return replace(higher.plan, budget=replace(higher.plan.budget, why=why, trials=trials))
    return _as_tried(replace(best.plan, budget=replace(best.plan.budget, why=why, trials=trials)), best, host)


def _candidate(levers: frozenset[str], plan: Plan, host: str, trials: list[Trial]) -> Candidate:
    """`plan` as a candidate, with the trial that measured it, if any, else the margin trials so far showed."""
    trial = next((t for t in trials if _same(t, levers, plan)), None)
    iteration = trial.step_s if trial is not None and trial.step_s is not None else plan.predicted.iteration_s
    margin = margins(trials)[plan.allocator is not None] if trial is None else 0
    return Candidate(levers, plan, plan.predicted.peak_bytes[host], iteration, trial, margin)


def _same(trial: Trial, levers: frozenset[str], plan: Plan) -> bool:
    """Whether `trial` measured `plan`: the same levers, as many recomputed blocks, malloc's same thresholds."""
    blocks = len(plan.recompute.blocks) if plan.recompute is not None else None
    threshold = plan.allocator.mmap_threshold_bytes if plan.allocator is not None else None
    return frozenset(trial.levers) == levers and trial.blocks == blocks and trial.mmap_threshold_bytes == threshold


def at_rung(plan: Plan, threshold: int | None) -> Plan:
    """`plan` with its allocator's thresholds at `threshold` (`AllocatorPlan.RUNGS`), as a trial ran it; unchanged
    without an allocator or at the first rung (the one the profile measured)."""
    a = plan.allocator
    if a is None or threshold is None or threshold == a.mmap_threshold_bytes:
        return plan
    why = (f"{a.why}; at {SIZE.format_short(threshold)} thresholds, a rung above the one the profile measured: fewer "
           "page faults for more memory kept, as a trial measured")
    return replace(plan, allocator=replace(a, mmap_threshold_bytes=threshold, trim_threshold_bytes=threshold,
                                           why=why))


def _next_rung(ctx, solve: Callable[..., Plan], best: Candidate, host: str, trials: list[Trial]) -> Candidate | None:
    """Where `best` returns freed memory and its trial spent time in the kernel (page faults, mostly): the same
    levers, every block they can recompute, at malloc's next rung, untried (`hetero plan` tries it); else None. A
    rung saves at most that kernel time: where its blocks recomputed beyond `best`'s cost as much (predicted), it
    cannot be faster and is not tried."""
    a, t = best.plan.allocator, best.trial
    if a is None or t is None or not t.system_s or \
            not ctx.options.measuring or len(trials) >= POLICY.max_trials:
        return None
    higher = [rung for rung in AllocatorPlan.RUNGS if rung > a.mmap_threshold_bytes]
    if not higher:
        return None
    candidate = _candidate(best.levers, at_rung(solve(best.levers), higher[0]), host, trials)
    recomputing = candidate.plan.predicted.iteration_s - best.plan.predicted.iteration_s
    return candidate if candidate.trial is None and recomputing < t.system_s else None


def recompute_levers(ctx) -> frozenset[str]:
    """--recompute: every block it can, with freed memory returned (`NEEDS`) where the profile measured its cost."""
    memory = ctx.profile.memory
    returned = memory is not None and memory.dram_peak_returned_bytes is not None
    return frozenset({"recompute", "allocator"} if returned else {"recompute"})


def _fewest_blocks(ctx, solve: Callable[..., Plan], best: Candidate, host: str, trials: list[Trial]) -> Candidate:
    """With recomputation chosen and not yet tried, the fewest blocks taken to keep the budget (each one more costs
    its forward): as tried where a trial measured that many, else as predicted with the trials' margin."""
    if best.trial is not None or "recompute" not in best.levers or ctx.options.recompute:
        return best
    units, _ = recompute.units(ctx.profile)
    candidates: dict[int, Candidate] = {len(units): best}

    def fits(k: int) -> bool:
        if k not in candidates:
            candidates[k] = _candidate(best.levers, solve(best.levers, blocks=k), host, trials)
        return candidates[k].fits(ctx.dram_budget_bytes)

    return candidates[recompute.fewest(fits, len(units))]


def _as_tried(plan: Plan, best: Candidate, host: str) -> Plan:
    """A plan a trial verified predicts what the trial measured: its step, and the most its process is taken to
    hold (the difference from the account's parts is an entry of its own)."""
    if best.trial is None:
        return plan
    held, p = best.held_bytes, plan.predicted
    beyond = held - sum(p.dram.values()) + sum(p.dram_saved.values())
    dram, saved = dict(p.dram), dict(p.dram_saved)
    (dram if beyond >= 0 else saved)[TRIED] = abs(beyond)
    iteration = best.trial.step_s if best.trial.step_s is not None else p.iteration_s
    return replace(plan, predicted=replace(p, iteration_s=iteration, peak_bytes=p.peak_bytes | {host: held},
                                           dram=dram, dram_saved=saved))


def wants_trial(profile, options, plan: Plan, trials: list[Trial], policy=POLICY) -> bool:
    """Whether `hetero plan` runs `plan` in fresh processes before writing it: it was chosen without a GPU to keep a
    DRAM budget that binds (given with --dram-budget, or one the profile had to keep: `dram_peak_estimated`), no
    trial measured it yet, and fewer than `max_trials` ran."""
    binds = profile.machine.gpu is None and plan.budget.dram_budget_bytes is not None and \
        (options.dram_budget_bytes is not None or (profile.memory is not None and profile.memory.dram_peak_estimated))
    tried = any(_same(t, levers_of(profile, plan), plan) for t in trials)
    return binds and not tried and len(trials) < policy.max_trials


def levers_of(profile, plan: Plan) -> frozenset[str]:
    """The fit's levers `plan` turns on (`LEVERS`)."""
    opt, out = plan.optimizer, set()
    if plan.allocator is not None:
        out.add("allocator")
    if plan.update_in_backward is not None:
        out.add("in_backward")
    if opt is not None and opt.nvme is not None and opt.states and all(s.tier == "nvme" for s in opt.states):
        out.add("states")
        if opt.nvme.grads:
            out.add("grads")
    if plan.activations is not None:
        out.add("tiering")
    if plan.recompute is not None:
        out.add("recompute")
    return frozenset(out)


def describe(levers: frozenset[str]) -> str:
    """A candidate in words: `plain training`, or its levers' names."""
    return _names(levers) or "plain training"


def _floor(ctx, candidates: list[Candidate], host: str, unusable: dict[str, str]) -> HeteroError:
    """The refusal below the floor: the least any candidate needs (measured where it was tried)."""
    # a trial that stopped at the budget only bounds its need from below: the floor is a need measured or predicted
    least = min(candidates, key=lambda c: (c.trial is not None and c.trial.stopped > 0, c.held_bytes))
    budget, trial = ctx.dram_budget_bytes, least.trial
    how = "predicted" if trial is None else "measured in fresh processes" if not trial.stopped else \
        f"more: {trial.stopped} of its trial's processes reached it"
    return HeteroError(
        f"below the floor: no plan keeps the budget {SIZE.format_short(budget, 5)} ({ctx.budget_source}); the least "
        f"any plan needs is {SIZE.format_short(least.held_bytes, 5)} of {host} ({how}), with "
        f"{_names(least.levers) or 'nothing moved'}: {floor_text(least.plan)}" + _unusable_text(unusable),
        hint=f"raise --dram-budget to {SIZE.format_short(budget_for(least.held_bytes), 5)} or more, or train a "
             "smaller model or batch", exit_code=USAGE)


def floor_text(plan: Plan) -> str:
    """What the floor is made of, by the plan's account: `plain training, memory returned 700MiB, hetero optimizer
    20MiB, less script's adam states 200MiB`."""
    held = ", ".join(f"{what} {SIZE.format_short(b)}" for what, b in plan.predicted.dram.items())
    saved = ", ".join(f"{what} {SIZE.format_short(b)}" for what, b in plan.predicted.dram_saved.items())
    return held + (f", less {saved}" if saved else "")


def allocator_plan(why: str, from_bytes: int | None = None) -> AllocatorPlan:
    return AllocatorPlan(mmap_threshold_bytes=AllocatorPlan.RETURNING, trim_threshold_bytes=AllocatorPlan.RETURNING,
                         from_bytes=from_bytes, why=why)


def budget_for(peak_bytes: int) -> int:
    """The least budget that holds `peak_bytes`, to the MiB above."""
    return ((peak_bytes >> 20) + 1) << 20


def allocator_cost_s(profile) -> float:
    """What returning freed memory adds to a step, as the profile measured it (0 where it could not compare)."""
    m = profile.memory
    if m is None or m.returned_step_s is None or m.dram_peak_estimated:
        return 0.0
    reference = m.default_step_s if m.default_step_s is not None else profile.training.iteration_s
    return max(0.0, m.returned_step_s - reference)


def _why(ctx, best: Candidate, seen: dict, fitting: int) -> str:
    source = f"DRAM budget {SIZE.format_short(ctx.dram_budget_bytes)} ({ctx.budget_source})"
    tried = ""
    if best.trial is not None:
        t = best.trial
        tried = (f"; measured in {len(t.peaks_bytes)} fresh processes: peaks {SIZE.format_short(min(t.peaks_bytes))}"
                 f" to {SIZE.format_short(max(t.peaks_bytes))}, {SIZE.format_short(t.mapped_bytes)} of file pages "
                 f"and page tables beside them, {short_time(best.iteration_s)} per step")
    if not best.levers:
        return (f"{source}: plain training, predicted at {SIZE.format_short(best.predicted_bytes)}, fits"
                f"{tried or ' (predicted: not measured)'}")
    parts = []
    for lever in (x for x in LEVERS if x in best.levers):
        # a lever's saving is counted without the levers that need it (they have their own line)
        dependents = {x for x, needed in NEEDS.items() if needed == lever}
        with_it, without = seen.get(best.levers - dependents), seen.get(best.levers - {lever} - dependents)
        with_it = best if lever == "recompute" else with_it  # with the fewest blocks, not every block
        if without is None or with_it is None:
            parts.append(f"{LEVER_NAMES[lever]} (--recompute)" if lever == "recompute" else LEVER_NAMES[lever])
            continue
        saved = SIZE.format_short(without.predicted_bytes - with_it.predicted_bytes)
        cost = short_time(with_it.plan.predicted.iteration_s - without.plan.predicted.iteration_s)
        parts.append(f"{LEVER_NAMES[lever]} saves {saved} for {cost} per iteration (predicted)")
    return (f"{source}: {'; '.join(parts)}: predicted {SIZE.format_short(best.predicted_bytes)} at "
            f"{short_time(best.plan.predicted.iteration_s)} per iteration, the fastest of {fitting} candidates that "
            f"fit (of {len(seen)} simulated){tried}")


LEVER_NAMES = {"allocator": "returning freed memory",  # what the plan's why calls each lever
          "in_backward": "updating each parameter in backward (for a script that reads no gradient before step)",
          "states": "optimizer states on NVMe",
          "grads": "gradients on NVMe from backward to step (for a script that zeroes them each step)",
          "tiering": "evicting saved activations",
          "recompute": "recomputing blocks in backward"}


def _names(levers: frozenset[str]) -> str:
    return ", ".join(LEVER_NAMES[x] for x in LEVERS if x in levers)


def _unusable_text(unusable: dict[str, str]) -> str:
    return "".join(f"; not {LEVER_NAMES[k]}: {v}" for k, v in unusable.items())
