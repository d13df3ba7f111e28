"""`hetero plan`'s measuring step: a plan under a DRAM budget is run in fresh processes of its own before it is
written, and kept only where they show it fits (hetero.plan.policy).

The plan the pure planner chooses (hetero.plan.fit) is written to a private work directory and run
`trial_processes` times as `hetero run` would run it, each process alone, until its peak settles, stopping itself
at the budget. What they measured is a `Trial` the planner takes on its next call. The loop ends once the chosen
plan is one a trial verified, or the planner refuses naming the floor. Trials are recorded in the plan
(`budget.trials`), never in the profile. `python -c CHILD` is a trial process: it dies with `hetero plan`, runs the
script from `hetero profile`'s directory, and writes what it measured as JSON into the work directory.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace

from hetero.errors import FAILURE, HeteroError
from hetero.launch import waiter
from hetero.plan import fit, solve
from hetero.plan.policy import POLICY, MemoryPolicy
from hetero.run import huge_pages, process_memory
from hetero.run.devices import workdir
from hetero.schema import files
from hetero.schema.plan import Plan, Trial
from hetero.schema.profile import Profile
from hetero.schema.tiers import host_tier
from hetero.units import SIZE


@dataclass(frozen=True, slots=True)
class Command:
    """The profiled command a trial runs: `python script args` in `cwd`, its steps counted as the profile did."""

    script: str
    args: list[str]
    cwd: str | None
    warmup: int
    steps_from: str  # `optimizer` steps, or `backward` calls

    @classmethod
    def of(cls, profile: Profile) -> Command | None:
        """The command `profile` measured; None for a profile that did not record its arguments."""
        m = profile.model
        if m.args is None:
            return None
        return cls(m.script, list(m.args), m.cwd, profile.training.warmup_steps, profile.training.steps_from)


def waiter_argv(profile: Profile, options: solve.PlanOptions, plan_args: list[str]) -> list[str] | None:
    """Where `hetero plan` (its arguments `plan_args`) runs under a memory limit and its plan wants a trial: the
    command it replaces itself with (hetero.launch.waiter, in a new work directory holding the trials' state), so
    that the trials run beside a bare interpreter; None where it plans in its own process."""
    if process_memory.memory_limit_bytes() is None or Command.of(profile) is None:
        return None
    chosen = solve.plan(profile, options)
    if not fit.wants_trial(profile, options, chosen, []):
        return None
    work = workdir.create(None, "trial", "TMPDIR")
    if work.lock is not None:  # held across the exec: the waiter keeps its directory from sweeps
        os.set_inheritable(work.lock, True)
    return [sys.executable, "-m", "hetero.launch.waiter", os.path.join(work.path, "state.json"), sys.executable,
            "-m", "hetero", *plan_args]


def end(state: str) -> None:
    """The planner's last call under hetero.launch.waiter is done: its work directory goes."""
    directory = os.path.dirname(state)
    if os.path.basename(directory).startswith("hetero-trial-"):
        shutil.rmtree(directory, ignore_errors=True)


class TrialWanted(Exception):
    """The planner wants a trial run, and wrote what to run into its state file (hetero.launch.waiter runs it)."""


def plan(profile: Profile, options: solve.PlanOptions, say: Callable[[str], None],
         policy: MemoryPolicy | None = None, state: str | None = None) -> Plan:
    """`solve.plan`, each plan it chooses under a binding DRAM budget tried until one a trial verified is chosen
    (or the planner refuses, naming the floor). `policy`: the module's `POLICY` where None. With `state` (a file in
    a work directory of `hetero plan`'s, which hetero.launch.waiter runs trials from): the trials run so far are
    read from it, and where another is wanted it is written there and TrialWanted raised, instead of run here."""
    policy = policy or POLICY
    command = Command.of(profile)
    trials, new = _recorded(state)
    if new:
        say(_said(trials[-1], policy))
    while True:
        chosen = solve.plan(profile, replace(options, trials=tuple(trials), measuring=command is not None))
        if not fit.wants_trial(profile, options, chosen, trials, policy):
            return chosen
        if command is None:
            say("the profile does not record the script's arguments (made by an older hetero): the plan is "
                "predicted, not measured; profile again to have it measured")
            return chosen
        levers = fit.levers_of(profile, chosen)
        say(f"measuring {fit.describe(levers)} in {policy.trial_processes} fresh processes of the script, each "
            f"stopped at the budget (trial {len(trials) + 1} of at most {policy.max_trials}) ...")
        predicted = chosen.predicted.peak_bytes[host_tier(profile.machine.tiers).name]
        if state is not None:
            _request(chosen, levers, predicted, command, policy, os.path.dirname(state), state)
            raise TrialWanted()
        trials.append(measure(chosen, levers, predicted, command, chosen.budget.dram_budget_bytes, policy))
        say(_said(trials[-1], policy))


def measure(chosen: Plan, levers: frozenset[str], predicted_bytes: int, command: Command, budget_bytes: int,
            policy: MemoryPolicy = POLICY) -> Trial:
    """`chosen` (with `levers`, predicted at `predicted_bytes`) run here in `policy.trial_processes` fresh processes,
    each stopped at `budget_bytes` less what this process holds where both share a memory limit."""
    stop = budget_bytes - (process_memory.resident_bytes() if process_memory.memory_limit_bytes() else 0)
    work = workdir.create(None, "trial", "TMPDIR")
    try:
        request = _request(chosen, levers, predicted_bytes, command, policy, work.path)
        return _trial(request, waiter.run_trial(request, stop), stop)
    finally:
        work.remove()


def _request(chosen: Plan, levers: frozenset[str], predicted_bytes: int, command: Command, policy: MemoryPolicy,
             directory: str, state: str | None = None) -> dict:
    """What a trial runs (hetero.launch.waiter.run_trial), its plan file written in `directory`; with `state`,
    written there too, as the trial wanted next."""
    path = os.path.join(directory, "plan.yaml")
    files.save(chosen, path)
    request = {"base": [sys.executable, "-c", CHILD], "tail": [str(command.warmup), command.steps_from,
                                                               command.script, *command.args],
               "plan": path, "out": os.path.join(directory, "trial"), "cwd": command.cwd, "count":
               policy.trial_processes, "env": huge_pages.env(os.environ) if chosen.allocator is not None else {},
               "budget_bytes": chosen.budget.dram_budget_bytes, "levers": sorted(levers),
               "blocks": len(chosen.recompute.blocks) if chosen.recompute else None,
               "mmap_threshold_bytes": chosen.allocator.mmap_threshold_bytes if chosen.allocator else None,
               "predicted_bytes": predicted_bytes}
    if state is not None:
        recorded = _state(state)
        recorded["pending"] = request
        with open(state, "w") as f:
            json.dump(recorded, f)
    return request


def _state(state: str) -> dict:
    if not os.path.exists(state):
        return {"runs": [], "pending": None}
    with open(state) as f:
        return json.load(f)


def _recorded(state: str | None) -> tuple[list[Trial], bool]:
    """The trials run so far from `state` (none without one), and whether the last is the one
    hetero.launch.waiter just ran (recorded now)."""
    if state is None:
        return [], False
    recorded = _state(state)
    pending = recorded.get("pending")
    new = pending is not None and "processes" in pending
    if new:
        recorded["runs"].append(pending)
        recorded["pending"] = None
        with open(state, "w") as f:
            json.dump(recorded, f)
    return [_trial(run, run["processes"], run["stop_bytes"]) for run in recorded["runs"]], new


def _trial(request: dict, results: list[dict | int | None], stop: int) -> Trial:
    """What the trial's processes measured, as the planner takes it; HeteroError where the script failed under
    the plan."""
    failed = [(k, r) for k, r in enumerate(results) if isinstance(r, int)]
    if failed:
        k, code = failed[0]
        with open(f"{request['out']}-{k}.log") as f:
            tail = f.read().strip().splitlines()[-3:]
        raise HeteroError(f"a trial of the plan failed: the script exited with code {code} under it "
                          f"({' / '.join(tail) or 'no output'})", exit_code=FAILURE,
                          hint="run the plan with hetero run to see why, or plan without --dram-budget")
    done = [r for r in results if r is not None]
    steps, system = [r["step_s"] for r in done], [r["system_s"] for r in done]
    return Trial(levers=request["levers"], blocks=request["blocks"], predicted_bytes=request["predicted_bytes"],
                 peaks_bytes=[r["peak_bytes"] for r in done], stopped=len(results) - len(done), stop_bytes=stop,
                 mapped_bytes=max((r["beside_bytes"] for r in done), default=0),
                 step_s=round(statistics.median(steps), 9) if steps else None,
                 step_range_s=round(max(steps) - min(steps), 9) if steps else 0.0,
                 mmap_threshold_bytes=request["mmap_threshold_bytes"],
                 system_s=round(statistics.median(system), 9) if system else None)


def _said(trial: Trial, policy: MemoryPolicy) -> str:
    if trial.stopped:
        return f"  {trial.stopped} of {policy.trial_processes} processes reached the budget"
    peaks = ", ".join(SIZE.format_short(b) for b in trial.peaks_bytes)
    return (f"  peaks {peaks}, {SIZE.format_short(trial.mapped_bytes)} of file pages and page tables beside them: "
            f"{SIZE.format_short(policy.held_bytes(trial))} held at most; {trial.step_s:.3g}s a step")


# A trial process dies with its parent (the pid, its first argument), loads what `hetero run` has loaded when its
# script starts (the CLI, the runtime), so that its peak counts them too, and runs `child`.
CHILD = ("import sys, hetero.interrupts; hetero.interrupts.die_with_parent(int(sys.argv.pop(1))); "
         "import importlib.util, hetero.cli.main, hetero.run.runtime; "
         "importlib.util.find_spec('typer._adapters') and __import__('typer._adapters'); "
         "from hetero.launch import trials; sys.exit(trials.child(sys.argv[1:]))")


def child(argv: list[str], policy: MemoryPolicy = POLICY) -> int:
    """A trial process: `OUT PLAN STOP WARMUP STEPS_FROM SCRIPT [ARGS]`."""
    out, plan_path, stop, warmup, steps_from, script, args = \
        argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5], argv[6:]
    threading.Thread(target=_stop_at, args=(stop, policy.poll_s), name="hetero-stop-at", daemon=True).start()
    from hetero.run.runtime import Runtime

    steps = Steps(warmup, policy)
    with steps.counting(steps_from), Runtime(files.load(plan_path, expect=Plan), script=script):
        from hetero.harness.script import run_script

        result = run_script(script, args)
    if len(steps.ends) < warmup + policy.timed_steps or not (result.stopped or result.exit_code == 0):
        return result.exit_code or 1
    with open(out, "w") as f:
        json.dump({"peak_bytes": process_memory.dram_peak_bytes(), "beside_bytes": steps.beside_bytes,
                   "step_s": steps.step_s(policy.timed_steps), "system_s": steps.system_s(policy.timed_steps),
                   "steps": len(steps.ends)}, f)
    return 0


class Steps:
    """The script's steps in a trial process: after the warm-up, the file pages each step used, counted from its
    start to its end (not what follows the last step), the least of the steps kept: a page another process touches
    counts as referenced in every process mapping it. It stops once its peak has settled (`settled`)."""

    def __init__(self, warmup: int, policy: MemoryPolicy):
        self.warmup, self.policy = warmup, policy
        self.ends: list[float] = []
        self.reading_s: list[float] = []  # per step: the time its end spent reading the file pages used
        self.peaks: list[int] = []
        self.system: list[float] = []  # the process's time in the kernel at each step's end ...
        self.reading_system_s: list[float] = []  # ... and what reading the file pages used added to it
        self.first: list = []  # the first optimizer to step: its steps are the script's
        self.besides: list[int] = []  # the file pages and page tables of each step after the warm-up

    def counting(self, steps_from: str):
        from contextlib import contextmanager

        from torch.optim.optimizer import register_optimizer_step_post_hook

        from hetero.harness import watch

        @contextmanager
        def hooked():
            handle = register_optimizer_step_post_hook(self.ended) if steps_from == "optimizer" else \
                watch.backward_calls(self.ended)
            try:
                yield
            finally:
                handle.remove()
        return hooked()

    def ended(self, optimizer=None, *_) -> None:
        from hetero.harness.script import StopScript

        if optimizer is not None and self.first[:1] != [optimizer]:
            if self.first:
                return
            self.first.append(optimizer)
        self.ends.append(time.perf_counter())
        self.system.append(os.times().system)
        self.peaks.append(process_memory.dram_peak_bytes())
        if len(self.ends) > self.warmup:
            self.besides.append(process_memory.charged_beside_bytes())
        if len(self.ends) >= self.warmup:
            process_memory.clear_referenced()
        self.reading_s.append(time.perf_counter() - self.ends[-1])
        self.reading_system_s.append(os.times().system - self.system[-1])
        if settled(self.peaks, self.warmup + self.policy.timed_steps, self.policy):
            raise StopScript()

    @property
    def beside_bytes(self) -> int:
        return min(self.besides, default=0)

    def step_s(self, timed_steps: int) -> float:
        """The mean of the last `timed_steps` steps, less the time their starts spent in `ended`."""
        ends, reading = self.ends[-timed_steps - 1:], self.reading_s[-timed_steps - 1:-1]
        return (ends[-1] - ends[0] - sum(reading)) / timed_steps

    def system_s(self, timed_steps: int) -> float:
        """The mean time in the kernel of the last `timed_steps` steps, less what their starts spent in `ended`."""
        system, reading = self.system[-timed_steps - 1:], self.reading_system_s[-timed_steps - 1:-1]
        return (system[-1] - system[0] - sum(reading)) / timed_steps


def settled(peaks: list[int], least_steps: int, policy: MemoryPolicy = POLICY) -> bool:
    """Whether a trial process whose peak after each step so far is `peaks` may stop: `least_steps` done, and the
    last `settle_steps` of them raised it by less than `settle_bytes`; or `max_steps` done."""
    if len(peaks) >= max(policy.max_steps, least_steps):
        return True
    n = policy.settle_steps
    return len(peaks) >= least_steps and len(peaks) > n and peaks[-1] - peaks[-1 - n] < policy.settle_bytes


def _stop_at(limit: int, poll_s: float) -> None:
    """End this process (exit `STOPPED`) once it holds `limit` bytes, mid-step. It offers itself to a memory limit's
    killer before `hetero plan`'s processes; a kill counts as a stop (hetero.launch.waiter)."""
    with suppress(OSError):
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    while process_memory.resident_bytes() < limit:
        time.sleep(poll_s)
    os._exit(waiter.STOPPED)
