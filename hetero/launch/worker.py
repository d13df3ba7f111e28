"""A torchrun worker, started by `hetero run/profile --nproc-per-node N` or `torchrun ... -m hetero.launch.worker`:
profile or run as the environment says (hetero.launch.launcher)."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

from hetero import interrupts
from hetero.errors import FAILURE, USAGE, HeteroError, Interrupted
from hetero.launch.launcher import (ALLOW_STALE_ENV, PLAN_ENV, PROFILE_ENV, SKIP_PROFILE_CHECK_ENV, TRACE_ENV, WORKER,
                                    Trace, find_plan, run_here)
from hetero.launch.torchrun import EXIT_DIR_ENV, write_exit, write_traceback


def worker_main(argv: list[str]) -> int:
    """A torchrun worker (`python -m hetero.launch.worker SCRIPT ARGS`): profile or run, then leave the exit code
    and the last line of the error. SIGTERM (torchrun stopping it, or its parent ending) cleans up like Ctrl-C."""
    code, message = FAILURE, ""
    interrupts.die_with_parent()
    try:
        with interrupts.handled():
            code, message = _work(argv)
    except HeteroError as e:
        lines = [f"error: {e.message}"] + ([f"hint: {e.hint}"] if e.hint else [])
        print("\n".join(f"[rank {_rank()}] {line}" for line in lines), file=sys.stderr)
        code, message = e.exit_code, e.message
    except Interrupted as e:
        code, message = e.exit_code, interrupts.name(e.signum)
    finally:
        code = interrupts.exit_code() or code  # an interrupt a script swallowed still ends the worker as one
        if os.environ.get(EXIT_DIR_ENV):
            write_exit(os.environ[EXIT_DIR_ENV], _rank(), code, message)
    return code


def _work(argv: list[str]) -> tuple[int, str]:
    if not argv:
        raise HeteroError("no script given", hint=f"torchrun ... -m {WORKER} train.py [ARGS]", exit_code=USAGE)
    script, args = argv[0], argv[1:]
    if os.environ.get(PROFILE_ENV):
        return _profile_here(script, args, json.loads(os.environ[PROFILE_ENV])), ""
    plan_path, allow_stale = find_plan(os.environ.get(PLAN_ENV)), os.environ.get(ALLOW_STALE_ENV) == "1"
    traced = json.loads(os.environ[TRACE_ENV]) if os.environ.get(TRACE_ENV) else None
    trace = Trace(Path(traced["trace"]), traced["steps"]) if traced else None
    exits = os.environ.get(EXIT_DIR_ENV)
    tracebacks = io.StringIO() if exits else None  # hetero prints the first failed rank's, after all ranks end
    skip = os.environ.get(SKIP_PROFILE_CHECK_ENV) == "1"
    try:
        result = run_here(script, args, plan_path, allow_stale, leader=_rank() == 0, trace=trace,
                          skip_profile_check=skip, tracebacks=tracebacks)
    finally:
        if tracebacks is not None and tracebacks.getvalue():
            write_traceback(exits, _rank(), tracebacks.getvalue())
    return result.exit_code, result.error


def _profile_here(script: str, args: list[str], request: dict) -> int:
    from hetero.profile.profiler import ProfileOptions, profile_script, save  # imports torch

    result = profile_script(script, args, ProfileOptions(**request["options"]))
    if result is not None:  # rank 0
        save(result, Path(request["output"]), script)
    return 0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    # This file runs here as `__main__`, a second copy beside `hetero.launch.worker`: it only calls into the imported
    # modules, so StopScript and every other class is one class everywhere.
    sys.exit(worker_main(sys.argv[1:]))
