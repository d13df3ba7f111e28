"""One training step of examples/train_gpt.py: plain PyTorch next to hetero's offloaded optimizer, in one run.

    .venv/bin/python bench/step.py [--n-layer 8 --n-embd 512 --batch-size 1 --seq-len 64] [--rounds 5]
                                   [--profile FILE]

Configurations, timed in interleaved rounds so drift and neighbours affect all alike:
  torch fused      torch.optim.AdamW(fused=True): the fastest plain update, after backward (the peer)
  torch default    torch.optim.AdamW(): what the script gets without asking
  axdimm overlap   hetero, states on the emulated AXDIMM, each update launched as its gradient is final
  axdimm after     hetero, same placement, updates after backward
  host overlap     hetero, states in host memory, overlapped
The plan comes from the real profiler and planner (`--profile FILE`: from that earlier profile of
examples/train_gpt.py at these sizes instead; hetero's runtime refuses one of another model). Prints the median
step and backward+update time per configuration and the ratio to torch fused (the AXDIMM paper's 1.3-1.7x is
backward+update against a host update that does not overlap).
"""

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from train_gpt import GPT, batches  # noqa: E402

from hetero.harness.capture import fingerprint  # noqa: E402
from hetero.plan.solve import PlanOptions, plan  # noqa: E402
from hetero.profile.profiler import ProfileOptions, profile_script  # noqa: E402
from hetero.run.runtime import Runtime  # noqa: E402
from hetero.schema import files  # noqa: E402
from hetero.schema.profile import Profile  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="plan from this profile of the script at these sizes instead of profiling it")
    return p.parse_args()


def script_args(a: argparse.Namespace) -> list[str]:
    return ["--n-layer", str(a.n_layer), "--n-embd", str(a.n_embd), "--n-head", str(a.n_head), "--vocab",
            str(a.vocab), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--steps", "1000"]


class Config:
    """A model and optimizer built once (states allocated and touched before timing), stepped in rounds."""

    def __init__(self, name: str, a: argparse.Namespace, make_opt, plan_=None):
        self.name, self.times = name, {"step": [], "backward+update": []}
        torch.manual_seed(0)
        self.model = GPT(a.vocab, a.seq_len, a.n_layer, a.n_embd, a.n_head)
        self.runtime = Runtime(plan_, script=str(ROOT / "examples/train_gpt.py")) if plan_ else None
        if self.runtime:
            self.runtime.__enter__()
        self.x, self.y = next(batches(a.vocab, a.batch_size, a.seq_len, 0, "cpu"))
        self.opt = make_opt(self.model.parameters())
        self.run(2, timed=False)

    def run(self, steps: int, timed: bool = True) -> None:
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = F.cross_entropy(self.model(self.x).flatten(0, 1), self.y.flatten())
            t1 = time.perf_counter()
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
            t2 = time.perf_counter()
            if timed:
                self.times["step"].append(t2 - t0)
                self.times["backward+update"].append(t2 - t1)

    def close(self) -> None:
        if self.runtime:
            self.runtime.__exit__(None, None, None)


def main() -> None:
    a = parse()
    if a.profile:
        profile = files.load(a.profile, expect=Profile)
        if fingerprint(GPT(a.vocab, a.seq_len, a.n_layer, a.n_embd, a.n_head)) != profile.model.fingerprint:
            sys.exit(f"bench/step.py: {a.profile} is a profile of another model than these sizes of "
                     "examples/train_gpt.py")
    else:
        print(f"profiling and planning examples/train_gpt.py {' '.join(script_args(a)[:-2])} ...", flush=True)
        with tempfile.TemporaryDirectory() as nvme:
            profile = profile_script(str(ROOT / "examples/train_gpt.py"), script_args(a),
                                     ProfileOptions(steps=3, warmup=1, nvme_dir=nvme))
    on_axdimm = plan(profile, PlanOptions(optimizer_device="axdimm"))
    on_axdimm.activations = None  # the optimizer alone: tiering has its own benchmark
    on_host = dataclasses.replace(on_axdimm, optimizer=plan(profile, PlanOptions(optimizer_device="host")).optimizer)
    after = dataclasses.replace(on_axdimm, optimizer=dataclasses.replace(on_axdimm.optimizer, overlap_backward=False))
    configs = [
        Config("torch fused", a, lambda p: torch.optim.AdamW(p, fused=True)),
        Config("torch default", a, lambda p: torch.optim.AdamW(p)),
        Config("axdimm overlap", a, lambda p: torch.optim.AdamW(p), on_axdimm),
        Config("axdimm after", a, lambda p: torch.optim.AdamW(p), after),
        Config("host overlap", a, lambda p: torch.optim.AdamW(p), on_host),
    ]
    try:
        for r in range(a.rounds):
            for c in configs:
                c.run(a.steps)
            print(f"round {r + 1}/{a.rounds} done", flush=True)
    finally:
        for c in configs:
            c.close()
    report(configs, profile.model.num_params, a)


def report(configs: list[Config], num_params: int, a: argparse.Namespace) -> None:
    med = {c.name: {k: statistics.median(v) for k, v in c.times.items()} for c in configs}
    base = med["torch fused"]
    print(f"\n{num_params / 1e6:.1f}M params, batch {a.batch_size} x {a.seq_len} tokens, {torch.get_num_threads()} "
          f"threads; median of {a.rounds * a.steps} steps each")
    print(f"{'configuration':16} {'step ms':>9} {'bwd+upd ms':>11} {'step vs fused':>14} {'bwd+upd vs fused':>17}")
    for name, m in med.items():
        print(f"{name:16} {m['step'] * 1e3:9.1f} {m['backward+update'] * 1e3:11.1f} "
              f"{base['step'] / m['step']:13.2f}x {base['backward+update'] / m['backward+update']:16.2f}x")
    print("(ratios above 1 mean faster than torch fused AdamW)")


if __name__ == "__main__":
    main()
