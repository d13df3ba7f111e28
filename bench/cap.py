"""Train what does not fit: the largest model each configuration trains under a memory cgroup limit.

    sudo .venv/bin/python bench/cap.py [--limits 768MiB 1GiB 1536MiB] [--n-embd 768 --batch-size 1 --seq-len 128]
                                       [--steps 4] [--repeats 3] [--max-layers 48] [--profile-uncapped]
                                       [--script gpt|heldout] [--vocab N] [--machine PROFILE] [--at LAYERS]

The script is examples/train_gpt.py, or with `--script heldout` bench/heldout_lm.py (a GPT-style LM written apart
from it: pre-norm blocks with F.scaled_dot_product_attention, SwiGLU, an untied head, AdamW with two parameter
groups; `--n-embd`, `--batch-size`, `--seq-len` and `--vocab` map onto its width, batch, context and vocabulary).

Three configurations, each process in its own memory cgroup with the same limit (bench/cgroup.py; swap capped too):
plain PyTorch, plain with `--checkpoint` (torch.utils.checkpoint on every block), and hetero, whose `hetero profile`,
`hetero plan` (the budget: the cgroup limit the profile found) and `hetero run` all run under the limit. A size
"trains" when every process of the configuration exits 0. For each limit the benchmark finds by search the largest
number of layers each configuration trains (the model grows in layers at a fixed width, so parameters grow with it;
a larger model is assumed never to fit where a smaller one did not), then times all three at the largest size all
three train: `--repeats` rounds, interleaved, each a fresh process under the limit, step times from the script's own
clock (steps after the first), medians with ranges.

`--profile-uncapped` profiles outside the cgroup and gives `hetero plan --dram-budget LIMIT` instead: a diagnostic
for a profile that cannot yet keep a budget, marked in the table. `--machine PROFILE` is given to every
`hetero profile` (an earlier profile's machine section instead of measuring the machine each time). Needs root
(cgroups); says what to run otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import cgroup  # noqa: E402

from hetero.schema import files  # noqa: E402
from hetero.schema.plan import Plan  # noqa: E402
from hetero.units import SIZE, short_size  # noqa: E402

CONFIGS = ("plain", "checkpoint", "hetero")
HETERO = [sys.executable, "-m", "hetero"]
# libgomp's spinning would favour whoever has more threads: the caller's settings (OMP_NUM_THREADS, GOMP_SPINCOUNT)
# go to every process alike, GOMP_SPINCOUNT=1000 where unset
ENV = {"GOMP_SPINCOUNT": "1000"} | dict(os.environ)
STEP_LINE = re.compile(r"step\s+(\d+)\s+loss [\d.]+\s+(\d+) ms/step")
WEIGHTS = re.compile(r"^weight sum (\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Shape:
    """The script at a fixed width and batch; the number of layers varies."""

    n_embd: int
    batch: int
    seq: int
    vocab: int
    steps: int
    script: str = "gpt"

    def argv(self, layers: int, checkpoint: bool = False) -> list[str]:
        heads = str(max(1, self.n_embd // 64))
        if self.script == "heldout":
            return [str(ROOT / "bench/heldout_lm.py"), "--blocks", str(layers), "--width", str(self.n_embd),
                    "--heads", heads, "--batch", str(self.batch), "--context", str(self.seq), "--vocab",
                    str(self.vocab), "--steps", str(self.steps), "--log-every", "1", "--weight-sum",
                    *(["--checkpoint"] if checkpoint else [])]
        return [str(ROOT / "examples/train_gpt.py"), "--n-layer", str(layers), "--n-embd", str(self.n_embd),
                "--n-head", heads, "--batch-size", str(self.batch), "--seq-len",
                str(self.seq), "--vocab", str(self.vocab), "--steps", str(self.steps), "--log-every", "1",
                "--weight-sum", *(["--checkpoint"] if checkpoint else [])]

    def params(self, layers: int) -> int:
        """The model's parameters: embeddings and head, blocks (attention, feed-forward, two LayerNorms), norm."""
        c = self.n_embd
        if self.script == "heldout":  # untied head, bias-free linears, SwiGLU's hidden width rounded up to 256
            hidden = 256 * math.ceil(8 * c / 3 / 256)
            return 2 * self.vocab * c + self.seq * c + layers * (4 * c * c + 3 * c * hidden + 4 * c) + 2 * c
        return self.vocab * c + self.seq * c + layers * (12 * c * c + 13 * c) + 2 * c


@dataclass
class Trial:
    """One configuration at one size under one limit: whether it trained to the end, and what it measured."""

    config: str
    layers: int
    ok: bool
    why: str = ""  # how it failed: "killed by the limit in hetero profile", "hetero plan exited 3: ..."
    peak_bytes: int = 0  # the cgroup's peak of the process that trains (the script, or hetero run)
    profile_peak_bytes: int = 0  # hetero only: the cgroup's peak while profiling
    steps_s: list[float] = field(default_factory=list)
    plan_why: str = ""  # hetero only: what the plan turned on to keep the budget
    weight_sum: str = ""  # the final weights' sum the script printed (plain's and hetero's must agree)


def step_times(text: str) -> list[float]:
    """Per-step seconds after the first, from the script's running mean ("step k ... M ms/step")."""
    elapsed = [int(k) * float(ms) / 1e3 for k, ms in STEP_LINE.findall(text)]
    return [b - a for a, b in itertools.pairwise(elapsed)]


def weight_sum(text: str) -> str:
    found = WEIGHTS.findall(text)
    return found[-1] if found else ""


def capped(argv: list[str], limit: int | None, work: Path, name: str) -> tuple[cgroup.Capped, str]:
    log = work / f"{name}.log"
    with open(log, "w") as out:
        result = cgroup.run(argv, limit, f"cap-{name}", cwd=work, env=ENV, stdout=out, stderr=out)
    return result, log.read_text()


def failure(stage: str, result: cgroup.Capped, text: str) -> str:
    said = [line for line in text.splitlines() if line.startswith("error: below the floor")]
    if result.oom_killed:  # hetero profile says where (hetero.launch.guard): the floor, or the phase it was in
        return f"killed by the limit in {stage}" + (": below the floor" if said else "")
    last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    return f"{stage} exited {result.exit_code}: {last[0][:160]}"


def run_plain(shape: Shape, layers: int, limit: int, work: Path, checkpoint: bool) -> Trial:
    config = "checkpoint" if checkpoint else "plain"
    result, text = capped([sys.executable, *shape.argv(layers, checkpoint)], limit, work, config)
    if not result.ok:
        return Trial(config, layers, False, failure("the script", result, text), result.peak_bytes)
    return Trial(config, layers, True, peak_bytes=result.peak_bytes, steps_s=step_times(text),
                 weight_sum=weight_sum(text))


def prepare_hetero(shape: Shape, layers: int, limit: int, work: Path, uncapped_profile: bool,
                   machine_file: str | None = None) -> Trial | None:
    """Profile and plan under the limit (or the profile outside it); a failed Trial, or None when plan.yaml exists."""
    reuse = ["--machine", machine_file] if machine_file else []
    profile = [*HETERO, "profile", "--warmup", "1", "--steps", "2", "--nvme", str(work / "nvme"), *reuse,
               *shape.argv(layers)]
    plan = [*HETERO, "plan"] + (["--dram-budget", str(limit)] if uncapped_profile else [])
    profiled, text = capped(profile, None if uncapped_profile else limit, work, "profile")
    if not profiled.ok:
        return Trial("hetero", layers, False, failure("hetero profile", profiled, text), 0, profiled.peak_bytes)
    planned, text = capped(plan, limit, work, "plan")
    if not planned.ok:
        return Trial("hetero", layers, False, failure("hetero plan", planned, text), 0, profiled.peak_bytes)
    return Trial("hetero", layers, True, profile_peak_bytes=profiled.peak_bytes)


def run_hetero(shape: Shape, layers: int, limit: int, work: Path, prepared: Trial) -> Trial:
    result, text = capped([*HETERO, "run", *shape.argv(layers)], limit, work, "run")
    why = files.load(work / "plan.yaml", expect=Plan).budget.why
    if not result.ok:
        return Trial("hetero", layers, False, failure("hetero run", result, text), result.peak_bytes,
                     prepared.profile_peak_bytes, plan_why=why)
    return Trial("hetero", layers, True, "", result.peak_bytes, prepared.profile_peak_bytes, step_times(text), why,
                 weight_sum(text))


class Bench:
    """The trials of one limit; hetero's work folders (profile, plan) are kept per size for the timing rounds."""

    def __init__(self, shape: Shape, limit: int, uncapped_profile: bool, machine_file: str | None = None):
        self.shape, self.limit, self.uncapped_profile, self.machine_file = shape, limit, uncapped_profile, machine_file
        self.root = Path(tempfile.mkdtemp(prefix="hetero-bench-cap-"))
        self.prepared: dict[int, Trial] = {}
        self.trials: list[Trial] = []

    def work(self, config: str, layers: int) -> Path:
        folder = self.root / f"{config}-{layers}"
        folder.mkdir(exist_ok=True)
        return folder

    def trial(self, config: str, layers: int) -> Trial:
        work = self.work(config, layers)
        if config != "hetero":
            result = run_plain(self.shape, layers, self.limit, work, config == "checkpoint")
        else:
            if layers not in self.prepared:
                self.prepared[layers] = prepare_hetero(self.shape, layers, self.limit, work, self.uncapped_profile,
                                                       self.machine_file) or Trial("hetero", layers, True)
            prepared = self.prepared[layers]
            result = prepared if not prepared.ok else run_hetero(self.shape, layers, self.limit, work, prepared)
        self.trials.append(result)
        state = "trains" if result.ok else f"fails: {result.why}"
        peak = result.peak_bytes or result.profile_peak_bytes  # hetero killed while profiling: the profile's
        print(f"  {short_size(self.limit)} {config:10s} {layers:3d} layers: {state} (peak {short_size(peak)})",
              file=sys.stderr, flush=True)
        return result

    def largest(self, config: str, start: int, cap: int) -> int:
        """The most layers `config` trains, by galloping up from `start` and bisecting; 0 if one layer fails."""
        start = max(1, min(start, cap))
        if not self.trial(config, start).ok:
            return self.bisect(config, 0, start)
        good, step = start, max(1, start // 2)
        while good < cap:
            nxt = min(cap, good + step)
            if not self.trial(config, nxt).ok:
                return self.bisect(config, good, nxt)
            good, step = nxt, step * 2
        return good

    def bisect(self, config: str, good: int, bad: int) -> int:
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if self.trial(config, mid).ok else (good, mid)
        return good

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    ms = [v * 1e3 for v in values]
    return f"{statistics.median(ms):.0f} ms ({min(ms):.0f}-{max(ms):.0f})"


def timing(bench: Bench, layers: int, repeats: int) -> dict[str, list[float]]:
    """Each configuration's median step per run at `layers`, `repeats` interleaved rounds (drift touches all)."""
    runs: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for _ in range(repeats):
        for config in CONFIGS:
            trial = bench.trial(config, layers)
            if trial.ok and trial.steps_s:
                runs[config].append(statistics.median(trial.steps_s))
    return runs


def growth(shape: Shape, trials: list[Trial]) -> str:
    """How the cgroup peak grows with the parameters between the smallest and largest size that trained."""
    peaks: dict[int, int] = {}
    for t in trials:
        if t.ok and t.peak_bytes:
            peaks[t.layers] = min(peaks.get(t.layers, t.peak_bytes), t.peak_bytes)
    if len(peaks) < 2:
        return ""
    small, large = min(peaks), max(peaks)
    per_param = (peaks[large] - peaks[small]) / (shape.params(large) - shape.params(small))
    return f", grows {per_param:.1f} B/param ({small}-{large} layers)"


def bench_limit(shape: Shape, limit: int, start: int, args: argparse.Namespace) -> tuple[list[str], list[str], int]:
    """One limit's table row and notes, and plain's largest size (the next limit's starting point)."""
    bench = Bench(shape, limit, args.profile_uncapped, args.machine)
    try:
        if args.at:  # no search: each configuration at the one size, timed where it trains
            most = {c: args.at if bench.trial(c, args.at).ok else 0 for c in CONFIGS}
        else:
            most = {"plain": bench.largest("plain", start, args.max_layers)}
            for config in ("checkpoint", "hetero"):
                most[config] = bench.largest(config, max(1, most["plain"]), args.max_layers)
        common = args.at or min(most.values())
        runs = timing(bench, common, args.repeats) if common else {c: [] for c in CONFIGS}
    finally:
        bench.cleanup()
    sizes = [f"{most[c]} ({shape.params(most[c]) / 1e6:.1f}M)" if most[c] else "none" for c in CONFIGS]
    hetero_params = shape.params(most["hetero"]) if most["hetero"] else 0
    ratio = f"{hetero_params / shape.params(most['plain']):.2f}x" if most["plain"] else "-"
    slower = (f"{statistics.median(runs['hetero']) / statistics.median(runs['checkpoint']):.2f}x"
              if runs["hetero"] and runs["checkpoint"] else "-")
    row = (f"| {short_size(limit)} | {' | '.join(sizes)} | {ratio} | {common or '-'} | {spread(runs['plain'])} | "
           f"{spread(runs['checkpoint'])} | {spread(runs['hetero'])} | {slower} |")
    notes = [f"{short_size(limit)}:"]
    for config in CONFIGS:
        tried = [t for t in bench.trials if t.config == config]
        fits = [t for t in tried if t.ok and t.layers == most[config]]
        fails = sorted((t for t in tried if not t.ok), key=lambda t: t.layers)
        if fits:
            extra = f", profiled at {short_size(fits[0].profile_peak_bytes)}" if config == "hetero" else ""
            grows = growth(shape, tried) if config != "hetero" else ""  # hetero's plan changes with the size
            notes.append(f"  {config}: {most[config]} layers peak {short_size(fits[0].peak_bytes)}{extra}{grows}")
        if fails:
            notes.append(f"  {config}: {fails[0].layers} layers {fails[0].why}")
    for t in bench.trials:
        if t.config == "hetero" and t.ok and t.layers in (common, most["hetero"]) and t.plan_why:
            notes.append(f"  hetero's plan at {t.layers} layers: {t.plan_why}")
            if t.layers == most["hetero"]:
                break
    sums = {c: sorted({t.weight_sum for t in bench.trials if t.config == c and t.ok and t.layers == common
                       and t.weight_sum}) for c in CONFIGS}
    if common:
        notes.append(f"  final weight sums at {common} layers: " +
                     "; ".join(f"{c} {', '.join(sums[c]) or '-'}" for c in CONFIGS))
    return [row], notes, most["plain"]


def machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    swap = "on" if cgroup.swap_on() else "off"
    return (f"{platform.node()}: {os.cpu_count()} CPUs, {short_size(memory)} RAM, swap {swap}, Linux "
            f"{platform.release()}, torch {torch.__version__}, Python {platform.python_version()}")


def main() -> int:
    cgroup.end_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limits", nargs="+", default=["768MiB", "1GiB", "1536MiB"])
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--script", choices=("gpt", "heldout"), default="gpt",
                   help="examples/train_gpt.py, or bench/heldout_lm.py (widths, batch, context and vocab alike)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps of every run (the profile measures 1+2)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds at the largest common size")
    p.add_argument("--max-layers", type=int, default=48)
    p.add_argument("--at", type=int, default=0, metavar="LAYERS",
                   help="no search: try and time every configuration at this many layers")
    p.add_argument("--profile-uncapped", action="store_true",
                   help="profile outside the cgroup and plan with --dram-budget LIMIT (a diagnostic)")
    p.add_argument("--machine", default=None, metavar="PROFILE",
                   help="`hetero profile --machine PROFILE`: an earlier profile's machine, not measured each time")
    args = p.parse_args()
    reason = cgroup.unavailable()
    if reason:
        print(f"bench/cap.py: {reason}", file=sys.stderr)
        return 2
    shape = Shape(args.n_embd, args.batch_size, args.seq_len, args.vocab, args.steps, args.script)
    print(f"# {shlex.join(['bench/cap.py', *sys.argv[1:]])}\n# {machine()}")
    print(f"# {shape.argv(0)[0]} --n-embd {shape.n_embd} --batch-size {shape.batch} --seq-len {shape.seq} "
          f"--vocab {shape.vocab} --steps {shape.steps}, layers varied"
          + ("; hetero profiled OUTSIDE the cgroup (--profile-uncapped)" if args.profile_uncapped else ""))
    print("| limit | plain: layers (params) | checkpoint | hetero | hetero / plain params | largest common | "
          "plain step | checkpoint step | hetero step | hetero / checkpoint |\n" + "| --- " * 10 + "|")
    all_notes: list[str] = []
    start = 1
    for limit in sorted(SIZE.parse(text) for text in args.limits):
        rows, notes, start = bench_limit(shape, limit, start, args)
        print("\n".join(rows), flush=True)
        all_notes += notes
    print("\n".join(all_notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
