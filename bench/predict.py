"""How far a plan's prediction is from what runs: `make demo`'s flow (profile, plan, traced run of
examples/train_gpt.py) repeated in fresh processes, since one run on a shared VM drifts by 10-20% on its own.

    .venv/bin/python bench/predict.py [--rounds 3] [--steps 30]          # profile + plan + run, each round
    .venv/bin/python bench/predict.py --plan PLAN [--rounds 3]           # only the traced run repeats
    .venv/bin/python bench/predict.py [...] -- SCRIPT ARGS               # another script (default train_gpt.py)

SCRIPT must take `--steps` and `--log-every` and print `N ms/step` progress lines, as examples/train_gpt.py does;
under `--plan`, it must build the model the plan was made for.

Prints, per round, the predicted and measured iteration and forward and backward per micro-batch with their relative
errors (as `hetero report` computes them), then the median of each, the plain script's step time next to the traced
run's so machine drift shows apart from model error, and how many layers the plan evicts to the slow tier.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hetero.report.compare import compare  # noqa: E402
from hetero.schema import files  # noqa: E402
from hetero.schema.plan import Plan  # noqa: E402
from hetero.schema.run import Run  # noqa: E402
from hetero.schema.sources import profile_of  # noqa: E402

ENTRIES = ("iteration", "forward (per micro-batch)", "backward (per micro-batch)")
HETERO = [sys.executable, "-m", "hetero"]


def sh(argv: list[str]) -> str:
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(argv)}\n{result.stderr[-2000:]}")
    return result.stdout


def step_ms(stdout: str) -> float:
    return float(re.findall(r"(\d+) ms/step", stdout)[-1])


def one_round(work: Path, plan: Path | None, script: list[str]) -> dict[str, float]:
    if plan is None:
        profile, plan = work / "profile.yaml", work / "plan.yaml"
        sh(HETERO + ["profile", "-o", str(profile), "--nvme", str(work / "nvme"), *script])
        sh(HETERO + ["plan", "--profile", str(profile), "-o", str(plan)])
    plain = step_ms(sh([sys.executable, *script]))
    sh(HETERO + ["run", "--plan", str(plan), "--trace", str(work / "run.json"), *script])
    run = files.load(work / "run.yaml", expect=Run)
    loaded = files.load(plan, expect=Plan)
    rows = {r.entry: r for r in compare(run, loaded, profile_of(loaded, plan, "to time its layers"))}
    acts = loaded.activations
    out = {"plain ms/step": plain, "evicting": sum(e.evict_bytes > 0 for e in acts.schedule) if acts else 0}
    for name in ENTRIES:
        out[f"{name} predicted"], out[f"{name} measured"] = rows[name].predicted * 1e3, rows[name].measured * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--plan", type=Path, help="repeat only the traced run, under this plan")
    p.add_argument("script", nargs="*", default=["examples/train_gpt.py"], help="script and its arguments")
    a = p.parse_args()
    script = [*a.script, "--steps", str(a.steps), "--log-every", "10"]
    table = Table(title="predicted vs measured (ms)", title_justify="left")
    table.add_column("round")
    for name in ENTRIES:
        table.add_column(name.replace(" (per micro-batch)", ""), justify="right")
    table.add_column("plain script ms/step", justify="right")
    table.add_column("layers evicting", justify="right")
    errors: dict[str, list[float]] = {name: [] for name in ENTRIES}
    for k in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="hetero-predict-") as tmp:
            r = one_round(Path(tmp), a.plan.resolve() if a.plan else None, script)
        cells = []
        for name in ENTRIES:
            pred, meas = r[f"{name} predicted"], r[f"{name} measured"]
            errors[name].append(meas / pred - 1)
            cells.append(f"{pred:.0f} vs {meas:.0f} ({meas / pred - 1:+.0%})")
        table.add_row(str(k + 1), *cells, f"{r['plain ms/step']:.0f}", str(r["evicting"]))
    table.add_row("median", *(f"{statistics.median(errors[n]):+.0%}" for n in ENTRIES), "", "")
    Console().print(table)


if __name__ == "__main__":
    main()
