"""What returning freed memory does to the script's training: its peak and its step time, measured so that the plan
can count both (hetero.plan.fit's `allocator` lever).

Two ways, one per case:
- Without a budget, `measure` runs the script once more in a fresh process that sets glibc's thresholds as the
  runtime does (hetero.run.allocator) before the script starts, for the warm-up steps and `TIMED_STEPS` more: its
  peak (VmHWM), and the mean time of the timed steps; then once more with malloc's defaults, whose step time is what
  the first one's is compared with (the profile's own steps ran at another moment of a shared machine's load, with
  its hooks). Fresh processes, because the profile's own has grown its heap the default way already: measured
  there, the peak says more about the profile than about a planned run.
- Under a budget (a memory cgroup, or `hetero profile --dram-budget`), plain training might not fit, and the
  profile must not die of it: `Budgeted` returns freed memory from before the script's first allocation, the
  most memory-saving setting hetero can apply to a script it does not yet drive. Plain's own peak is then not
  measured: the profile writes the measured one as an estimate (a lower bound) and says so.

`python -m hetero.profile.returned OUT STEPS returned|default optimizer|backward SCRIPT [ARGS]` is the fresh process
(started with `hetero run`'s modules loaded first); it writes `OUT` (JSON) in a private work directory of the profile
(`hetero-returned-*`, hetero.run.devices.workdir: swept by the next start if the profile is killed), and it ends
when the profile ends, however the profile ends (Linux parent-death signal), SIGKILL and a memory limit included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from hetero.run import allocator, process_memory
from hetero.run.devices import workdir
from hetero.schema.plan import AllocatorPlan
from hetero.units import SIZE

TIMED_STEPS = 2


@dataclass(frozen=True, slots=True)
class Returned:
    peak_bytes: int
    step_s: float
    default_step_s: float  # the same run's step with malloc's defaults


@dataclass(frozen=True, slots=True)
class _Run:
    peak_bytes: int
    step_s: float


def returning() -> bool:
    """Set the thresholds the plan's `allocator` section uses and trim; False where malloc is not glibc."""
    ok = allocator.set_thresholds(AllocatorPlan.RETURNING, AllocatorPlan.RETURNING)
    return ok and allocator.trim()


def restore() -> None:
    allocator.set_thresholds(allocator.RESTORED_MMAP_BYTES, allocator.RESTORED_TRIM_BYTES)


def measure(script: str, args: list[str], warmup: int, steps_from: str = "optimizer") -> Returned | None:
    """The script's peak and step time with freed memory returned, and its step time without, each from a fresh
    process, its steps counted as the profile counted them (`steps_from`: optimizer steps, or backward calls);
    None when it could not run that many steps (or malloc is not glibc)."""
    returned = _run(script, args, warmup, "returned", steps_from)
    default = _run(script, args, warmup, "default", steps_from) if returned is not None else None
    if default is None:
        return None
    return Returned(peak_bytes=returned.peak_bytes, step_s=returned.step_s, default_step_s=default.step_s)


def _run(script: str, args: list[str], warmup: int, malloc: str, steps_from: str) -> _Run | None:
    work = workdir.create(None, "returned", "TMPDIR")
    try:
        out = os.path.join(work.path, "returned.json")
        steps = warmup + TIMED_STEPS
        done = subprocess.run([sys.executable, "-c", _CHILD, str(os.getpid()), out, str(steps), malloc, steps_from,
                               script, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, check=False)
        if done.returncode != 0 or not os.path.exists(out):
            return None
        with open(out) as f:
            data = json.load(f)
    finally:
        work.remove()
    return _Run(peak_bytes=data["peak_bytes"], step_s=data["step_s"])


# The fresh process first asks to die with the profile (it gets SIGTERM, whose default action ends it, when the
# profile ends, or at once if the profile, whose pid is its first argument, is gone already); then it loads what
# `hetero run` has loaded when its script starts (the CLI, the runtime), so that its peak counts them as a planned
# run's does (~20 MiB here), and runs this module.
_CHILD = ("import sys, hetero.interrupts; hetero.interrupts.die_with_parent(int(sys.argv.pop(1))); "
          "import runpy, hetero.cli.main, hetero.run.runtime; sys.argv[0] = 'returned'; "
          "runpy.run_module('hetero.profile.returned', run_name='__main__', alter_sys=True)")


def _child(out: str, steps: int, malloc: str, steps_from: str, script: str, args: list[str]) -> int:
    if malloc == "returned" and not returning():
        return 1
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from hetero.harness import watch
    from hetero.harness.script import StopScript, run_script

    ends: list[float] = []
    first: list = []  # the first optimizer to step: its steps are the script's

    def step_ended(optimizer=None, *_):
        if optimizer is not None and first[:1] != [optimizer]:
            if first:
                return
            first.append(optimizer)
        ends.append(time.perf_counter())
        if len(ends) == steps:
            raise StopScript()

    handle = register_optimizer_step_post_hook(step_ended) if steps_from == "optimizer" else \
        watch.backward_calls(step_ended)
    try:
        result = run_script(script, args)
    finally:
        handle.remove()
    if not result.stopped or len(ends) < steps:
        return 1
    timed = ends[-TIMED_STEPS - 1:]
    with open(out, "w") as f:
        json.dump({"peak_bytes": process_memory.dram_peak_bytes(),
                   "step_s": (timed[-1] - timed[0]) / TIMED_STEPS}, f)
    return 0


def budget_of(option_bytes: int | None) -> tuple[int, str] | None:
    """The budget the profile keeps: `--dram-budget`, else the memory cgroup's limit; None: none."""
    if option_bytes is not None:
        return option_bytes, f"--dram-budget {SIZE.format_short(option_bytes)}"
    limit = process_memory.memory_limit_bytes()
    return (limit, f"the {SIZE.format_short(limit)} memory cgroup") if limit is not None else None


class Budgeted:
    """The whole profile under a budget, freed memory returned from the start."""

    def __init__(self, budget: tuple[int, str]):
        self.budget_bytes, self.source = budget
        self.applied = returning()

    @property
    def profiled_under(self) -> str:
        how = "freed memory returned from the start" if self.applied else \
            "nothing could be moved (malloc is not glibc)"
        return f"{how}, under {self.source}"

    def close(self) -> None:
        if self.applied:
            restore()
            self.applied = False


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:]))
