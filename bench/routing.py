"""Gradient sync per step: plain DDP beside hetero's routed sync (COARSE §III-E/F), side by side in one run.

    .venv/bin/python bench/routing.py                     # 2 and 4 gloo processes on this machine
    .venv/bin/python bench/routing.py --nproc 2 --steps 30 --backend nccl   # one GPU per process

Every world measures its links with hetero's profiler (hetero.profile.peers) and routes as `hetero plan` would
(hetero.plan.routing.route) -- "planned" -- and, to show the paths at work where the planner sees no reason to split,
with a hand-set table -- "split": tensors up to 64 KiB on the latency path, 1 MiB shards, the first tenth of the bytes
ahead. The model is GPT-shaped (embedding and head of 4 MiB, blocks of 0.25-1 MiB weights, small biases and norms).
Each hetero contender trains while its runtime is open (closing it tears down its paths' groups): each round is
one step of it, of plain DDP and of a `no_sync` backward, in rotating order, from the same weights; the `no_sync`
backward gives the compute alone, so "exposed sync" is backward with sync minus backward without: what the step
waits for communication. "in flight" is rank 0's time with at least one collective running (hetero's run report
measures the same); plain DDP is timed through torch's reference `allreduce_hook`, which does what DDP does without
a hook. Backward times are the slowest rank's per step; medians over the steps are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.harness.capture import fingerprint  # noqa: E402
from hetero.plan.model import Curve  # noqa: E402
from hetero.plan.routing import Link, route  # noqa: E402
from hetero.profile import peers  # noqa: E402
from hetero.run.routing import GradientRouting, union_s  # noqa: E402
from hetero.run.runtime import Runtime  # noqa: E402
from hetero.schema.plan import Budget, Plan, Predicted, RoutingPlan, Source  # noqa: E402

VOCAB, WIDTH, BLOCKS, TOKENS = 4096, 256, 4, (1, 16)  # few tokens: communication, not compute, dominates
KiB, MiB = 2**10, 2**20


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(WIDTH), "qkv": nn.Linear(WIDTH, 3 * WIDTH), "proj": nn.Linear(WIDTH, WIDTH),
            "ln2": nn.LayerNorm(WIDTH), "up": nn.Linear(WIDTH, 4 * WIDTH), "down": nn.Linear(4 * WIDTH, WIDTH)})
            for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).chunk(3, dim=-1)
            x = x + b["proj"](F.scaled_dot_product_attention(q, k, v, is_causal=True))
            x = x + b["down"](F.gelu(b["up"](b["ln2"](x))))
        return self.head(x)


def _plan(model: nn.Module, routing: RoutingPlan) -> Plan:
    return Plan(source=Source(profile="-", profile_sha256="0" * 64, model_fingerprint=fingerprint(model)),
                budget=Budget(gpu_memory_bytes=None, dram_budget_bytes=None, reserve=1.0), layers=[], optimizer=None,
                activations=None, routing=routing, predicted=Predicted(iteration_s=0.0, peak_bytes={}))


def _planned(device: torch.device, grad_bytes: int, forward_s: float, backward_s: float) -> RoutingPlan:
    """What `hetero plan` would write for this world, from links measured now; the same table on every rank."""
    links = [Link(peer=p.dst, curve=Curve.of(p.transfer)) for p in peers.measure(device) if p.src == 0]
    table = [None]
    if dist.get_rank() == 0:
        r = route(links, dist.get_world_size(), grad_bytes, forward_s, backward_s)
        table = [RoutingPlan(threshold_bytes=r.threshold_bytes, latency_peer=r.latency_peer,
                             bandwidth_peer=r.bandwidth_peer, shard_bytes=r.shard_bytes,
                             dual_sync_bytes=r.dual_sync_bytes, why=r.why)]
    dist.broadcast_object_list(table, src=0)
    return table[0]


class Timed:
    """Plain DDP's sync, timed: torch's reference `allreduce_hook` (documented to equal DDP without a hook), with
    each bucket's all-reduce recorded from issue to completion."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []
        self.steps: list[float] = []

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        issued = time.perf_counter()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.spans.append((issued, time.perf_counter()))
            return fut.value()

        return allreduce_hook(None, bucket).then(done)

    def end_step(self) -> None:
        self.steps.append(union_s(self.spans))
        self.spans = []

    def step_seconds(self) -> list[float]:
        return self.steps


def _timed(state, bucket):  # unannotated: DDP checks hook annotations
    return state(bucket)


def _step(model: nn.Module, tokens: torch.Tensor, device: torch.device, sync: bool = True) -> float:
    """One training step's backward time (forward and update untimed). Without sync, the forward too runs under
    `no_sync`: DDP arms its reducer in forward."""
    with contextlib.nullcontext() if sync else model.no_sync():
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        _wait(device)
        start = time.perf_counter()
        loss.backward()
        _wait(device)
    took = time.perf_counter() - start
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-3 * p.grad
            p.grad = None
    return took


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, world: int, backend: str, steps: int, rdzv: str) -> None:
    dist.init_process_group(backend, init_method=f"file://{rdzv}", rank=rank, world_size=world)
    torch.set_num_threads(max(1, os.cpu_count() // world))
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    base = Gpt().to(device)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    models, syncs = {"DDP": DDP(_copy(base))}, {"DDP": Timed()}
    models["DDP"].register_comm_hook(syncs["DDP"], _timed)
    tokens = torch.randint(VOCAB, TOKENS, generator=torch.Generator().manual_seed(rank)).to(device)
    backward = statistics.median(_step(models["DDP"], tokens, device, sync=False) for _ in range(3))
    split = RoutingPlan(threshold_bytes=64 * KiB, latency_peer=1, bandwidth_peer=1, shard_bytes=MiB,
                        dual_sync_bytes=grad_bytes // 10)
    times: dict[str, list[float]] = {"no sync": [], "DDP": []}
    for name, table in (("hetero planned", _planned(device, grad_bytes, backward / 2, backward)),
                        ("hetero split", split)):
        model = _copy(base)
        # Closing the runtime tears down its paths' groups: its contender trains while the runtime is open.
        with Runtime(_plan(model, table), script=__file__) as runtime:
            models[name] = DDP(model)
            syncs[name] = next(m for m in runtime.mechanisms if isinstance(m, GradientRouting)).syncs[0]
            if rank == 0:
                print(f"{name}: {table}", flush=True)
            times[name] = []
            _rounds(["no sync", "DDP", name], models, syncs, tokens, device, steps, times)
    counts = [len(t) for t in times.values()]
    slowest = torch.tensor([t for name in times for t in times[name]], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        per_name = dict(zip(times, (s.tolist() for s in slowest.cpu().split(counts))))
        _report(world, backend, grad_bytes, per_name, syncs)
    # DDP's reducers hold gloo work: freed at interpreter teardown, after the groups, they abort the process
    models.clear()
    syncs.clear()
    gc.collect()
    dist.destroy_process_group()


def _rounds(names: list[str], models: dict, syncs: dict, tokens: torch.Tensor, device: torch.device, steps: int,
            times: dict[str, list[float]]) -> None:
    """`steps` rounds of one step of every contender in `names`, in rotating order, after two warm-up rounds
    (connections, DDP's bucket rebuild); each step's backward time is appended to `times[name]`."""
    for step in range(steps + 2):
        for name in names[step % len(names):] + names[:step % len(names)]:
            took = _step(models.get(name, models["DDP"]), tokens, device, sync=name != "no sync")
            if name == "DDP":
                syncs[name].end_step()
            if step >= 2:
                times[name].append(took)


def _copy(model: nn.Module) -> nn.Module:
    twin = Gpt().to(next(model.parameters()).device)
    twin.load_state_dict(model.state_dict())
    return twin


def _report(world: int, backend: str, grad_bytes: int, times: dict[str, list[float]], syncs: dict) -> None:
    med = {name: statistics.median(t) for name, t in times.items()}
    exposed = {name: med[name] - med["no sync"] for name in med if name != "no sync"}
    print(f"\n{world} processes, {backend}, {grad_bytes / MiB:.1f} MiB of gradients, medians over "
          f"{len(times['hetero split'])} steps per contender (backward without sync: {med['no sync'] * 1e3:.1f} ms)")
    flight = {name: statistics.median(syncs[name].step_seconds()[2:] or syncs[name].step_seconds())
              for name in exposed}  # rank 0's
    print(f"  {'':16} {'backward ms':>11} {'exposed sync ms':>15} {'x DDP':>6} {'in flight ms':>12} {'x DDP':>6}")
    for name in exposed:
        print(f"  {name:16} {med[name] * 1e3:11.1f} {exposed[name] * 1e3:15.1f} {exposed[name] / exposed['DDP']:6.2f}"
              f" {flight[name] * 1e3:12.1f} {flight[name] / flight['DDP']:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4", help="world sizes, e.g. 2,4")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = parser.parse_args()
    for world in (int(n) for n in args.nproc.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, args.backend, args.steps, os.path.join(tmp, "rdzv")), nprocs=world)


if __name__ == "__main__":
    main()
