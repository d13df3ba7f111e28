"""What the script's training costs in a process of its own: plain training's peak and step time, and the same with
freed memory returned, so that the plan can count both (hetero.plan.fit's `allocator` lever).

Two ways, one per case:
- Without a budget, `measure` runs the script in a fresh process that sets glibc's thresholds as the runtime does
  (hetero.run.allocator) before the script starts, then in two or three with malloc's defaults (`more_needed`):
  plain training as the user runs it, without the profiler's hooks. The first runs until its peak has settled
  (`settled`): at least the warm-up steps and `TIMED_STEPS` more, then until `SETTLE_STEPS` steps in a row raised
  the peak by less than `SETTLE_BYTES`, at most `MAX_STEPS` steps; the others run `DEFAULTS_STEPS` steps. Each ends
  sooner where the script does (its evaluation and saving then count).
  A process's heap goes on growing for steps after the first: glibc raises its mmap threshold each time a mapped
  block is freed, and blocks it used to map then fragment the heap (a width-512 LM: 1333 MiB after 2 steps,
  1409 after 3, 1501 from the 4th on). Each gives its peak as a memory limit charges it
  (hetero.run.process_memory) and the mean time of its last timed steps; the returned run's step is compared with
  the default run's (the profile's own steps ran at another moment of a shared machine's load, with its hooks).
  Fresh processes, because the profile's own has grown its heap the default way already, with hooks and layer
  timings in it: measured there, the peak says more about the profile than about a planned run.
- Under a budget (a memory cgroup, or `hetero profile --dram-budget`), plain training might not fit, and the
  profile must not die of it: `Budgeted` returns freed memory from before the script's first allocation, the
  most memory-saving setting hetero can apply to a script it does not yet drive. Plain's own peak is then not
  measured: the profile writes the measured one as an estimate and says so. Under a memory limit, where that
  estimate leaves room under the budget, `hetero profile` then becomes a bare interpreter that runs the script
  alone with malloc's defaults (`alone_argv`, hetero.profile.fresh), and takes its peak where it settled below the
  room: plain training that fits by a few percent (train_gpt 3 x 768 under 768 MiB, 680-727 MiB) is then planned as
  plain training, not with the page faults of memory returned from the start. Where it did not, or where the
  estimate left no room, the same is done for leaner plans (hetero.plan.alone: the script's updates in backward,
  then every block recomputed; run by `hetero run`'s runtime in the fresh processes), after one process with freed
  memory returned, whose step they are compared with: each, measured so, is a plan of its own.

`python -m hetero.profile.returned OUT STEPS returned|default optimizer|backward STOP_AT PLAN|- SCRIPT [ARGS]` is the
fresh process (started by hetero.profile.fresh with `hetero run`'s modules loaded first); it writes `OUT` (JSON) in a
private work directory of the profile (`hetero-returned-*`, hetero.run.devices.workdir: swept by the next start if
the profile is killed), trains under the plan file PLAN (`-`: none), ends itself once it holds `STOP_AT` bytes (0:
never), and ends when the profile ends, however the profile ends (Linux parent-death signal), SIGKILL and a memory
limit included.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hetero.plan import alone
from hetero.plan.fit import room_of, with_spread
from hetero.profile import fresh
from hetero.run import allocator, process_memory
from hetero.schema.plan import AllocatorPlan
from hetero.schema.profile import Profile
from hetero.units import SIZE

TIMED_STEPS = 2
SETTLE_STEPS = 2  # steps in a row that must leave the peak where it was
SETTLE_BYTES = 2 << 20  # what "where it was" allows: the peak's own noise between steps
MAX_STEPS = 12  # a peak still rising by then rises with the script's own state (a list of losses), not the heap's
# With malloc's defaults the heap's peak rises in jumps long after it seems settled, and differently from process to
# process: train_gpt 6 x 256 in four processes, 1225-1337 MiB after 5 steps (where two steps in a row left it),
# 1309-1362 after 16, 1345-1377 after 24 (docs/benchmarks.md, round nine). Those processes run this many steps.
DEFAULTS_STEPS = 16
# Fresh processes with malloc's defaults: the median (mean) of two, as two agreeing processes alone under a limit end
# theirs (hetero.profile.fresh.runs_alone), for one start of the script less in every profile than three; the
# higher of two, taken before, predicted train_gpt 6 x 256 at 1.366 GiB where six runs measured 1.23-1.32 GiB.
DEFAULT_RUNS = 2
# ... and a third where those two are more than `AGREE` apart: heldout_lm 8 x 256's two peaked at 1.06 and 1.18 GiB
# where six plain processes (`python`, and the plan that runs plain) peaked at 1.06-1.12 GiB.
MOST_RUNS = 3
AGREE = 0.05


@dataclass(frozen=True, slots=True)
class Returned:
    peak_bytes: int  # with freed memory returned
    step_s: float
    default_peak_bytes: int  # plain training's own: malloc's defaults, no hooks
    default_step_s: float  # the same script's step with malloc's defaults
    default_steps: int  # steps the default run took to settle (or the script's, where it ended first)
    default_peaks_bytes: tuple[int, ...]  # each default run's peak, in the order they ran


def settled(peaks: list[int], least_steps: int) -> bool:
    """Whether a run whose peak after each step so far is `peaks` may stop: `least_steps` done, and the last
    `SETTLE_STEPS` of them raised it by less than `SETTLE_BYTES`; or `MAX_STEPS` done."""
    if len(peaks) >= max(MAX_STEPS, least_steps):
        return True
    return len(peaks) >= least_steps and len(peaks) > SETTLE_STEPS and \
        peaks[-1] - peaks[-1 - SETTLE_STEPS] < SETTLE_BYTES


def returning() -> bool:
    """Set the thresholds the plan's `allocator` section uses and trim; False where malloc is not glibc."""
    ok = allocator.set_thresholds(AllocatorPlan.RETURNING, AllocatorPlan.RETURNING)
    return ok and allocator.trim()


def restore() -> None:
    allocator.set_thresholds(allocator.RESTORED_MMAP_BYTES, allocator.RESTORED_TRIM_BYTES)


def measure(script: str, args: list[str], warmup: int, steps_from: str = "optimizer",
            progress: Callable[[int, int], None] | None = None) -> Returned | None:
    """The script's peak and step time with freed memory returned (one fresh process: that peak is the same in
    every run), and with malloc's defaults (the median of `DEFAULT_RUNS` fresh processes, of two their mean, or of
    `MOST_RUNS` where the first disagree: `more_needed`),
    its steps counted as the profile counted them (`steps_from`: optimizer steps, or backward calls); None when it
    could not run that many steps (or malloc is not glibc). `progress(done, total)` follows the processes."""
    steps = warmup + TIMED_STEPS
    returned = fresh.run(script, args, steps, "returned", steps_from)
    defaults: list[fresh.Run] = []
    while returned is not None and more_needed(defaults):
        if progress is not None:
            progress(1 + len(defaults), 1 + max(DEFAULT_RUNS, len(defaults) + 1))
        run = fresh.run(script, args, steps, "default", steps_from)
        if run is None:
            return None
        defaults.append(run)
    median = fresh.median(defaults)
    if median is None:
        return None
    return Returned(peak_bytes=returned.peak_bytes, step_s=returned.step_s, default_peak_bytes=median.peak_bytes,
                    default_step_s=statistics.median(r.step_s for r in defaults),
                    default_steps=max(r.steps for r in defaults),
                    default_peaks_bytes=tuple(r.peak_bytes for r in defaults))


def more_needed(defaults: list[fresh.Run]) -> bool:
    """Whether `measure` starts another process with malloc's defaults: fewer than `DEFAULT_RUNS` ran, or the
    lowest and highest peaks so far are more than `AGREE` apart and fewer than `MOST_RUNS` ran."""
    if len(defaults) < DEFAULT_RUNS:
        return True
    peaks = sorted(r.peak_bytes for r in defaults)
    return len(defaults) < MOST_RUNS and peaks[0] * (1 + AGREE) < peaks[-1]


def _child(out: str, steps: int, malloc: str, steps_from: str, stop_at: int, plan: str, script: str,
           args: list[str]) -> int:
    if malloc == "returned" and not returning():
        return 1
    if stop_at:
        threading.Thread(target=_stop_at, args=(stop_at,), name="hetero-stop-at", daemon=True).start()
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from hetero.harness import watch
    from hetero.harness.script import StopScript, run_script

    until = steps if malloc == "returned" else max(steps, DEFAULTS_STEPS)
    ends: list[float] = []
    peaks: list[int] = []
    first: list = []  # the first optimizer to step: its steps are the script's

    def step_ended(optimizer=None, *_):
        if optimizer is not None and first[:1] != [optimizer]:
            if first:
                return
            first.append(optimizer)
        ends.append(time.perf_counter())
        peaks.append(process_memory.dram_peak_bytes())
        if settled(peaks, until):
            raise StopScript()

    handle = register_optimizer_step_post_hook(step_ended) if steps_from == "optimizer" else \
        watch.backward_calls(step_ended)
    try:
        with _under(plan, script):
            result = run_script(script, args)
    finally:
        handle.remove()
    if len(ends) < steps or not (result.stopped or result.exit_code == 0):
        return 1
    timed = ends[-TIMED_STEPS - 1:]
    with open(out, "w") as f:
        json.dump({"peak_bytes": process_memory.dram_peak_bytes(), "steps": len(ends),
                   "step_s": (timed[-1] - timed[0]) / TIMED_STEPS}, f)
    return 0


def _under(plan: str, script: str) -> contextlib.AbstractContextManager:
    """The runtime of `hetero run` carrying out the plan file `plan` ("-": none, plain training)."""
    if plan == "-":
        return contextlib.nullcontext()
    from hetero.run.runtime import Runtime
    from hetero.schema import files
    from hetero.schema.plan import Plan

    return Runtime(files.load(plan, expect=Plan), script=script)


def _stop_at(limit: int) -> None:
    while process_memory.resident_bytes() < limit:
        time.sleep(fresh.POLL_S)
    os._exit(fresh.STOPPED)  # mid-step, where the peak is: no Python code of the script may run on (fresh.py)


def budget_of(option_bytes: int | None) -> tuple[int, str] | None:
    """The budget the profile keeps: `--dram-budget`, else the memory cgroup's limit; None: none."""
    if option_bytes is not None:
        return option_bytes, f"--dram-budget {SIZE.format_short(option_bytes)}"
    limit = process_memory.memory_limit_bytes()
    return (limit, f"the {SIZE.format_short(limit)} memory cgroup") if limit is not None else None


def alone_argv(profile: Profile, budget_bytes: int, warmup: int, output: str, as_json: bool, script: str,
               args: list[str]) -> list[str] | None:
    """Under a memory limit, once the profile (`profile`, written to `output`) is done: the command its process
    becomes (hetero.profile.fresh `main`, exec'd, so that nothing of this process stays beside it) to measure plain
    training's own peak alone, as `measure` does without a budget, then the leaner plans where plain does not fit;
    only the leaner plans where the estimate leaves no room under the budget for malloc's defaults' spread above it
    already (hetero.plan.fit.DEFAULTS_SPREAD: plain would not be planned). The estimate is no bound for them: one of
    train_gpt 1 x 768 under 512 MiB at 516 MiB, where the script's updates in backward measured alone peaked at 449.
    None where there is nothing to measure: a GPU, a peak measured already, no memory limit, or plain not fitting
    and no leaner plan the script allows (hetero.plan.alone.to_measure)."""
    memory, limit = profile.memory, process_memory.memory_limit_bytes()
    if memory is None or not memory.dram_peak_estimated or profile.machine.gpu is not None or limit is None:
        return None
    plain = with_spread(memory.dram_peak_bytes) < room_of(budget_bytes)  # an estimate: the room, as simulated
    if not plain and not alone.to_measure(profile):
        return None
    return [sys.executable, "-m", "hetero.profile.fresh", output, str(budget_bytes), str(limit),
            str(warmup + TIMED_STEPS), profile.training.steps_from, "json" if as_json else "text",
            "plain" if plain else "leaner", script, *args]


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
    sys.exit(_child(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6],
                    sys.argv[7], sys.argv[8:]))
