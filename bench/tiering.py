"""Activation tiering side by side on examples/train_gpt.py: no tiering, hetero's schedule, naive synchronous offload
(write on pack, read on unpack) and, on a GPU, torch's `save_on_cpu(pin_memory=True)`.

    .venv/bin/python bench/tiering.py [--steps 3] [--warmup 2] [--rounds 3] [--nvme DIR] [--min-tensor 1MiB]
                                      [--profile FILE] [-- SCRIPT ARGS]

It profiles the script (`hetero profile`; with `--profile FILE` it takes that earlier profile of the script instead,
disk tier included), plans (`hetero plan --tier-activations`: scheduled even where the planner would find no memory
saved), keeps the plan's `activations` section only (the optimizer stays the script's own, so only tiering differs)
and fills its `slow_path` from the profile's tier when the planner left it out. `--min-tensor` re-solves the
schedule with the planner's own TierTrain queue under that threshold instead of the planner's. Each configuration
then runs in a fresh process, taking turns round by round, so drift in a shared machine hits all alike. A run times
its optimizer steps after the warmup and counts saved bytes in the fast tier with hetero's ledger, time-averaged
over the run; `none` runs without hooks, and its bytes are what the hetero run counted as saved without tiering. The
naive offload moves every tensor the plan's threshold allows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter, process_time

REPO = Path(__file__).resolve().parents[1]
# Wide and short: compute grows with n_embd^2 per token, saved bytes with n_embd, so the disk's transfers can hide
# behind the step (at ~0.5 GB/s, a 4-layer GPT of width 256 saves more per step than it computes time to move).
SCRIPT = ["examples/train_gpt.py", "--batch-size", "8", "--seq-len", "128", "--n-layer", "4", "--n-embd", "768",
          "--n-head", "12", "--log-every", "1000"]
MARK = "BENCH-RESULT "


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nvme", default=None, help="directory of the disk tier [default: a temp dir]")
    p.add_argument("--min-tensor", default=None, help="re-solve the schedule with this threshold, e.g. 1MiB")
    p.add_argument("--stay-time", default="1ms", help="TierTrain's stay time for hetero plan: larger keeps short-idle "
                   "tensors in fast memory (they cost I/O for little average saving)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="plan from this profile of the script instead of profiling it (its disk tier holds the files)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    p.add_argument("script", nargs="*", help="script and its arguments [default: a 4-layer GPT of width 768, "
                                             "batch 8 x 128]")
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    work = Path(tempfile.mkdtemp(prefix="hetero-bench-"))
    try:  # the profile, the plans and the disk tier's files: removed however the bench ends
        script = args.script or SCRIPT + ["--steps", str(args.warmup + args.steps)]
        plan_path = _plan(work, script, args)
        configs = ["none", "hetero", "naive"] + (["save_on_cpu"] if _has_cuda() else [])
        runs: dict[str, list[dict]] = {c: [] for c in configs}
        for _ in range(args.rounds):
            for config in configs:
                runs[config].append(_run(config, plan_path, script, args))
        _table(runs, args, script)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- setup -----------------------------------------------------------------------------------------------------------


def _plan(work: Path, script: list[str], args) -> Path:
    from hetero.schema import files
    from hetero.schema.plan import Plan
    from hetero.schema.profile import Profile
    from hetero.units import SIZE

    nvme = args.nvme or str(work / "nvme")
    hetero = [sys.executable, "-m", "hetero"]
    longer = [] if args.script else ["--steps", "100"]  # the profiler stops the script once it has measured
    profiled = Path(args.profile) if args.profile else work / "profile.yaml"
    if not args.profile:
        _call(hetero + ["profile", "--steps", "3", "--warmup", "1", "--nvme", nvme, "-o", str(profiled), *script,
                        *longer])
    _call(hetero + ["plan", "--profile", str(profiled), "-o", str(work / "plan.yaml"),
                    "--optimizer-device", "host", "--stay-time", args.stay_time, "--tier-activations"])
    profile = files.load(profiled, expect=Profile)
    plan = files.load(work / "plan.yaml", expect=Plan)
    acts = plan.activations
    if acts is None and args.min_tensor:  # nothing reaches the planner's threshold: the bench's own decides
        acts = plan.activations = _empty(profile, nvme, args.stay_time)
        plan.omitted.pop("activations", None)
    assert acts is not None, f"the planner scheduled no activations: {plan.omitted.get('activations')}"
    if args.min_tensor:
        _resolve(profile, acts, SIZE.parse(args.min_tensor))
    plan.optimizer, plan.omitted["optimizer"] = None, "bench: activations only"
    print(f"plan: {sum(e.evict_bytes > 0 for e in acts.schedule)} of {len(profile.layers)} layers evict to "
          f"{acts.slow} ({acts.slow_path}), min_tensor {SIZE.format_short(acts.min_tensor_bytes)}; "
          f"{_predicted(profile, plan)}")
    files.save(plan, work / "bench.plan.yaml")
    return work / "bench.plan.yaml"


def _predicted(profile, plan) -> str:
    from hetero.plan import solve

    try:
        r = solve.predict(profile, plan)
    except Exception as e:  # the simulator is another part's; the measurement does not depend on it
        return f"no prediction ({type(e).__name__}: {e})"
    return (f"predicted average {_ratio(r.act_avg_bytes, r.act_avg_untiered_bytes)}, peak "
            f"{_ratio(r.act_peak_bytes, r.act_peak_untiered_bytes)} of untiered")


def _empty(profile, nvme: str, stay_time: str):
    """An activations section that evicts nothing yet, to the profile's disk tier (`_resolve` fills it)."""
    from hetero.schema.plan import ActivationPlan
    from hetero.units import TIME

    disk = next(t for t in profile.machine.tiers if t.kind == "nvme")
    return ActivationPlan(fast="dram", slow=disk.name, slow_path=nvme, stay_time_s=TIME.parse(stay_time),
                          min_tensor_bytes=0, schedule=[], why="paper prefetch rule (bench)")


def _resolve(profile, acts, min_tensor: int) -> None:
    """The planner's TierTrain queue again, under another threshold, with the plan's rule and stay time."""
    from hetero.plan import tiering
    from hetero.schema.plan import Eviction

    evict, prefetch = tiering.curves(profile, acts.slow)
    layers = profile.layers
    windows = [tiering.Window(name=x.name, saved_bytes=x.saved_bytes, fp_end_s=x.fp_end_s, bp_start_s=x.bp_start_s)
               for x in layers]
    rule = "packed" if acts.why.startswith("packed") else "paper"
    decisions = tiering.schedule(windows, evict, prefetch, acts.stay_time_s, min_tensor, None, rule)
    acts.schedule = [Eviction(layer=layers[d.layer].name, evict_bytes=d.evict_bytes, prefetch_at_s=d.prefetch_at_s,
                              prefetch_after=None if d.prefetch_after is None else layers[d.prefetch_after].name,
                              why=d.why) for d in decisions]
    acts.min_tensor_bytes = min_tensor


def _call(argv: list[str]) -> None:
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"failed: {' '.join(argv)}\n{result.stderr[-3000:]}")


def _run(config: str, plan: Path, script: list[str], args) -> dict:
    argv = [sys.executable, __file__, "--worker", config, "--plan", str(plan), "--warmup", str(args.warmup), "--",
            *script]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    line = next((x for x in result.stdout.splitlines() if x.startswith(MARK)), None)
    if result.returncode or line is None:
        sys.exit(f"{config} run failed:\n{result.stderr[-3000:]}")
    return json.loads(line[len(MARK):])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# -- one configuration, in its own process ---------------------------------------------------------------------------


def _worker(args) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from hetero.harness.script import run_script
    from hetero.schema import files
    from hetero.schema.plan import Plan

    plan = files.load(args.plan, expect=Plan)
    steps: list[tuple[float, float]] = [(perf_counter(), process_time())]
    register_optimizer_step_post_hook(lambda opt, a, kw: steps.append((perf_counter(), process_time())))
    script, script_args = args.script[0], args.script[1:]
    if args.worker == "hetero":
        from hetero.run.runtime import Runtime
        from hetero.run.tiering import ActivationTiering

        with Runtime(plan, script=script) as runtime:
            result = run_script(script, script_args)
        report = next(m for m in runtime.mechanisms if isinstance(m, ActivationTiering)).ledger.report()
    elif args.worker == "none":
        result = run_script(script, script_args)
        report = None
    else:
        with _Baseline(args.worker, plan, script) as baseline:
            result = run_script(script, script_args)
        report = baseline.ledger.report()
    if result.exit_code:
        sys.exit(f"{args.worker}: the script exited with {result.exit_code}")
    timed = steps[args.warmup:]
    times = [b[0] - a[0] for a, b in zip(timed, timed[1:])]
    out = {"step_s": statistics.median(times), "best_s": min(times), "steps": len(times),
           "cpu_s": (timed[-1][1] - timed[0][1]) / len(times)}  # all threads' CPU time per step
    if report is not None:
        out.update(avg_fast=report.avg_fast, peak_fast=report.peak_fast, avg_saved=report.avg_saved,
                   peak_saved=report.peak_saved, late=report.late, waited_s=report.waited_s,
                   evicted=sum(report.evicted.values()))
    print(MARK + json.dumps(out), flush=True)


class _Baseline:
    """A peer's offload around the model's forward, found as `hetero run` finds it (from the model's second forward
    on: the first one is under way when the model is recognised, and is among the warmup steps)."""

    def __init__(self, kind: str, plan, script: str):
        import torch

        from hetero.harness.capture import Capture
        from hetero.run.devices.nvme import NvmeStore
        from hetero.run.devices.residency import Ledger

        acts = plan.activations
        self.kind, self.min_tensor = kind, acts.min_tensor_bytes
        self.ledger = Ledger("gpu" if kind == "save_on_cpu" else acts.fast, acts.slow)
        self.capture = Capture(self._found, script, fingerprint=plan.source.model_fingerprint)
        self.store = None if kind == "save_on_cpu" else NvmeStore(os.path.join(acts.slow_path, f"naive-{os.getpid()}"))
        self.keys = iter(range(1 << 62))
        self.params: set[int] = set()
        self.active = False
        self.context = (torch.autograd.graph.save_on_cpu(pin_memory=True) if kind == "save_on_cpu"
                        else torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))

    def __enter__(self):
        self.capture.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.capture.__exit__()
        if self.store is not None:
            self.store.close()

    def _found(self, model, optimizer) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module, args) -> None:
        self.active = True
        self.context.__enter__()

    def _exit(self, module, args, output) -> None:
        if self.active:  # not on the forward under way when the model was found
            self.active = False
            self.context.__exit__(None, None, None)

    def _pack(self, t):
        import torch

        storage = t.untyped_storage()
        if storage.data_ptr() in self.params:
            return t  # not an activation: hetero's ledger leaves parameters out too
        if storage.nbytes() < self.min_tensor or t.layout != torch.strided:
            return _Held(self.ledger, t, storage.nbytes())
        key = str(next(self.keys))
        self.store.write_async(key, torch.empty(0, dtype=torch.uint8).set_(storage)).wait()  # synchronously
        self.ledger.evicted["naive"] += storage.nbytes()

        return key, storage.nbytes(), t.dtype, t.size(), t.stride(), t.storage_offset()

    def _unpack(self, packed):
        import torch

        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Held):
            return packed.tensor
        key, nbytes, dtype, size, stride, offset = packed
        data = torch.empty(nbytes, dtype=torch.uint8)
        self.store.read_async(key, data).wait()  # on demand, while backward waits
        self.store.delete(key)
        return torch.empty(0, dtype=dtype).set_(data.untyped_storage(), offset, size, stride)


class _Held:
    """A tensor the naive offload leaves in fast memory, counted while autograd holds it."""

    def __init__(self, ledger, tensor, nbytes: int):
        self.ledger, self.tensor, self.nbytes = ledger, tensor, nbytes
        ledger.change(fast=nbytes, saved=nbytes)

    def __del__(self) -> None:
        self.ledger.change(fast=-self.nbytes, saved=-self.nbytes)


# -- report ----------------------------------------------------------------------------------------------------------


def _table(runs: dict[str, list[dict]], args, script: list[str]) -> None:
    """Medians over the rounds; the step time also as the best round's, which a shared machine's load (it only ever
    slows a run down) distorts least. Ratios are against `none`: times best against best."""
    from hetero.units import SIZE

    def med(config: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[config])

    def best(config: str) -> float:
        return min(r["best_s"] for r in runs[config])

    base_best = best("none")
    base_avg, base_peak = med("hetero", "avg_saved"), med("hetero", "peak_saved")
    print(f"\n{' '.join(script)}; {args.steps} timed steps after {args.warmup}, {args.rounds} round(s)")
    print(f"{'config':12} {'step':>8} {'best':>8} {'x none':>7} {'cpu/step':>9} {'avg fast':>10} {'x none':>7} "
          f"{'peak fast':>10} {'x none':>7} {'evicted':>10} {'late':>5} {'waited':>8}")
    for config in runs:
        tiered = config != "none"
        avg = med(config, "avg_fast") if tiered else base_avg
        peak = med(config, "peak_fast") if tiered else base_peak
        evicted = SIZE.format_short(int(med(config, "evicted"))) if tiered else ""
        late = str(int(med(config, "late"))) if tiered else ""
        waited = f"{med(config, 'waited_s') * 1e3:.0f}ms" if tiered else ""
        print(f"{config:12} {med(config, 'step_s'):7.2f}s {best(config):7.2f}s {best(config) / base_best:7.2f} "
              f"{med(config, 'cpu_s'):8.2f}s {SIZE.format_short(int(avg)):>10} {avg / base_avg:7.2f} "
              f"{SIZE.format_short(int(peak)):>10} {peak / base_peak:7.2f} {evicted:>10} {late:>5} {waited:>8}")


def _ratio(new: float, old: float) -> str:
    return f"{new / old:.2f}" if old else "n/a"


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("PYTHONPATH", str(REPO))
    main()
