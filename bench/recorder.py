"""What recording costs: examples/train_gpt.py under a plan, with and without `hetero run --trace`, side by side.

    .venv/bin/python bench/recorder.py [--plan plans/gpt-tiny-cpu.plan.yaml] [--steps 12] [--rounds 3] [--keep DIR]
                                       [-- SCRIPT ARGS]

SCRIPT ARGS (default: examples/train_gpt.py, the bundled plan's model) must build the model the plan was made for;
the script must print `N ms/step` progress lines and take `--steps` and `--log-every`, as examples/train_gpt.py does.
`--keep DIR` keeps the last traced run's run.json and run.yaml there (for bench/lanes.py).

Each configuration runs in a fresh process, taking turns round by round, so drift in a shared machine hits both
alike. The step time is the script's own ms/step over its steps after the first; the traced run records all but the
first step (--trace-steps), so every timed step is a recorded one. Prints the median per configuration and the
ratio, and the recorder's own estimate (time in its hooks over step time) from run.yaml.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step_ms(stdout: str) -> float:
    """Mean ms/step of the progress lines after the first (which holds the warm-up step)."""
    values = [float(ms) for ms in re.findall(r"(\d+) ms/step", stdout)][1:]
    return statistics.mean(values)


def one(plan: str, script: list[str], steps: int, trace: Path | None) -> float:
    record = ["--trace", str(trace), "--trace-steps", str(steps - 1)] if trace else []
    cmd = [sys.executable, "-m", "hetero", "run", "--plan", plan, *record, *script,
           "--steps", str(steps), "--log-every", "1"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    return step_ms(result.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="plans/gpt-tiny-cpu.plan.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keep", type=Path, default=None, help="folder for the last traced run's run.json and run.yaml")
    p.add_argument("script", nargs="*", default=["examples/train_gpt.py"], help="script and its arguments")
    args = p.parse_args()
    times: dict[str, list[float]] = {"untraced": [], "traced": []}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "run.json"
        for r in range(args.rounds):
            times["untraced"].append(one(args.plan, args.script, args.steps, None))
            times["traced"].append(one(args.plan, args.script, args.steps, trace))
            print(f"round {r + 1}: untraced {times['untraced'][-1]:.1f} ms/step, traced {times['traced'][-1]:.1f}")
        own = re.search(r"overhead: ([\d.]+)", (Path(tmp) / "run.yaml").read_text()).group(1)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for name in ("run.json", "run.yaml"):
                shutil.copy(Path(tmp) / name, args.keep / name)
    base, traced = (statistics.median(times[k]) for k in ("untraced", "traced"))
    print(f"\nmedian ms/step: untraced {base:.1f}, traced {traced:.1f}; traced/untraced {traced / base:.3f}x "
          f"(the recorder's own estimate: {float(own):.2%} of step time in its hooks)")


if __name__ == "__main__":
    main()
