"""A plan that runs plain training costs nothing: `hetero run` checks the plan and its profile, then replaces itself
(`os.execv`) with `python -m hetero.launch.plain SCRIPT ARGS`, a fresh interpreter without hetero's command line,
which runs the script as `python SCRIPT ARGS` would. Until the model's first training forward, global module hooks
look for it (hetero.harness.capture): a model other than the planned one is refused (exit 4); then the hooks are
gone. At the end one line compares the process's peak with plain training's as profiled.

What the bootstrap needs travels in the environment (`PLAIN_ENV`, JSON): the planned fingerprint, whether a stale
plan may run, and the figures for the last line.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass

from hetero import interrupts
from hetero.errors import HeteroError, Interrupted
from hetero.harness.script import run_script

PLAIN_ENV = "HETERO_PLAIN"


@dataclass(frozen=True, slots=True)
class Expected:
    fingerprint: str
    parts: list[tuple[str, str]]  # several models: each one's (name, fingerprint), as the plan's source lists them
    allow_stale: bool
    plain_peak_bytes: int | None  # plain training's host-memory peak as the profile measured it
    predicted_peak_bytes: int | None
    predicted_gpu_bytes: int | None = None  # the plan's GPU peak (plain training's measured reserved peak)


def exec_plain(script: str, args: list[str], expected: Expected) -> None:
    """Replace this process with the bootstrap running `script args`; returns only if exec fails (OSError)."""
    sys.stdout.flush()
    sys.stderr.flush()
    env = os.environ | {PLAIN_ENV: json.dumps(asdict(expected))}
    os.execve(sys.executable, [sys.executable, "-m", __name__, script, *args], env)


def main(argv: list[str]) -> int:
    expected = Expected(**json.loads(os.environ.pop(PLAIN_ENV)))
    code = 1
    try:
        with interrupts.handled():
            code = _run(argv[0], argv[1:], expected)
    except HeteroError as e:
        print(f"error: {e.message}" + (f"\nhint: {e.hint}" if e.hint else ""), file=sys.stderr)
        code = e.exit_code
    except Interrupted as e:
        code = e.exit_code
    return interrupts.exit_code() or code


def _run(script: str, args: list[str], expected: Expected) -> int:
    from hetero.harness.capture import Capture, check_planned  # imports torch, which the script imports anyway

    def found(model, optimizer) -> None:
        models.append(model)
        check_planned(model, expected.fingerprint, expected.allow_stale)  # Capture stops the script on an error

    models = []
    with Capture(found, script, fingerprint=expected.fingerprint, parts=[tuple(part) for part in expected.parts]):
        result = run_script(script, args)
    if result.exit_code == 0:
        for line in _peak_lines(expected, models[0] if models else None):
            print(f"hetero: {line}", file=sys.stderr)
    return result.exit_code


def _peak_lines(expected: Expected, model) -> list[str]:
    from hetero.run import process_memory

    host = process_memory.peak_line(process_memory.dram_peak_bytes(), expected.predicted_peak_bytes,
                                    expected.plain_peak_bytes)
    device = next((p.device for p in model.parameters()), None) if model is not None else None
    gpu = process_memory.gpu_peak_line(device, expected.predicted_gpu_bytes)
    return [f"plain training (the plan moves nothing); {host}"] + ([gpu] if gpu else [])


if __name__ == "__main__":
    # Runs as `__main__` beside the imported `hetero.launch.plain`: it only calls into imported modules.
    sys.exit(main(sys.argv[1:]))
