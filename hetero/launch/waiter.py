"""`hetero plan` under a memory limit: its trials run beside a bare interpreter, never beside the planner.

A trial process stops itself before it and the process that started it together pass the limit
(hetero.launch.trials), so `hetero plan`'s own memory would be taken from the trial's. Under a limit `hetero plan`
replaces itself with this module (os.execv), which runs the planner as a child (`hetero plan ...
--trial-state STATE`) until it asks for a trial (exit `TRIAL_WANTED`, the trial in STATE), runs the trial's
processes (`run_process`: the one way trials run), records what each wrote in STATE, and runs the planner again,
until it ends: its exit code is `hetero plan`'s. Standard library only, so that it stays small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

TRIAL_WANTED = 75  # the planner's exit code when it wants a trial run (BSD's EX_TEMPFAIL: try again)
STOPPED = 3  # a trial process's exit code when it reached the budget and stopped itself


def run_trial(trial: dict, stop_bytes: int) -> list[dict | int | None]:
    """The processes of `trial` (the planner's request: `base` and `tail` of each process's command line, the plan
    file, where they write, how many), each stopped at `stop_bytes`; what each gave (`run_process`)."""
    out = []
    for k in range(trial["count"]):
        result, log = f"{trial['out']}-{k}.json", f"{trial['out']}-{k}.log"
        argv = [*trial["base"], str(os.getpid()), result, trial["plan"], str(stop_bytes), *trial["tail"]]
        out.append(run_process(argv, trial["cwd"], trial["env"], result, log))
    return out


def run_process(argv: list[str], cwd: str | None, env: dict[str, str], out: str, log: str) -> dict | int | None:
    """One trial process (`argv` writes what it measured to `out` as JSON): that, None where it stopped itself at the
    budget, or its exit code where it failed (its stderr is in `log`)."""
    with open(log, "w") as err:
        done = subprocess.run(argv, cwd=cwd if cwd and os.path.isdir(cwd) else None, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=err, env=os.environ | env, check=False)
    if done.returncode in (STOPPED, -9, 137):  # stopped itself, or killed by the memory limit it measured under
        return None
    if done.returncode != 0 or not os.path.exists(out):
        return done.returncode or 1
    with open(out) as f:
        return json.load(f)


def resident_bytes() -> int:
    """What this process holds as a memory limit charges it (VmRSS less RssFile), from /proc; 0 where it cannot."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssFile"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return 0
    return max(0, fields.get("VmRSS", 0) - fields.get("RssFile", 0))


def main(argv: list[str]) -> int:
    """`python -m hetero.launch.waiter STATE PLANNER...`: the planner (`PLANNER ... --trial-state STATE`) and the
    trials it asks for, in turn."""
    state_path, planner = argv[0], argv[1:]
    while True:
        code = subprocess.run([*planner, "--trial-state", state_path], check=False).returncode
        if code != TRIAL_WANTED:
            return code
        with open(state_path) as f:
            state = json.load(f)
        trial = state["pending"]
        trial["stop_bytes"] = trial["budget_bytes"] - resident_bytes()
        trial["processes"] = run_trial(trial, trial["stop_bytes"])
        with open(state_path, "w") as f:
            json.dump(state, f)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
