"""What the whole process pays: plain PyTorch against `hetero run`, on examples/train_gpt.py, in one run.

    .venv/bin/python bench/memory.py [--sizes 4x256x8x128 6x256x16x256] [--pairs 3] [--steps 8]
                                     [--plan-flags "--emulate axdimm --tier-activations"]
                                     [--env MALLOC_MMAP_THRESHOLD_=131072]

For each size (layers x width x batch x context) this profiles the script, plans it (with `--plan-flags`, or the
default plan), then runs plain and `hetero run` in interleaved pairs, each a fresh process. It prints per
configuration the median peak resident memory (the kernel's high-water mark of the process, from wait4) and the
median step time (steps after the second, from the script's own clock), with their ranges, the ratios to plain,
and the plan's predicted DRAM peak against the measured one. Both configurations run with GOMP_SPINCOUNT=1000
so that libgomp's spinning does not favour whichever has more threads (docs/benchmarks.md), and with `--env`
settings (glibc's allocator tunables, say) for both alike; the profile runs without them.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero.schema import files  # noqa: E402
from hetero.schema.plan import Plan  # noqa: E402
from hetero.units import SIZE  # noqa: E402

HETERO = [sys.executable, "-m", "hetero"]
PROFILE_STEPS = 12
ENV = dict(os.environ, GOMP_SPINCOUNT="1000")


@dataclass(frozen=True)
class Sample:
    peak_bytes: int
    step_s: float


def script_args(size: str, steps: int) -> list[str]:
    layers, width, batch, context = (int(v) for v in size.split("x"))
    return [str(ROOT / "examples/train_gpt.py"), "--n-layer", str(layers), "--n-embd", str(width), "--batch-size",
            str(batch), "--seq-len", str(context), "--steps", str(steps), "--log-every", "1"]


def measure(argv: list[str], cwd: Path, env: dict[str, str]) -> Sample:
    """One fresh process: its peak RSS (wait4's ru_maxrss) and its median step time after the second step."""
    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen(argv, cwd=cwd, env=ENV | env, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        out.seek(0)
        text = out.read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"bench/memory.py: {shlex.join(argv)} failed:\n{text[-2000:]}")
    per_step = [(int(s), float(ms) / 1e3) for s, ms in re.findall(r"step\s+(\d+)\s+loss [\d.]+\s+(\d+) ms/step", text)]
    elapsed = [s * mean for s, mean in per_step]
    steps = [b - a for a, b in zip(elapsed[1:], elapsed[2:])]
    return Sample(peak_bytes=usage.ru_maxrss * 1024, step_s=statistics.median(steps))


def spread(values: list[float], fmt) -> str:
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def bench_size(size: str, pairs: int, steps: int, plan_flags: list[str], env: dict[str, str]) -> list[str]:
    work = Path(tempfile.mkdtemp(prefix="hetero-bench-memory-"))
    args = script_args(size, steps)
    # the profile runs 2 warm-up, 5 measured and 4 disk-timing steps
    subprocess.run([*HETERO, "profile", "--nvme", str(work / "disk"), *script_args(size, max(steps, PROFILE_STEPS))],
                   cwd=work, env=ENV, check=True, capture_output=True)
    subprocess.run([*HETERO, "plan", *plan_flags], cwd=work, env=ENV, check=True, capture_output=True)
    plan = files.load(work / "plan.yaml", expect=Plan)
    sections = [s for s in ("optimizer", "activations") if getattr(plan, s) is not None]
    runs: dict[str, list[Sample]] = {"plain": [], "hetero": []}
    for _ in range(pairs):  # interleaved: drift and neighbours touch both alike
        runs["plain"].append(measure([sys.executable, *args], work, env))
        runs["hetero"].append(measure([*HETERO, "run", *args], work, env))
    plain_peak = statistics.median(s.peak_bytes for s in runs["plain"])
    plain_step = statistics.median(s.step_s for s in runs["plain"])
    hetero_peak = statistics.median(s.peak_bytes for s in runs["hetero"])
    predicted = plan.predicted.peak_bytes.get("dram")
    sections += ["allocator"] if plan.allocator is not None else []
    settings = " ".join(f"{k}={v}" for k, v in env.items())
    rows = [f"{size}: plan {' '.join(plan_flags) or '(default)'}: {', '.join(sections) or 'plain'}"
            + (f"; both under {settings}" if settings else "")]
    for name, samples in runs.items():
        peak = [s.peak_bytes for s in samples]
        step = [s.step_s for s in samples]
        rows.append(f"  {name:7s} peak RSS {spread(peak, SIZE.format_short)} = "
                    f"{statistics.median(peak) / plain_peak:.2f}x   step {spread(step, lambda s: f'{s * 1e3:.0f}ms')}"
                    f" = {statistics.median(step) / plain_step:.2f}x")
    if predicted:
        error = hetero_peak / predicted - 1
        rows.append(f"  predicted DRAM peak {SIZE.format_short(predicted)}: measured {error:+.1%}")
    budget = plan.budget.dram_budget_bytes
    if budget:
        worst = max(s.peak_bytes for s in runs["hetero"])
        rows.append(f"  DRAM budget {SIZE.format_short(budget)}: hetero's highest peak {SIZE.format_short(worst)} "
                    f"({'under' if worst <= budget else 'OVER'}); plan: {plan.budget.why}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["4x256x8x128", "6x256x16x256"],
                   help="layers x width x batch x context of examples/train_gpt.py")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--plan-flags", default="", help="flags for `hetero plan`, e.g. \"--emulate axdimm\"")
    p.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="environment of both runs")
    a = p.parse_args()
    env = dict(item.split("=", 1) for item in a.env)
    for size in a.sizes:
        print("\n".join(bench_size(size, a.pairs, a.steps, shlex.split(a.plan_flags), env)), flush=True)


if __name__ == "__main__":
    main()
