"""`hetero run` and `hetero profile` launches: in this process, or through torchrun with one worker per rank.

`build` is pure (argv and environment from the arguments). One process: `run` checks the plan as `hetero check`
does (hetero.launch.preflight: exit 3 or 4 before anything runs), sweeps what killed hetero processes left behind,
and runs the script here as `python script.py args` would. Several (`--nproc-per-node`): hetero checks what it can
first, then starts `python -m hetero.launch.torchrun ... -m hetero.launch.worker script args`; torchrun and its
workers end when hetero ends.
The protocol between hetero and its workers is the environment:
  HETERO_PLAN         the plan (workers started by plain `torchrun -m hetero.launch.worker` default to plan.yaml)
  HETERO_ALLOW_STALE  1: run a plan made for another profile or model
  HETERO_SKIP_PROFILE_CHECK  1: run a plan whose profile cannot be found or read, unchecked against it
  HETERO_PROFILE      JSON {output, options}: profile instead of run; rank 0 writes the profile
  HETERO_TRACE        JSON {trace, steps}: rank 0 records that many steps into the trace and run.yaml beside it
  HETERO_EXIT_DIR     where each worker leaves its exit code, end time and last error line, so that hetero prints
                      one line per failed rank and exits with the first failure's code (hetero.launch.torchrun)
Workers read LOCAL_RANK/RANK/WORLD_SIZE from torchrun's environment; the script's arguments are never changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hetero.errors import USAGE, FileProblems, HeteroError, Interrupted, Problem
from hetero.harness.script import ScriptResult, check_script, run_script, script_argv
from hetero.launch.plain import Expected, exec_plain
from hetero.launch.preflight import Checked, check_plan
from hetero.launch.torchrun import EXIT_DIR_ENV, PARENT_ENV, failures, report_failures, traceback_of
from hetero.run import huge_pages
from hetero.run.devices import workdir
from hetero.run.devices.places import PlanPathError
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile

PLAN_ENV = "HETERO_PLAN"  # where workers started by torchrun find the plan
ALLOW_STALE_ENV = "HETERO_ALLOW_STALE"
SKIP_PROFILE_CHECK_ENV = "HETERO_SKIP_PROFILE_CHECK"
PROFILE_ENV = "HETERO_PROFILE"
TRACE_ENV = "HETERO_TRACE"
RESTARTED_ENV = "HETERO_RESTARTED"  # `hetero run` started itself again with malloc's huge pages asked for
WORKER = "hetero.launch.worker"
TORCHRUN = "hetero.launch.torchrun"  # torch.distributed.run, quiet about the failures hetero reports (torchrun.py)


@dataclass(frozen=True, slots=True)
class Torchrun:
    """How many workers, on how many nodes: torchrun's own options, passed through."""

    nproc_per_node: int
    nnodes: str = "1"  # N, or MIN:MAX for an elastic job
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None  # HOST:PORT of a c10d rendezvous

    def max_nodes(self) -> int:
        try:
            counts = [int(n) for n in self.nnodes.split(":")]
        except ValueError:
            raise HeteroError(f"--nnodes {self.nnodes}: expected N or MIN:MAX", exit_code=USAGE) from None
        return counts[-1]

    def check(self) -> None:
        if self.nproc_per_node < 1:
            raise HeteroError(f"--nproc-per-node {self.nproc_per_node}: need at least 1", exit_code=USAGE)
        if self.max_nodes() > 1 and not (self.rdzv_endpoint or self.master_addr):
            raise HeteroError(f"--nnodes {self.nnodes} needs a meeting point for the nodes",
                              hint="add --rdzv-endpoint HOST:PORT (or --master-addr and --node-rank)",
                              exit_code=USAGE)

    def argv(self) -> list[str]:
        out = ["--nproc-per-node", str(self.nproc_per_node), "--nnodes", self.nnodes,
               "--max-restarts", "0", "--monitor-interval", "0.1"]  # one failing worker ends the run, at once
        if self.rdzv_endpoint:
            out += ["--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", "hetero"]
        elif self.master_addr is None and self.max_nodes() == 1:
            out.append("--standalone")  # a free local port: runs side by side never collide
        for flag, value in (("--master-addr", self.master_addr), ("--master-port", self.master_port),
                            ("--node-rank", self.node_rank)):
            if value is not None:
                out += [flag, str(value)]
        return out


@dataclass(frozen=True, slots=True)
class Launch:
    argv: list[str]  # the script's sys.argv
    env: dict[str, str]  # set for the script (and any process it starts)
    command: list[str] | None = None  # the process hetero starts; None: the script runs in this process


@dataclass(frozen=True, slots=True)
class Trace:
    """`--trace`: where the Chrome trace goes (run.yaml beside it) and how many steps it records."""

    path: Path
    steps: int = 10

    def check(self) -> None:
        if self.path.suffix != ".json":
            raise HeteroError(f"--trace {self.path}: the trace is JSON; its summary goes beside it as .yaml",
                              hint=f"--trace {self.path.with_suffix('.json')}", exit_code=USAGE)
        if self.steps < 1:
            raise HeteroError(f"--trace-steps {self.steps}: need at least 1", exit_code=USAGE)
        if not self.path.resolve().parent.is_dir():
            raise HeteroError(f"--trace {self.path}: no directory {self.path.parent}", hint="create it first",
                              exit_code=USAGE)
        summary = self.path.with_suffix(".yaml")
        if summary.is_file() and files.kind_of(summary) != "Run":
            raise HeteroError(f"--trace {self.path}: its summary would overwrite {summary}, which is not a run summary",
                              hint=f"--trace {self.path.with_stem(self.path.stem + '-run')}", exit_code=USAGE)


def build(script: str, args: list[str], plan_path: Path, allow_stale: bool = False,
          torchrun: Torchrun | None = None, trace: Trace | None = None, skip_profile_check: bool = False) -> Launch:
    env = {PLAN_ENV: str(plan_path.resolve())} | ({ALLOW_STALE_ENV: "1"} if allow_stale else {}) | \
        ({SKIP_PROFILE_CHECK_ENV: "1"} if skip_profile_check else {})
    if trace is not None:
        env[TRACE_ENV] = json.dumps({"trace": str(trace.path.resolve()), "steps": trace.steps})
    return _launch(script, args, env, torchrun)


def _launch(script: str, args: list[str], env: dict[str, str], torchrun: Torchrun | None) -> Launch:
    argv = script_argv(script, args)
    command = None if torchrun is None else [sys.executable, "-m", TORCHRUN, *torchrun.argv(), "-m", WORKER, *argv]
    return Launch(argv=argv, env=env, command=command)


def find_plan(plan: str | None) -> Path:
    path = Path(plan or "plan.yaml")
    if not path.exists():  # one that is there but no regular file (a FIFO, a directory) is refused when read
        hint = ("make one: hetero profile SCRIPT, then hetero plan" if plan is None
                else "pass the path of a plan made by hetero plan")
        raise HeteroError(f"no plan at {path}", hint=hint, exit_code=USAGE)
    return path


def run(script: str, args: list[str], plan: str | None = None, allow_stale: bool = False,
        torchrun: Torchrun | None = None, trace: Trace | None = None, skip_profile_check: bool = False,
        replace_process: bool = False) -> int:
    """Run the script under the plan, here or in torchrun's workers; the script's (or first failed worker's) exit code.
    With `replace_process`, a plan that moves nothing execs the script in this process's place (hetero.launch.plain),
    and one that returns freed memory first execs this command again with malloc's huge pages asked for."""
    check_script(script)
    plan_path = find_plan(plan)
    if trace is not None:
        trace.check()
    if torchrun is not None:
        torchrun.check()
    checked = check_plan(plan_path, allow_stale, skip_profile_check)  # what `hetero check` checks, all of it
    wanted = huge_pages.env(os.environ) if checked.plan.allocator is not None else {}
    restarted = os.environ.pop(RESTARTED_ENV, None) is not None  # once: a loader that drops the tunable ends there
    if torchrun is None and replace_process and wanted and not restarted:
        _again_with(wanted | {RESTARTED_ENV: "1"})
    sweep_earlier(plan_bases(checked.plan))
    if torchrun is None:
        if replace_process and trace is None and checked.plan.runs_plain():
            _run_plain(script, args, checked, allow_stale)
        return run_here(script, args, plan_path, allow_stale, leader=True, trace=trace,
                        skip_profile_check=skip_profile_check, checked=checked).exit_code
    if checked.plan.routing is not None:  # refused before any worker starts; rank 0 prints the warnings
        from hetero.run.routing import check_routing  # imports torch

        check_routing(checked.plan.routing, torchrun.nproc_per_node * torchrun.max_nodes())
    launch = build(script, args, plan_path, allow_stale, torchrun, trace, skip_profile_check)
    return run_workers(dataclasses.replace(launch, env=launch.env | wanted))


def _again_with(env: dict[str, str]) -> None:
    """This command started again in this process's place (the same process id) with `env` added: what glibc
    reads only when a process starts. Returns only where exec fails: the run goes on here, without it."""
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], os.environ | env)  # its flags kept


def plan_bases(plan: Plan) -> list[str | None]:
    """The directories a run of `plan` makes work directories in (None: the system temp directory)."""
    bases = [plan.optimizer.nvme.path] if plan.optimizer is not None and plan.optimizer.nvme is not None else []
    return bases + ([plan.activations.slow_path] if plan.activations is not None else [])


def sweep_earlier(bases: list[str | None]) -> None:
    """At the start of a run or profile: remove what hetero processes killed earlier left in the temp directory and
    in `bases`, and say so in one line."""
    if line := workdir.sweep_earlier(bases):
        print(f"hetero: {line}", file=sys.stderr)


def run_here(script: str, args: list[str], plan_path: Path, allow_stale: bool, leader: bool,
             trace: Trace | None = None, skip_profile_check: bool = False, checked: Checked | None = None,
             tracebacks: TextIO | None = None) -> ScriptResult:
    """Run the script in this process under the plan (`checked`: the plan checked already; else checked here);
    the leader prints the warnings and the summary. The script's traceback, if it raises, goes to `tracebacks`."""
    from hetero.run.recorder import Outputs  # imports torch
    from hetero.run.runtime import Runtime

    checked = checked or check_plan(plan_path, allow_stale, skip_profile_check)
    for warning in checked.warnings if leader else []:
        print(f"hetero: warning: {warning}", file=sys.stderr)
    loaded = checked.plan
    launch = build(script, args, plan_path, allow_stale, skip_profile_check=skip_profile_check)
    record = Outputs(trace=trace.path, steps=trace.steps, plan_path=str(plan_path), script=script) \
        if trace is not None and leader else None
    with _environment(launch.env), _plan_lines(plan_path):
        with Runtime(loaded, script=script, allow_stale=allow_stale, record=record) as runtime:
            result = run_script(script, launch.argv[1:], tracebacks, explain=runtime.explain)
        # A failed run has no summary: its timings (a sync drift, late prefetches) say nothing about the plan.
        for line in runtime.summary() if leader and result.exit_code == 0 else []:  # may read the plan's path
            print(f"hetero: {line}", file=sys.stderr)
    if runtime.model is None and result.exit_code == 0 and leader:
        print(f"hetero: warning: the plan was never applied: {script} ended without an optimizer step, "
              "so hetero never saw its model", file=sys.stderr)
    if leader and result.exit_code == 0:
        print(f"hetero: {_memory_line(loaded, checked.profile)}", file=sys.stderr)
        if gpu := _gpu_line(loaded, runtime.model):
            print(f"hetero: {gpu}", file=sys.stderr)
    return result


def _run_plain(script: str, args: list[str], checked: Checked, allow_stale: bool) -> None:
    """A plan that moves nothing: the script runs as `python SCRIPT ARGS`, in this process's place
    (hetero.launch.plain), once the plan and its profile are checked."""
    from hetero.plan.model import GPU

    for warning in checked.warnings:
        print(f"hetero: warning: {warning}", file=sys.stderr)
    plan = checked.plan
    plain_peak, predicted = _host_peaks(plan, checked.profile)
    exec_plain(script, args, Expected(fingerprint=plan.source.model_fingerprint, allow_stale=allow_stale,
                                      parts=[(m.name, m.fingerprint) for m in plan.source.models],
                                      plain_peak_bytes=plain_peak, predicted_peak_bytes=predicted,
                                      predicted_gpu_bytes=plan.predicted.peak_bytes.get(GPU)))


def _memory_line(plan: Plan, profile: Profile | None) -> str:
    """This process's peak host memory beside plain training's (the profile's) and the plan's prediction."""
    from hetero.run import process_memory

    plain, predicted = _host_peaks(plan, profile)
    estimated = profile is not None and profile.memory is not None and profile.memory.dram_peak_estimated
    return process_memory.peak_line(process_memory.dram_peak_bytes(), predicted, plain, plain_estimated=estimated)


def _host_peaks(plan: Plan, profile: Profile | None) -> tuple[int | None, int | None]:
    """Plain training's host-memory peak as the profile measured it, and the plan's prediction (None: unknown)."""
    from hetero.plan.choices import host_tier

    return (profile.memory.dram_peak_bytes if profile is not None and profile.memory is not None else None,
            plan.predicted.peak_bytes.get(host_tier(profile)) if profile is not None else None)


def _gpu_line(plan: Plan, model) -> str | None:
    """The process's GPU peaks (torch's reserved, and allocated) beside the plan's prediction; None off a GPU."""
    from hetero.plan.model import GPU
    from hetero.run import process_memory

    device = next((p.device for p in model.parameters()), None) if model is not None else None
    return process_memory.gpu_peak_line(device, plan.predicted.peak_bytes.get(GPU))


def profile_workers(script: str, args: list[str], options: object, output: Path, torchrun: Torchrun,
                    stdout_to_stderr: bool = False) -> int:
    """`hetero profile --nproc-per-node N`: every worker profiles, rank 0 measures the machine and the links
    between ranks and writes `output`; the exit code of the first failed worker, else 0."""
    check_script(script)
    torchrun.check()
    request = {"output": str(output.resolve()), "options": dataclasses.asdict(options)}
    return run_workers(_launch(script, args, {PROFILE_ENV: json.dumps(request)}, torchrun), stdout_to_stderr)


def run_workers(launch: Launch, stdout_to_stderr: bool = False) -> int:
    """Start torchrun and wait; 0, or the exit code of the worker that failed first, after one line per failed
    rank. A signal that ends hetero (Ctrl-C, SIGTERM, SIGHUP) is passed on to torchrun, which stops its workers."""
    work = workdir.create(None, "exit", "TMPDIR")  # private, and swept by a later run if we are killed
    try:
        return _run_torchrun(launch, str(work.path), stdout_to_stderr)
    finally:
        work.remove()


def _run_torchrun(launch: Launch, exits: str, stdout_to_stderr: bool) -> int:
    """torchrun in its own session, its workers leaving their exit codes in `exits`; see run_workers."""
    # Its own session: a terminal's Ctrl-C reaches torchrun once, from us, not twice. It dies with us
    # (hetero.launch.torchrun asks for that itself: no preexec_fn, unsafe in a process with threads).
    env = os.environ | launch.env | {EXIT_DIR_ENV: exits, PARENT_ENV: str(os.getpid())}
    proc = subprocess.Popen(launch.command, env=env, stdout=2 if stdout_to_stderr else None, start_new_session=True)
    try:
        code = proc.wait()
    except Interrupted as e:
        _stop(proc, e.signum)
        raise
    except BaseException:
        _stop(proc, signal.SIGTERM)
        raise
    if code == 0:
        return 0
    failed = failures(Path(exits))
    first = traceback_of(Path(exits), failed[0].rank) if failed else ""
    if first:  # the others' tracebacks follow from it (a closed connection): their one line each says enough
        print(f"[rank {failed[0].rank}] {first.rstrip()}", file=sys.stderr)
    for line in report_failures(failed):
        print(f"error: {line}", file=sys.stderr)
    return failed[0].code if failed else code


def _stop(proc: subprocess.Popen, signum: int) -> None:
    """Pass `signum` on to torchrun and give it time to stop its workers; then kill it (they follow it)."""
    for sig, grace in ((signum, 30), (signal.SIGKILL, None)):
        if proc.poll() is None:
            proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
            return


@contextlib.contextmanager
def _plan_lines(plan_path: Path):
    """A directory the plan names that cannot be used is the plan's problem: exit 3 at its file:line."""
    try:
        yield
    except PlanPathError as e:
        problem = Problem(str(plan_path), e.message, files.line_of(plan_path, e.field))
        raise FileProblems([problem], hint=e.hint) from None


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
