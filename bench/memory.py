"""What the whole process pays: plain PyTorch against `hetero run` under one or more plans, in one run.

    .venv/bin/python bench/memory.py [--script gpt|heldout] [--sizes 4x256x8x128 6x256x16x256] [--vocab N]
                                     [--pairs 3] [--steps 16] [--plans "default; --optimizer-device host"]
                                     [--limit 0.5x|SIZE] [--env MALLOC_MMAP_THRESHOLD_=131072]
                                     [--machine PROFILE] [--profile FILE]

For each size (layers x width x batch x context of examples/train_gpt.py, or of bench/heldout_lm.py with `--script
heldout`) this profiles the script once, makes one plan per `--plans` entry (flags of `hetero plan`, or `default`;
entries separated by ';') from that profile, then runs plain and `hetero run` under every plan in interleaved
rounds, each a fresh process. The profile and the runs run the same command, `--steps` included: a plan predicts the
peak of the training it was profiled on, and plain training's peak with malloc's defaults still rises for steps
after the first ones. Every process runs in a memory cgroup of its own (bench/cgroup.py; as root), and its peak is the
cgroup's `memory.max_usage_in_bytes`: what a memory limit counts. Without root it falls back to wait4's `ru_maxrss`
(VmHWM, which counts library file pages a cgroup does not) and says so. It prints per configuration the median peak
and step time (steps after the second, from the script's own clock) with their ranges, the ratios to plain, the last
loss, plain's peak as the profile recorded it (`measured/profiled`), and each plan's predicted DRAM peak against the measured one (`measured/predicted`).

`--limit` puts the profile, the plans and the hetero runs under a memory cgroup with that limit (`0.5x`: half of
plain's median peak, measured first without a limit); plain runs without one (it would be killed), as the
reference for the loss. The environment is the caller's for every process alike (set OMP_NUM_THREADS and
GOMP_SPINCOUNT outside; GOMP_SPINCOUNT=1000 where unset, so that libgomp's spinning does not favour whichever
process has more threads), plus `--env` settings for the runs; the profile runs without those. `--machine PROFILE`
is given to `hetero profile` (an earlier profile's machine section instead of measuring the machine each time);
`--profile FILE` plans from that profile of the script at its one size instead of profiling it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import cgroup  # noqa: E402

from hetero.schema import files  # noqa: E402
from hetero.schema.plan import Plan  # noqa: E402
from hetero.schema.profile import Profile  # noqa: E402
from hetero.units import SIZE  # noqa: E402

HETERO = [sys.executable, "-m", "hetero"]
ENV = {"GOMP_SPINCOUNT": "1000"} | dict(os.environ)
STEP = re.compile(r"step\s+(\d+)\s+loss ([\d.]+)\s+(\d+) ms/step")


@dataclass(frozen=True)
class Sample:
    peak_bytes: int
    step_s: float
    loss: float


def script_args(script: str, size: str, steps: int, vocab: int | None) -> list[str]:
    layers, width, batch, context = (int(v) for v in size.split("x"))
    if script == "heldout":
        return [str(ROOT / "bench/heldout_lm.py"), "--blocks", str(layers), "--width", str(width), "--heads",
                str(max(1, width // 64)), "--batch", str(batch), "--context", str(context), "--steps", str(steps),
                "--vocab", str(vocab or 8192)]
    return [str(ROOT / "examples/train_gpt.py"), "--n-layer", str(layers), "--n-embd", str(width), "--n-head",
            str(max(1, width // 64)), "--batch-size", str(batch), "--seq-len", str(context), "--steps", str(steps),
            "--log-every", "1", "--vocab", str(vocab or 4096)]


def run(argv: list[str], cwd: Path, env: dict[str, str], limit: int | None = None,
        check: bool = True) -> tuple[int, int, str]:
    """One fresh process: its exit code, its peak (the cgroup's where one can be made) and its output."""
    with tempfile.TemporaryFile("w+") as out:
        if cgroup.unavailable() is None:
            done = cgroup.run(argv, limit, "memory", cwd=cwd, env=ENV | env, stdout=out, stderr=subprocess.STDOUT)
            code, peak = done.exit_code, done.peak_bytes
        else:
            child = subprocess.Popen(argv, cwd=cwd, env=ENV | env, stdout=out, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(child.pid, 0)
            code, peak = os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024
        out.seek(0)
        text = out.read()
    if check and code != 0:
        sys.exit(f"bench/memory.py: {shlex.join(argv)} failed ({code}):\n{text[-2000:]}")
    return code, peak, text


def sample(argv: list[str], cwd: Path, env: dict[str, str], limit: int | None = None) -> Sample:
    _, peak, text = run(argv, cwd, env, limit)
    found = [(int(s), float(loss), float(ms) / 1e3) for s, loss, ms in STEP.findall(text)]
    elapsed = [s * mean for s, _, mean in found]
    steps = [b - a for a, b in zip(elapsed[1:], elapsed[2:])]
    return Sample(peak_bytes=peak, step_s=statistics.median(steps), loss=found[-1][1])


def spread(values: list[float], fmt) -> str:
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def bench_size(script: str, size: str, args: argparse.Namespace, env: dict[str, str]) -> list[str]:
    work = Path(tempfile.mkdtemp(prefix="hetero-bench-memory-"))
    try:  # the profile, the plans and the disk tier's files: removed however the bench ends
        return measure_size(script, size, args, env, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure_size(script: str, size: str, args: argparse.Namespace, env: dict[str, str], work: Path) -> list[str]:
    argv = script_args(script, size, args.steps, args.vocab)
    runs: dict[str, list[Sample]] = {"plain": []}
    limit = None
    if args.limit:
        runs["plain"].append(sample([sys.executable, *argv], work, env))
        plain = runs["plain"][0].peak_bytes
        limit = int(float(args.limit[:-1]) * plain) if args.limit.endswith("x") else SIZE.parse(args.limit)
    if args.profile:
        shutil.copyfile(args.profile, work / "profile.yaml")
        profiled = f"profile {args.profile}"
    else:
        profile = [*HETERO, "profile", "--nvme", str(work / "disk"),
                   *(["--machine", args.machine] if args.machine else []),
                   *argv]
        code, profile_peak, text = run(profile, work, {}, limit, check=False)
        if code != 0:
            return [f"{size}: hetero profile under {SIZE.format_short(limit)} exited {code}: {text[-300:]}"]
        profiled = f"profile peaked at {SIZE.format_short(profile_peak)}"
    plans: dict[str, Plan | str] = {}
    for k, flags in enumerate(args.plans):
        out = work / f"plan-{k}.yaml"
        code, _, text = run([*HETERO, "plan", "-o", str(out), *shlex.split(flags)], work, {}, limit, check=False)
        plans[flags] = files.load(out, expect=Plan) if code == 0 else \
            f"hetero plan exited {code}: {text.strip().splitlines()[-1] if text.strip() else ''}"
        if code == 0:
            runs[flags] = []
    for _ in range(args.pairs):  # interleaved: drift and neighbours touch every configuration alike
        if not args.limit or len(runs["plain"]) < args.pairs:
            runs["plain"].append(sample([sys.executable, *argv], work, env))
        for k, flags in enumerate(args.plans):
            if flags in runs:
                runs[flags].append(sample([*HETERO, "run", "--plan", str(work / f"plan-{k}.yaml"), *argv], work,
                                          env, limit))
    how = "cgroup max_usage_in_bytes" if cgroup.unavailable() is None else "ru_maxrss (VmHWM: file pages included)"
    under = f", hetero under a {SIZE.format_short(limit)} cgroup" if limit else ""
    rows = [f"{script} {size} ({shlex.join(argv[1:])}): peaks by {how}{under}; {profiled}"]
    plain_peak = statistics.median(s.peak_bytes for s in runs["plain"])
    plain_step = statistics.median(s.step_s for s in runs["plain"])
    rows.append(_row("plain", runs["plain"], plain_peak, plain_step))
    rows.extend(_profiled_plain(work / "profile.yaml", plain_peak))
    for flags, plan in plans.items():
        name = f"plan {flags or '(default)'}"
        if isinstance(plan, str):
            rows.append(f"  {name}: {plan}")
            continue
        rows.append(_row(name, runs[flags], plain_peak, plain_step) + f"  [{_sections(plan)}]")
        predicted = plan.predicted.peak_bytes.get("dram")
        measured = statistics.median(s.peak_bytes for s in runs[flags])
        if predicted:
            rows.append(f"    predicted DRAM peak {SIZE.format_short(predicted)}: measured/predicted "
                        f"{measured / predicted:.3f} ({measured / predicted - 1:+.1%})")
        budget = plan.budget.dram_budget_bytes
        if budget:
            worst = max(s.peak_bytes for s in runs[flags])
            rows.append(f"    DRAM budget {SIZE.format_short(budget)}: highest peak {SIZE.format_short(worst)} "
                        f"({'under' if worst <= budget else 'OVER'}); {plan.budget.why}")
    return rows


def _profiled_plain(path: Path, plain_peak: float) -> list[str]:
    """The profile's plain peak (what malloc's-defaults plans are predicted from) against plain's measured one."""
    memory = files.load(path, expect=Profile).memory if path.exists() else None
    if memory is None:
        return []
    how = "estimated" if memory.dram_peak_estimated else "measured in the profile's process"
    return [f"    profile: plain peak {SIZE.format_short(memory.dram_peak_bytes)} ({how}): measured/profiled "
            f"{plain_peak / memory.dram_peak_bytes:.3f}"]


def _row(name: str, samples: list[Sample], plain_peak: float, plain_step: float) -> str:
    peak = [s.peak_bytes for s in samples]
    step = [s.step_s for s in samples]
    loss = statistics.median(s.loss for s in samples)
    return (f"  {name:28s} peak {spread(peak, SIZE.format_short)} = {statistics.median(peak) / plain_peak:.2f}x   "
            f"step {spread(step, lambda s: f'{s * 1e3:.0f}ms')} = {statistics.median(step) / plain_step:.2f}x   "
            f"last loss {loss:.4f}")


def _sections(plan: Plan) -> str:
    on = [s for s in ("optimizer", "activations", "allocator", "update_in_backward", "recompute")
          if getattr(plan, s, None) is not None]
    return ", ".join(on) or "plain"


def main() -> None:
    cgroup.end_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", choices=("gpt", "heldout"), default="gpt")
    p.add_argument("--sizes", nargs="+", default=["4x256x8x128", "6x256x16x256"],
                   help="layers x width x batch x context")
    p.add_argument("--vocab", type=int, default=None, help="default: 4096 (gpt), 8192 (heldout)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="the script's steps, profiled and run")
    p.add_argument("--plans", default="default", help="plans to run, separated by ';': flags of `hetero plan`, or "
                                                      "`default` (e.g. \"default; --optimizer-device host\")")
    p.add_argument("--limit", default=None, help="profile, plan and run hetero under this cgroup limit "
                                                 "(SIZE, or 0.5x: of plain's peak)")
    p.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="environment of the runs")
    p.add_argument("--machine", default=None, metavar="PROFILE",
                   help="`hetero profile --machine PROFILE`: an earlier profile's machine, not measured each time")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="plan from this profile of the script at its one size instead of profiling it")
    a = p.parse_args()
    if a.profile and (a.limit or len(a.sizes) > 1):
        p.error("--profile is one size's profile, taken without a limit: not with --limit or several --sizes")
    env = dict(item.split("=", 1) for item in a.env)
    a.plans = ["" if flags.strip() == "default" else flags.strip() for flags in a.plans.split(";")]
    for size in a.sizes:
        print("\n".join(bench_size(a.script, size, a, env)), flush=True)


if __name__ == "__main__":
    main()
