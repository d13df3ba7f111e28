"""Training larger than the GPU on one GPU, side by side: plain PyTorch, a ZeRO-Offload-style baseline, FSDP2 with
CPU offload at world size 1, and hetero's planned run (MemFerry modes, GO-MemFerry gradient offload).

    .venv/bin/python bench/gpu_offload.py [--gpu-memory 4GiB] [--n-embd 1024 --n-head 16 --vocab 8192]
                                          [--batch-size 1 --seq-len 256] [--steps 6] [--only compare|capacity]

Methods (each one step = forward, backward, AdamW update of fp32 weights):
  plain    model and AdamW on the GPU (torch fused AdamW)
  zero     ZeRO-Offload style: every layer on the GPU (all GFGB), each gradient copied to pinned host memory on a
           side stream as soon as it is final and freed on the GPU, fused CPU AdamW after backward, the updated
           weights copied back before the next forward
  fsdp2    fully_shard per block and at the root with CPUOffloadPolicy(pin_memory=True), world size 1, CPU AdamW
  hetero   hetero run's runtime: for the comparison, profiled and planned (hetero plan --optimizer-device host
           --gpu-memory <zero's peak>); for capacity, the least-GPU-memory plan (every layer DHA, gradients to host)
Phases: (1) the model size: the most blocks at which plain training fits under --gpu-memory (plain barely fits);
(2) compare at that size: median step time after warm-up, peak GPU memory (torch's reserved peak: what the process
holds; allocated beside it), ratios to zero; (3) capacity: the
most blocks each method trains under the same cap. Every measurement runs in its own process (`--worker`), the
cap set with torch.cuda.set_per_process_memory_fraction, so an out-of-memory run ends cleanly.
MemFerry's goals: hetero at least 1.3x faster than zero at no more GPU memory, and a model at least 1.5x larger.
Without CUDA it runs nothing and exits 2 with one line.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from train_gpt import GPT, batches  # noqa: E402

from hetero.units import SIZE  # noqa: E402

METHODS = ("plain", "zero", "fsdp2", "hetero")
WARMUP = 2


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-memory", type=SIZE.parse, default=4 * 2**30, help="GPU memory cap for every method")
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=6, help=f"steps per run; the first {WARMUP} are not timed")
    p.add_argument("--reserve", type=float, default=0.5, help="hetero plan --reserve")
    p.add_argument("--max-layers", type=int, default=512, help="stop the capacity search here")
    p.add_argument("--timeout", type=int, default=1800, help="seconds one measurement may take")
    p.add_argument("--only", choices=("compare", "capacity"), default=None)
    p.add_argument("--keep", type=Path, default=None, help="write hetero's profile and plan of the comparison here")
    p.add_argument("--n-layer", type=int, default=None, help="skip phase 1: compare at this many blocks")
    p.add_argument("--worker", choices=METHODS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--policy", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def script_args(a: argparse.Namespace, n_layer: int) -> list[str]:
    return ["--n-layer", str(n_layer), "--n-embd", str(a.n_embd), "--n-head", str(a.n_head), "--vocab",
            str(a.vocab), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--device", "cuda"]


# -- one measurement, in its own process ---------------------------------------------------------------------------


def build(a: argparse.Namespace, n_layer: int, device: str) -> torch.nn.Module:
    """The example's GPT; `meta` builds shapes only (names and sizes for plans and counts)."""
    torch.manual_seed(0)
    if device == "meta":
        with torch.device("meta"):
            return GPT(a.vocab, a.seq_len, n_layer, a.n_embd, a.n_head)
    return GPT(a.vocab, a.seq_len, n_layer, a.n_embd, a.n_head).to(device)


def steps(a: argparse.Namespace, model: torch.nn.Module, opt, after_backward=None) -> list[float]:
    data = batches(a.vocab, a.batch_size, a.seq_len, 0, "cuda")
    times = []
    for _ in range(a.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        x, y = next(data)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def run_plain(a, n_layer: int) -> list[float]:
    model = build(a, n_layer, "cuda")
    return steps(a, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))


def run_zero(a, n_layer: int) -> list[float]:
    """Gradients leave the GPU as soon as each is final (overlapping backward); the update runs on the CPU."""
    model = build(a, n_layer, "cuda")
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.detach().cpu().pin_memory()) for p in params]
    for m in masters:
        m.grad = torch.empty_like(m).pin_memory()
    host = {id(p): m for p, m in zip(params, masters)}
    side = torch.cuda.Stream()

    def offload(p: torch.nn.Parameter) -> None:
        side.wait_stream(torch.cuda.current_stream())  # the gradient's producer, on the backward's stream
        with torch.cuda.stream(side):
            host[id(p)].grad.copy_(p.grad, non_blocking=True)
        p.grad.record_stream(side)
        p.grad = None

    for p in params:
        p.register_post_accumulate_grad_hook(offload)
    cpu_adam = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    class Step:
        def step(self) -> None:
            side.synchronize()
            cpu_adam.step()
            for p, m in zip(params, masters):
                p.data.copy_(m.data, non_blocking=True)  # before the next forward, on its stream

        def zero_grad(self, set_to_none: bool = True) -> None:
            pass

    return steps(a, model, Step())


def run_fsdp2(a, n_layer: int) -> list[float]:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    model = build(a, n_layer, "cpu")
    policy = CPUOffloadPolicy(pin_memory=True)
    for block in model.h:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    try:
        return steps(a, model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    finally:
        dist.destroy_process_group()


def run_hetero(a, n_layer: int, plan) -> list[float]:
    from hetero.run.runtime import Runtime

    model = build(a, n_layer, "cpu")  # the shadow model places each parameter when it binds: none visits the GPU first
    with Runtime(plan, script=str(ROOT / "examples/train_gpt.py")):
        times = steps(a, model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    print(json.dumps({"plan": {m: sum(e.mode == m for e in plan.layers) for m in ("gfgb", "dha", "dfgb")} |
                      {"grad_host": sum(e.grad == "host" for e in plan.layers)}}))
    return times


def planned(a, n_layer: int):
    """hetero profile + hetero plan, uncapped (profiling trains the model plainly), within --budget."""
    from hetero.plan.solve import PlanOptions, plan
    from hetero.profile.profiler import ProfileOptions, profile_script

    with tempfile.TemporaryDirectory() as nvme:
        profile = profile_script(str(ROOT / "examples/train_gpt.py"), script_args(a, n_layer) + ["--steps", "100"],
                                 ProfileOptions(steps=3, nvme_dir=nvme))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    from hetero.errors import HeteroError
    from hetero.units import SIZE

    options = PlanOptions(optimizer_device="host", gpu_memory_bytes=a.budget, reserve=a.reserve)
    try:
        chosen = plan(profile, options)
    except HeteroError as e:  # below what hetero can plan: run at the least it can, and say so in the table
        least = SIZE.parse(re.search(r"--gpu-memory (\S+)", e.hint).group(1))
        print(json.dumps({"budget": least, "note": f"zero's peak is below hetero's least plan: {e.message}"}))
        options.gpu_memory_bytes = least
        chosen = plan(profile, options)
    if a.keep:
        from hetero.schema import files

        a.keep.mkdir(parents=True, exist_ok=True)
        files.save(profile, a.keep / f"profile-{n_layer}.yaml")
        files.save(chosen, a.keep / f"plan-{n_layer}.yaml")
    return chosen


def policy_plan(a, n_layer: int):
    """The least GPU memory hetero can plan: every layer read from host memory, every gradient written there."""
    from hetero.harness.capture import fingerprint
    from hetero.harness.layers import select_layers
    from hetero.schema.plan import Budget, LayerPlan, OptimizerPlan, Plan, Predicted, Source, StatePlacement

    model = build(a, n_layer, "meta")
    opt = OptimizerPlan(kind="adamw", device="host", overlap_backward=True,
                        states=[StatePlacement(param=n, tier="host") for n, _ in model.named_parameters()])
    return Plan(source=Source(profile="-", profile_sha256="0" * 64, model_fingerprint=fingerprint(model)),
                budget=Budget(gpu_memory_bytes=a.gpu_memory, dram_budget_bytes=None, reserve=0.0),
                layers=[LayerPlan(name=s.name, mode="dha", grad="host") for s in select_layers(model, "module")],
                optimizer=opt, activations=None, routing=None, predicted=Predicted(iteration_s=0.0, peak_bytes={}),
                omitted={"activations": "benchmark", "routing": "one process"})


def worker(a: argparse.Namespace) -> None:
    n_layer = a.n_layer
    run = {"plain": run_plain, "zero": run_zero, "fsdp2": run_fsdp2}.get(a.worker)
    if a.worker == "hetero":
        plan_ = policy_plan(a, n_layer) if a.policy else planned(a, n_layer)  # before the cap: profiling trains
        run = lambda a, n: run_hetero(a, n, plan_)  # noqa: E731                 # the model plainly
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, a.gpu_memory / total))
    try:
        times = run(a, n_layer)
        print(json.dumps({"ok": True, "step_s": statistics.median(times), "peak": torch.cuda.max_memory_reserved(),
                          "allocated": torch.cuda.max_memory_allocated()}))
    except torch.OutOfMemoryError:
        print(json.dumps({"ok": False, "error": "out of GPU memory"}))


# -- the orchestrator -----------------------------------------------------------------------------------------------


def measure(a: argparse.Namespace, method: str, n_layer: int, budget: int | None = None, policy: bool = False
            ) -> dict:
    argv = [sys.executable, __file__, "--worker", method, "--n-layer", str(n_layer), "--gpu-memory",
            str(a.gpu_memory), "--n-embd", str(a.n_embd), "--n-head", str(a.n_head), "--vocab", str(a.vocab),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
            "--reserve", str(a.reserve)] + (["--budget", str(budget)] if budget else []) + \
        (["--policy"] if policy else []) + (["--keep", str(a.keep)] if a.keep else [])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess(argv, -1, "", f"took over {a.timeout} s")
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    result = next((x for x in reversed(lines) if "ok" in x), None)
    if result is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        result = {"ok": False, "error": " / ".join(tail) or f"exit {done.returncode}"}
    result.update(next((x for x in lines if "plan" in x), {}))
    result.update(next((x for x in lines if "note" in x), {}))
    print(f"  {method:7} {n_layer:4d} blocks: " + (f"{result['step_s'] * 1e3:8.1f} ms/step, peak "
          f"{SIZE.format_short(result['peak'])}" if result["ok"] else result["error"]), flush=True)
    if "plan" in result:  # what hetero ran, and its own account of predicted against measured
        print(f"          plan: {result['plan']}" + "".join(
            f"\n          {x}" for x in (done.stderr or "").splitlines() if x.startswith("hetero:")), flush=True)
    return result


def largest(a: argparse.Namespace, method: str, start: int, **kwargs) -> int:
    """The most blocks that fit: double from `start` until a run fails, then bisect (to within 1/8)."""
    lo, hi = 0, None
    n = start
    while hi is None and n <= a.max_layers:
        if measure(a, method, n, **kwargs)["ok"]:
            lo, n = n, n * 2
        else:
            hi = n
    hi = hi or a.max_layers + 1
    while lo and hi - lo > max(1, lo // 8):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if measure(a, method, mid, **kwargs)["ok"] else (lo, mid)
    return lo


def params_of(a: argparse.Namespace, n_layer: int) -> int:
    return sum(p.numel() for p in build(a, n_layer, "meta").parameters())


def main() -> None:
    a = parse()
    if not torch.cuda.is_available():
        print("bench/gpu_offload.py needs a CUDA GPU; this machine has none", file=sys.stderr)
        sys.exit(2)
    if a.worker:
        return worker(a)
    name = torch.cuda.get_device_name(0)
    print(f"{name}, cap {SIZE.format_short(a.gpu_memory)}; GPT n_embd {a.n_embd}, vocab {a.vocab}, batch "
          f"{a.batch_size} x {a.seq_len}; {time.strftime('%Y-%m-%d')}", flush=True)
    n_layer = a.n_layer or largest(a, "plain", 1)
    if not n_layer:
        sys.exit("plain training does not fit even one block under the cap: raise --gpu-memory")
    rows = {}
    if a.only != "capacity":
        print(f"compare at {n_layer} blocks ({params_of(a, n_layer) / 1e6:.0f}M params):", flush=True)
        for method in ("plain", "zero", "fsdp2"):
            rows[method] = measure(a, method, n_layer)
        budget = rows["zero"]["peak"] if rows["zero"]["ok"] else a.gpu_memory
        rows["hetero"] = measure(a, "hetero", n_layer, budget=budget)
    capacity = {}
    if a.only != "compare":
        print("capacity under the cap:", flush=True)
        capacity = {"plain": n_layer} | {m: largest(a, m, n_layer, policy=m == "hetero") for m in METHODS[1:]}
    report(a, name, n_layer, rows, capacity)


def report(a, name: str, n_layer: int, rows: dict, capacity: dict) -> None:
    print(f"\n{name}, GPU memory cap {SIZE.format_short(a.gpu_memory)}, {time.strftime('%Y-%m-%d')}")
    zero = rows.get("zero", {})
    if rows:
        print(f"{'method':8} {'ms/step':>9} {'reserved':>10} {'allocated':>10} {'speed vs zero':>14} "
              f"{'memory vs zero':>15}")
        for method, r in rows.items():
            if not r["ok"]:
                print(f"{method:8} {r['error']}")
                continue
            ratio = (f"{zero['step_s'] / r['step_s']:13.2f}x {r['peak'] / zero['peak']:14.2f}x" if zero.get("ok")
                     else "")
            print(f"{method:8} {r['step_s'] * 1e3:9.1f} {SIZE.format_short(r['peak']):>10} "
                  f"{SIZE.format_short(r.get('allocated', 0)):>10} {ratio}")
    if capacity:
        print(f"{'method':8} {'blocks':>7} {'params':>10} {'vs zero':>8}")
        for method, blocks in capacity.items():
            vs = f"{blocks / capacity['zero']:7.2f}x" if capacity.get("zero") else ""
            print(f"{method:8} {blocks:7d} {params_of(a, blocks) / 1e6:9.0f}M {vs}")
    if rows.get("hetero", {}).get("note"):
        print(f"hetero: {rows['hetero']['note']}; planned at {SIZE.format_short(rows['hetero']['budget'])} instead")
    print("goals (MemFerry): hetero >= 1.3x zero's speed at <= its GPU memory; a >= 1.5x larger model than zero")
    hetero = rows.get("hetero", {})
    if hetero.get("ok") and zero.get("ok"):
        speed, memory = zero["step_s"] / hetero["step_s"], hetero["peak"] / zero["peak"]
        met = speed >= 1.3 and memory <= 1
        print(f"  speed {speed:.2f}x at {memory:.2f}x the memory: {'met' if met else 'not met'}")
    if capacity.get("zero") and "hetero" in capacity:
        larger = params_of(a, capacity["hetero"]) / params_of(a, capacity["zero"])
        print(f"  largest model {larger:.2f}x zero's: {'met' if larger >= 1.5 else 'not met'}"
              + (f" (the search stopped at --max-layers {a.max_layers})" if capacity["hetero"] >= a.max_layers else ""))


if __name__ == "__main__":
    main()
