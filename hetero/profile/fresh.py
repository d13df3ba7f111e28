"""The script in a fresh process of its own, trained plainly until its peak settles (hetero.profile.returned's child),
started from a process that stays small: this module imports no torch, so that `hetero profile` under a memory
limit can run it alone beside the limit's waiter (hetero.cli.profile, `measure_alone`), where the profile's own
process, torch loaded (150 MiB here before any tensor), would not leave room for plain training.

`stop_at` bounds the fresh process: a thread in it reads its resident memory every `POLL_S` and ends it (exit
`STOPPED`) once it holds that much, before a memory limit above would kill it (the limit's killer would pick the
largest process of the cgroup, and a user's cgroup records each kill).

Where plain training alone leaves no room for malloc's spread, `leaner_alone` runs the leaner plans the same way
(hetero.plan.alone), each under `hetero run`'s runtime, until one fits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetero.run import huge_pages
from hetero.run.devices import workdir

if TYPE_CHECKING:  # the schema is imported once the processes alone are done: this process stays small meanwhile
    from hetero.schema.profile import Memory

STOPPED = 3  # the fresh process's exit code when it reached `stop_at`
# Processes alone, at most: malloc's defaults peak differently from one process to the next (train_gpt 3 x 768,
# 680-735 MiB), and one run alone put the same script on either side of a 729 MiB room in two profiles
# (docs/benchmarks.md, round six); two that agree end it, a third decides where they do not.
RUNS = 3
POLL_S = 0.002  # filling fresh pages adds ~25 MiB in 5 ms on the 2-core VM (hetero.run.allocator): ~10 in this
# How far past `stop_at` the process may get before the thread sees it: what one poll can add, with room to spare.
OVERSHOOT_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Run:
    """One fresh process's plain training, settled."""

    peak_bytes: int  # as a memory limit charges it (hetero.run.process_memory)
    step_s: float  # the mean of its last timed steps
    steps: int  # steps it took to settle (or the script's, where it ended first)


def run(script: str, args: list[str], steps: int, malloc: str, steps_from: str, stop_at: int | None = None,
        plan: str | None = None) -> Run | None:
    """Train `script` in a fresh process for at least `steps` optimizer steps (or backward calls: `steps_from`),
    malloc's defaults or freed memory returned (`malloc`: default | returned, with huge pages as `hetero run` asks
    for them: hetero.run.huge_pages), until its peak settles: plainly, or
    under the plan file `plan` (as `hetero run` would); None where it could not (it failed, ended first, or reached
    `stop_at` resident bytes)."""
    work = workdir.create(None, "returned", "TMPDIR")
    try:
        out = os.path.join(work.path, "returned.json")
        done = subprocess.run([sys.executable, "-c", CHILD, str(os.getpid()), out, str(steps), malloc, steps_from,
                               str(stop_at or 0), plan or "-", script, *args], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                              env=os.environ | huge_pages.env(os.environ) if malloc == "returned" else None)
        if done.returncode != 0 or not os.path.exists(out):
            return None
        with open(out) as f:
            data = json.load(f)
    finally:
        work.remove()
    return Run(peak_bytes=data["peak_bytes"], step_s=data["step_s"], steps=data["steps"])


# The fresh process first asks to die with its parent (it gets SIGTERM, whose default action ends it, when the
# parent ends, or at once if the parent, whose pid is its first argument, is gone already); then it loads what
# `hetero run` has loaded when its script starts (the CLI, the runtime, the adapters Typer loads when it parses a
# command's arguments), so that its peak counts them as a planned run's does (~20 MiB here), and runs
# hetero.profile.returned as its main module.
CHILD = ("import sys, hetero.interrupts; hetero.interrupts.die_with_parent(int(sys.argv.pop(1))); "
         "import runpy, importlib.util, hetero.cli.main, hetero.run.runtime; sys.argv[0] = 'returned'; "
         "importlib.util.find_spec('typer._adapters') and __import__('typer._adapters'); "
         "runpy.run_module('hetero.profile.returned', run_name='__main__', alter_sys=True)")


def stop_at(room_bytes: int, limit_bytes: int) -> int:
    """Where plain training measured alone under a memory limit stops: at the budget's room (a peak above it is not
    planned as plain training anyway), and below the limit by what this process and the limit's waiter beside it
    hold (two bare interpreters) and one poll's overshoot."""
    from hetero.run import process_memory  # no torch

    return min(room_bytes, limit_bytes - 2 * process_memory.resident_bytes() - OVERSHOOT_BYTES)


def runs_alone(script: str, args: list[str], steps: int, steps_from: str, stop: int, plan: str | None = None
               ) -> list[Run | None]:
    """Up to `RUNS` fresh processes of plain training (under the plan file `plan`, if given) with malloc's defaults,
    each stopped at `stop`; fewer where a majority agrees already (settled below `stop`, their median the mean of
    two; or gave no peak)."""
    out: list[Run | None] = []
    while len(out) < RUNS and max(sum(r is None for r in out), sum(r is not None for r in out)) <= RUNS // 2:
        out.append(run(script, args, steps, "default", steps_from, stop, plan))
    return out


@dataclass(frozen=True, slots=True)
class Tried:
    """One leaner plan (hetero.plan.alone), its processes alone with malloc's defaults."""

    levers: frozenset[str]
    runs: list[Run | None]


@dataclass(frozen=True, slots=True)
class Leaner:
    """The leaner plans run alone, in order, and one process of plain training with freed memory returned, the plan
    they compete with, whose step they are compared with (where plain training with it did not settle below the
    stop: the script's updates in backward with it, which cost no time: `reference`)."""

    tried: list[Tried]
    returned: Run
    stop: int
    reference: str = "plain training"  # what `returned` trained, with freed memory returned


def leaner_alone(output: str, script: str, args: list[str], steps: int, steps_from: str, budget: int,
                 limit: int) -> Leaner | None:
    """Where plain training cannot be planned (no peak settled below the room, or too near it for malloc's spread:
    `fits`): the leaner plans the profile (`output`) allows (hetero.plan.alone.to_measure), each alone as plain
    training ran, until one fits, after one process of plain training with freed memory returned (or, where that
    passed the stop, of the script's updates in backward with it); None where the script allows none or no such
    process gave a step."""
    from hetero.plan import alone
    from hetero.plan.fit import room_of
    from hetero.plan.solve import measured_alone
    from hetero.schema import files
    from hetero.schema.profile import Profile

    profile = files.load(output, expect=Profile)
    wanted = alone.to_measure(profile)
    if not wanted:
        return None
    stop = stop_at(room_of(budget), limit)  # this process has grown by the planner's modules
    work = workdir.create(None, "returned", "TMPDIR")  # swept as the fresh processes' are
    try:
        reference, returned = "plain training", run(script, args, steps, "returned", steps_from, stop)
        if returned is None and alone.UPDATES in wanted:  # plain training with memory returned did not fit either
            path = os.path.join(work.path, "reference.yaml")
            files.save(measured_alone(profile, output, alone.UPDATES), path)
            reference = alone.named(alone.UPDATES)
            returned = run(script, args, steps, "returned", steps_from, stop, path)
        if returned is None:
            return None
        tried: list[Tried] = []
        for levers in wanted:
            print(f"measuring {alone.named(levers)} alone, with malloc's defaults ...", file=sys.stderr,
                  flush=True)  # a few processes of the script each: minutes on a large one
            path = os.path.join(work.path, f"plan-{len(tried)}.yaml")
            files.save(measured_alone(profile, output, levers), path)
            tried.append(Tried(levers, runs_alone(script, args, steps, steps_from, stop, path)))
            if fits(median(tried[-1].runs), budget):
                break
        return Leaner(tried=tried, returned=returned, stop=stop, reference=reference)
    finally:
        work.remove()


def median(runs: list[Run | None]) -> Run | None:
    """The median run, one that gave no peak counting above every other (None where it is such a run); of an even
    number, the mean of the middle two (None where either is such a run): malloc's defaults put the same script's
    peak anywhere in a spread of 8-15% from process to process (train_gpt 6 x 256 after 12 steps: 1307-1410 MiB),
    and the prediction is that spread's middle; the fit adds the spread above it (hetero.plan.fit.DEFAULTS_SPREAD)."""
    ordered = sorted(runs, key=lambda r: r.peak_bytes if r is not None else float("inf"))
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    low, high = (ordered[middle - 1], ordered[middle]) if ordered else (None, None)
    if low is None or high is None:
        return None
    return Run(peak_bytes=(low.peak_bytes + high.peak_bytes) // 2, step_s=(low.step_s + high.step_s) / 2,
               steps=max(low.steps, high.steps))


def fits(run: Run | None, budget: int) -> bool:
    """Whether plain training that peaked as `run` did (None: past the room) can be planned as it is under `budget`:
    with malloc's defaults' spread above it (hetero.plan.fit.measured_fits, the rule the planner keeps)."""
    from hetero.plan.fit import measured_fits

    return run is not None and measured_fits(run.peak_bytes, budget)


def alone(memory: Memory, runs: list[Run | None], stop: int, leaner: Leaner | None = None) -> Memory:
    """The profile's `memory` once plain training ran alone: its own peak, the median of `runs`, where that settled
    below `stop`, else (or where it was not run: no `runs`) the estimate as it was, and what the `leaner` plans
    measured; each said in `profiled_under`."""
    from dataclasses import replace

    from hetero.units import SIZE, measured

    middle = median(runs)
    if not runs:
        memory = replace(memory, profiled_under=f"{memory.profiled_under}; plain training not run alone: its estimate "
                                                "with malloc's defaults' spread fills the room under the budget")
    elif middle is None:
        memory = replace(memory, profiled_under=f"{memory.profiled_under}; plain training with malloc's defaults, "
                                                f"run alone after the profile, gave no peak settled below "
                                                f"{SIZE.format_short(stop)} in {sum(r is None for r in runs)} of "
                                                f"{len(runs)} processes (it passed it, or ended first): its peak "
                                                "stays estimated")
    else:
        memory = replace(memory, dram_peak_bytes=middle.peak_bytes,
                         dram_peak_runs_bytes=[r.peak_bytes for r in runs if r is not None], dram_peak_estimated=False,
                         default_step_s=measured(middle.step_s),
                         profiled_under=f"{memory.profiled_under}; plain training's own peak then measured alone, "
                                        f"the median of {len(runs)} fresh processes with malloc's defaults")
    if leaner is None:
        return memory
    from hetero.schema.profile import MeasuredAlone

    found = [(t, median(t.runs)) for t in leaner.tried]
    records = [MeasuredAlone(levers=sorted(t.levers), peak_bytes=m.peak_bytes, step_s=measured(m.step_s))
               for t, m in found if m is not None]
    return replace(memory, measured_alone=records, returned_step_s=measured(leaner.returned.step_s),
                   profiled_under=f"{memory.profiled_under}; leaner plans with malloc's defaults then measured alone "
                                  f"the same way: {'; '.join(_said(t, m, leaner) for t, m in found)}")


def _said(tried: Tried, found: Run | None, leaner: Leaner) -> str:
    from hetero.plan.alone import named
    from hetero.units import SIZE

    what = named(tried.levers)
    if found is None:
        return f"{what}: no peak settled below {SIZE.format_short(leaner.stop)}"
    return (f"{what}: {SIZE.format_short(found.peak_bytes)} (the median of {len(tried.runs)} processes), "
            f"{found.step_s / leaner.returned.step_s:.2f}x the step of {leaner.reference} with freed memory returned")


def main(argv: list[str]) -> int:
    """`python -m hetero.profile.fresh PROFILE BUDGET LIMIT STEPS STEPS_FROM text|json plain|leaner SCRIPT [ARGS]`:
    what `hetero profile` under a memory limit becomes once its profile is written (hetero.cli.profile): plain
    training alone (`plain`; `leaner`: its estimate fills the room already), then the leaner plans where it does not
    fit, then PROFILE updated and one line said for each (or, with `json`, the profile printed)."""
    output, budget, limit, steps, steps_from, form, first, script, args = \
        argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4], argv[5], argv[6], argv[7], argv[8:]
    from hetero.plan.fit import room_of

    room = room_of(budget)
    stop = stop_at(room, limit)
    try:
        runs: list[Run | None] = []
        if first == "plain":
            print("measuring plain training's own peak alone, in a fresh process with malloc's defaults ...",
                  file=sys.stderr, flush=True)
            runs = runs_alone(script, args, steps, steps_from, stop)
        leaner = leaner_alone(output, script, args, steps, steps_from, budget, limit) \
            if not fits(median(runs), budget) else None
    except KeyboardInterrupt:
        print(f"hetero: interrupted while plain training ran alone; {output} is written, plain's peak estimated",
              file=sys.stderr)
        return 130
    from hetero.schema import files
    from hetero.schema.profile import Profile, header
    from hetero.units import SIZE

    profile = files.load(output, expect=Profile)
    profile.memory = alone(profile.memory, runs, stop, leaner)
    files.save(profile, output, header(script))
    middle = median(runs)
    if form == "json":
        print(json.dumps(files.to_data(profile), indent=2))
        return 0
    if not runs:
        print(f"plain peak: not run alone, its estimate fills the room under the budget already "
              f"({SIZE.format_short(room)}): it stays estimated in {output}")
    elif middle is None:
        print(f"plain peak: plain training with malloc's defaults, run alone, gave no peak settled below "
              f"{SIZE.format_short(stop)} (it passed it, or ended first): it stays estimated in {output}")
    else:
        print(f"plain peak: {SIZE.format_short(middle.peak_bytes)} measured alone (the median of {len(runs)} fresh "
              f"processes with malloc's defaults, each once its peak settled), written to {output}")
    for tried in leaner.tried if leaner is not None else []:
        print(f"leaner plan alone: {_said(tried, median(tried.runs), leaner)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
