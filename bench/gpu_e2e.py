"""A script end to end on a GPU, as a user would run it: plain, then `hetero profile`, `hetero plan` and `hetero run`
with the default plan, and (with --half) a plan for half of plain training's reserved GPU peak, run under that
budget. Plain and the default plan run interleaved, twice each. Prints a table (step time against plain, final loss,
weight sum, torch's reserved and allocated peaks, the plan's predictions) and the checks the issues set; writes
everything it ran and read into --out. `--profile FILE` plans from FILE, an earlier profile of the script (another
run's --out/profile.yaml), instead of running `hetero profile` again.

    python bench/gpu_e2e.py --out /tmp/e2e --half -- bench/heldout_lm.py --device cuda --tied --width 1024 \\
        --blocks 8 --heads 16 --vocab 16384 --batch 8 --context 512 --steps 30 --eval-batches 0 --weight-sum
    python bench/gpu_e2e.py --out /tmp/e2e -- examples/train_gpt.py --device cuda --n-layer 8 --n-embd 512 \\
        --n-head 8 --batch-size 8 --seq-len 256 --steps 40
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero.units import SIZE  # noqa: E402

RESERVED = re.compile(r"gpu peak reserved ([0-9.]+[KMGT]?i?B)\b.*; allocated ([0-9.]+[KMGT]?i?B)")
LOSS = re.compile(r"(?:final loss|loss) ([-+0-9.e]+)")
WEIGHTS = re.compile(r"weight sum ([-+0-9.e]+)")
STEADY = re.compile(r"steady ([0-9.]+) ms/step")


@dataclass
class Outcome:
    name: str
    ok: bool
    seconds: float
    ms_per_step: float | None = None
    loss: float | None = None
    weights: float | None = None
    reserved: int | None = None
    allocated: int | None = None
    error: str = ""


def peaks_worker(argv: list[str]) -> None:
    """`--peaks SCRIPT ARGS`: run the script as `python SCRIPT ARGS` would, then print torch's GPU peaks."""
    import torch

    sys.argv = argv
    sys.path[0] = str(Path(argv[0]).resolve().parent)
    runpy.run_path(argv[0], run_name="__main__")
    if not torch.cuda.is_initialized():  # the script ran on the CPU
        return
    print(f"hetero: gpu peak reserved {SIZE.format_short(torch.cuda.max_memory_reserved())}; allocated "
          f"{SIZE.format_short(torch.cuda.max_memory_allocated())}", file=sys.stderr)


def run(name: str, command: list[str], out: Path, timeout: float) -> Outcome:
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, text = -1, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout:.0f} s"
        text = text if isinstance(text, str) else text.decode(errors="replace")
    (out / f"{name}.log").write_text("$ " + " ".join(command) + "\n" + text)
    o = Outcome(name, code == 0, time.monotonic() - start)
    if code != 0:
        o.error = f"exit {code}: " + " / ".join(text.strip().splitlines()[-3:])
    for pattern, field, parse in ((LOSS, "loss", float), (WEIGHTS, "weights", float), (STEADY, "ms_per_step", float)):
        found = pattern.findall(text)
        if found:
            setattr(o, field, parse(found[-1]))
    found = RESERVED.findall(text)
    if found:
        o.reserved, o.allocated = SIZE.parse(found[-1][0]), SIZE.parse(found[-1][1])
    return o


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for logs, profile, plans")
    p.add_argument("--half", action="store_true", help="also plan and run at half of plain's reserved GPU peak")
    p.add_argument("--rounds", type=int, default=2, help="interleaved plain / default-plan rounds")
    p.add_argument("--timeout", type=float, default=120, help="seconds per command")
    p.add_argument("--profile", type=Path, default=None, metavar="FILE",
                   help="plan from this earlier profile of the script instead of running `hetero profile`")
    p.add_argument("--peaks", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("script", nargs=argparse.REMAINDER)
    a = p.parse_args()
    script = [x for x in a.script if x != "--"] if a.script[:1] == ["--"] else a.script
    if a.peaks:
        return peaks_worker(script) or 0
    a.out.mkdir(parents=True, exist_ok=True)
    python, hetero = sys.executable, [sys.executable, "-m", "hetero"]
    profile = a.profile.resolve() if a.profile else a.out / "profile.yaml"  # the commands run from the repository root
    default, half = a.out / "plan.yaml", a.out / "plan-half.yaml"
    rows: list[Outcome] = []
    if a.profile is None:
        rows.append(run("profile", [*hetero, "profile", "-o", str(profile), *script], a.out, a.timeout * 2))
    if all(r.ok for r in rows):
        rows.append(run("plan", [*hetero, "plan", "--profile", str(profile), "-o", str(default)], a.out, a.timeout))
    for k in range(a.rounds):
        rows.append(run(f"plain-{k}", [python, __file__, "--peaks", "--out", str(a.out), *script], a.out, a.timeout))
        if default.exists():
            rows.append(run(f"hetero-{k}", [*hetero, "run", "--plan", str(default), *script], a.out, a.timeout))
    plain = [r for r in rows if r.name.startswith("plain-") and r.ok]
    if a.half and plain and plain[0].reserved:
        budget = plain[0].reserved // 2
        made = run("plan-half", [*hetero, "plan", "--profile", str(profile), "-o", str(half), "--gpu-memory",
                                 f"{budget}B"], a.out, a.timeout)
        rows.append(made)
        if made.ok:
            rows.append(run("hetero-half", [*hetero, "run", "--plan", str(half), *script], a.out, a.timeout))
    (a.out / "outcomes.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    report(rows, default, half)
    return 0 if all(r.ok for r in rows) else 1


def report(rows: list[Outcome], default: Path, half: Path) -> None:
    from hetero.plan.model import GPU
    from hetero.schema import files
    from hetero.schema.plan import Plan

    plans = {"hetero": files.load(default, expect=Plan) if default.exists() else None,
             "hetero-half": files.load(half, expect=Plan) if half.exists() else None}
    plain = [r for r in rows if r.name.startswith("plain-") and r.ok]
    base = statistics.median(r.ms_per_step for r in plain if r.ms_per_step) if plain else None
    print(f"{'run':12} {'ms/step':>8} {'vs plain':>8} {'final loss':>12} {'weight sum':>20} {'reserved':>9} "
          f"{'allocated':>9} {'predicted':>18}")
    for r in rows:
        if r.name in ("profile", "plan", "plan-half"):
            print(f"{r.name:12} {'ok' if r.ok else r.error} ({r.seconds:.0f} s)")
            continue
        plan = plans["hetero-half" if r.name == "hetero-half" else "hetero"] if r.name.startswith("hetero") else None
        predicted = "" if plan is None else \
            f"{plan.predicted.iteration_s * 1e3:.1f} ms, {SIZE.format_short(plan.predicted.peak_bytes.get(GPU, 0))}"
        if not r.ok:
            print(f"{r.name:12} {r.error}")
            continue
        ratio = f"{r.ms_per_step / base:.3f}x" if base and r.ms_per_step else ""
        print(f"{r.name:12} {r.ms_per_step or 0:8.2f} {ratio:>8} {r.loss or 0:12.6f} {r.weights or 0:20.10f} "
              f"{SIZE.format_short(r.reserved or 0):>9} {SIZE.format_short(r.allocated or 0):>9} {predicted:>18}")
    checks(rows, plans, base)


def noise(by: dict[str, Outcome]) -> str:
    """Whether plain's own runs differ as much (a CUDA backward that is not deterministic run to run)."""
    first, second = by.get("plain-0"), by.get("plain-1")
    if second is None or not second.ok:
        return " (one plain run: whether plain's own runs differ is not known)"
    same = (first.weights, first.loss) == (second.weights, second.loss)
    return " (plain's two runs are equal: hetero's run is not plain's)" if same else \
        f" (plain's two runs differ too: {first.weights!r} and {second.weights!r})"


def checks(rows: list[Outcome], plans: dict, base: float | None) -> None:
    from hetero.plan.model import GPU

    by = {r.name: r for r in rows}
    plain = by.get("plain-0")
    default = [r for r in rows if r.name.startswith("hetero-") and r.name != "hetero-half" and r.ok]
    if base and default and all(r.ms_per_step for r in default):
        ratio = statistics.median(r.ms_per_step for r in default) / base
        print(f"check: the default plan's step is {ratio:.3f}x plain's (goal where the model fits: <= 1.02): "
              f"{'met' if ratio <= 1.02 else 'not met'}")
    if plain and plain.ok and default and default[0].weights is not None:
        same = default[0].weights == plain.weights and default[0].loss == plain.loss
        print(f"check: default plan's weight sum {default[0].weights!r} and loss {default[0].loss!r} against "
              f"plain's {plain.weights!r}, {plain.loss!r}: {'equal' if same else 'differ'}{'' if same else noise(by)}")
    half, plan = by.get("hetero-half"), plans.get("hetero-half")
    if half is not None and half.ok and plan is not None and plain is not None and half.reserved:
        budget, predicted = plan.budget.gpu_memory_bytes, plan.predicted.peak_bytes.get(GPU)
        print(f"check: half-budget run reserved {SIZE.format_short(half.reserved)} under the budget "
              f"{SIZE.format_short(budget)}: {'met' if half.reserved <= budget else 'not met'}")
        error = half.reserved / predicted - 1
        print(f"check: predicted GPU peak {SIZE.format_short(predicted)}, measured {error:+.1%} (goal within 5%): "
              f"{'met' if abs(error) <= 0.05 else 'not met'}")
        if half.loss is not None and plain.loss is not None:
            close = abs(half.loss - plain.loss) <= 1e-5 + 1.3e-6 * abs(plain.loss)
            print(f"check: half-budget final loss {half.loss!r} against plain's {plain.loss!r}: "
                  f"{'close (torch.testing float32 tolerance)' if close else 'not close'}; weight sum "
                  f"{half.weights!r} against {plain.weights!r}")
        if half.ms_per_step and base:
            predicted_ms = plan.predicted.iteration_s * 1e3
            print(f"half-budget step: {half.ms_per_step / base:.2f}x plain's; predicted {predicted_ms:.1f} ms, "
                  f"measured {half.ms_per_step / predicted_ms - 1:+.0%}")


if __name__ == "__main__":
    sys.exit(main())
