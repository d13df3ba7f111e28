"""The script in a fresh process of its own, trained plainly until its peak settles (hetero.profile.returned's child),
started from a process that stays small: this module imports no torch, so that `hetero profile` under a memory
limit can run it alone beside the limit's waiter (hetero.cli.profile, `measure_alone`), where the profile's own
process, torch loaded (150 MiB here before any tensor), would not leave room for plain training.

`stop_at` bounds the fresh process: a thread in it reads its resident memory every `POLL_S` and ends it (exit
`STOPPED`) once it holds that much, before a memory limit above would kill it (the limit's killer would pick the
largest process of the cgroup, and a user's cgroup records each kill).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

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


def run(script: str, args: list[str], steps: int, malloc: str, steps_from: str, stop_at: int | None = None
        ) -> Run | None:
    """Train `script` plainly in a fresh process for at least `steps` optimizer steps (or backward calls:
    `steps_from`), malloc's defaults or freed memory returned (`malloc`: default | returned), until its peak settles;
    None where it could not (it failed, ended first, or reached `stop_at` resident bytes)."""
    work = workdir.create(None, "returned", "TMPDIR")
    try:
        out = os.path.join(work.path, "returned.json")
        done = subprocess.run([sys.executable, "-c", CHILD, str(os.getpid()), out, str(steps), malloc, steps_from,
                               str(stop_at or 0), script, *args], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
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


def runs_alone(script: str, args: list[str], steps: int, steps_from: str, stop: int) -> list[Run | None]:
    """Up to `RUNS` fresh processes of plain training with malloc's defaults, each stopped at `stop`; fewer where a
    majority agrees already (settled below `stop`, their median the higher of two; or gave no peak)."""
    out: list[Run | None] = []
    while len(out) < RUNS and max(sum(r is None for r in out), sum(r is not None for r in out)) <= RUNS // 2:
        out.append(run(script, args, steps, "default", steps_from, stop))
    return out


def median(runs: list[Run | None]) -> Run | None:
    """The median run, one that gave no peak counting above every other (None where it is such a run)."""
    ordered = sorted(runs, key=lambda r: r.peak_bytes if r is not None else float("inf"))
    return ordered[len(ordered) // 2] if ordered else None


def alone(memory: Memory, runs: list[Run | None], stop: int) -> Memory:
    """The profile's `memory` once plain training ran alone: its own peak, the
    median of `runs`, where that settled below `stop`, else the estimate as it was, each said in
    `profiled_under`."""
    from dataclasses import replace

    from hetero.units import SIZE, measured

    middle = median(runs)
    if middle is None:
        return replace(memory, profiled_under=f"{memory.profiled_under}; plain training with malloc's defaults, run "
                                              f"alone after the profile, gave no peak settled below "
                                              f"{SIZE.format_short(stop)} in {sum(r is None for r in runs)} of "
                                              f"{len(runs)} processes (it passed it, or ended first): its peak "
                                              "stays estimated")
    return replace(memory, dram_peak_bytes=middle.peak_bytes,
                   dram_peak_runs_bytes=[r.peak_bytes for r in runs if r is not None], dram_peak_estimated=False,
                   default_step_s=measured(middle.step_s),
                   profiled_under=f"{memory.profiled_under}; plain training's own peak then measured alone, the "
                                  f"median of {len(runs)} fresh processes with malloc's defaults")


def main(argv: list[str]) -> int:
    """`python -m hetero.profile.fresh PROFILE ROOM LIMIT STEPS STEPS_FROM text|json SCRIPT [ARGS]`: what `hetero
    profile` under a memory limit becomes once its profile is written (hetero.cli.profile): plain training alone,
    then PROFILE updated and one line said (or, with `json`, the profile printed)."""
    output, room, limit, steps, steps_from, form, script, args = \
        argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4], argv[5], argv[6], argv[7:]
    stop = stop_at(room, limit)
    try:
        runs = runs_alone(script, args, steps, steps_from, stop)
    except KeyboardInterrupt:
        print(f"hetero: interrupted while plain training ran alone; {output} is written, plain's peak estimated",
              file=sys.stderr)
        return 130
    from hetero.schema import files
    from hetero.schema.profile import Profile, header
    from hetero.units import SIZE

    profile = files.load(output, expect=Profile)
    profile.memory = alone(profile.memory, runs, stop)
    files.save(profile, output, header(script))
    middle = median(runs)
    if form == "json":
        print(json.dumps(files.to_data(profile), indent=2))
    elif middle is None:
        print(f"plain peak: plain training with malloc's defaults, run alone, gave no peak settled below "
              f"{SIZE.format_short(stop)} (it passed it, or ended first): it stays estimated in {output}")
    else:
        print(f"plain peak: {SIZE.format_short(middle.peak_bytes)} measured alone (the median of {len(runs)} fresh "
              f"processes with malloc's defaults, each once its peak settled), written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
