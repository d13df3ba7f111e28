"""The plan's `recompute` section: chosen blocks run through torch.utils.checkpoint, alone, with every other lever
the DRAM-budget fit combines it with (returned memory, updates in backward, states and gradients on NVMe, tiering)
and under 2-rank DDP (replicas bitwise equal), trained against plain PyTorch from the same seed; dropout inside a
block replays its randomness; a copy of the model has none of it; evaluation without gradients runs the blocks as
written."""

from __future__ import annotations

import copy
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from hetero.errors import STALE_PLAN, HeteroError
from hetero.harness.capture import fingerprint
from hetero.plan import fit
from hetero.run.recompute import Recompute
from hetero.run.runtime import Runtime
from hetero.schema.plan import (
    ActivationPlan,
    Budget,
    Eviction,
    Plan,
    Predicted,
    RecomputePlan,
    Source,
    UpdateInBackward,
)
from tests.run.plans import optimizer_plan

STEPS = 3
pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block(32, dropout) for _ in range(3))
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def make(dropout: float = 0.0) -> Net:
    torch.manual_seed(0)
    return Net(dropout)


def train(model: nn.Module, rank: int = 0) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(7)  # dropout draws from the global generator, as scripts' do
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)  # each rank its own batches
        x, y = torch.randn(8, 16, generator=g), torch.randint(8, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def recompute_plan(model: nn.Module, blocks=("blocks.0", "blocks.2")) -> Plan:
    return Plan(source=Source(profile="profile.yaml", profile_sha256="0" * 64, model_fingerprint=fingerprint(model)),
                budget=Budget(gpu_memory_bytes=None, dram_budget_bytes=None, reserve=1.0), layers=[], optimizer=None,
                activations=None, routing=None, predicted=Predicted(iteration_s=0.0, peak_bytes={}),
                omitted={"layers": "test", "optimizer": "test", "activations": "test", "routing": "test"},
                recompute=RecomputePlan(blocks=list(blocks)))


def with_lever(plan: Plan, model: nn.Module, lever: str, workdir: str) -> Plan:
    if lever == "allocator":
        return replace(plan, allocator=fit.allocator_plan("test"))
    if lever == "in_backward":
        return replace(plan, update_in_backward=UpdateInBackward(kind="adamw"))
    if lever == "states+grads":
        names = tuple(n for n, _ in model.named_parameters())
        opt = optimizer_plan(model, device="host", overlap=False, nvme=names, nvme_path=workdir, grads=True).optimizer
        return replace(plan, optimizer=opt, omitted={k: v for k, v in plan.omitted.items() if k != "optimizer"})
    if lever == "tiering":  # the layers outside the recomputed blocks evict everything they save
        kept = ["inp", "blocks.1.norm", "blocks.1.up", "blocks.1.down", "out"]
        acts = ActivationPlan(fast="dram", slow="nvme0", slow_path=workdir, stay_time_s=1e-3, min_tensor_bytes=256,
                              schedule=[Eviction(layer=name, evict_bytes=1 << 30, prefetch_at_s=0.0,
                                                 prefetch_after=name) for name in kept])
        return replace(plan, activations=acts, allocator=fit.allocator_plan("test"),
                       omitted={k: v for k, v in plan.omitted.items() if k != "activations"})
    return plan


@pytest.mark.parametrize("lever", ["alone", "allocator", "in_backward", "states+grads", "tiering"])
def test_recomputed_blocks_train_as_plain(lever, tmp_path):
    reference = make()
    expected = train(reference)
    model, workdir = make(), str(tmp_path / "work")
    os.makedirs(workdir)
    with Runtime(with_lever(recompute_plan(model), model, lever, workdir), script=__file__) as runtime:
        losses = train(model)
    assert_close(torch.tensor(losses), torch.tensor(expected))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p, q)
    recomputed = next(m for m in runtime.mechanisms if isinstance(m, Recompute))
    assert recomputed.recomputed == 2 * STEPS  # two blocks a forward
    assert "forward" not in model.blocks[0].__dict__  # the class's forward again
    assert sum(len(files) for _, _, files in os.walk(workdir)) == 0


def test_dropout_inside_a_recomputed_block_replays_its_randomness():
    reference = make(dropout=0.2)
    expected = train(reference)
    model = make(dropout=0.2)
    with Runtime(recompute_plan(model, blocks=("blocks.0", "blocks.1", "blocks.2")), script=__file__):
        losses = train(model)
    assert_close(torch.tensor(losses), torch.tensor(expected))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)  # the same forward again, from the same RNG state: bit for bit


def test_a_copy_has_none_of_it_and_evaluation_runs_the_blocks_as_written():
    model = make()
    with Runtime(recompute_plan(model), script=__file__) as runtime:
        train(model)
        ema = copy.deepcopy(model)
        assert "forward" in model.blocks[0].__dict__ and "forward" not in ema.blocks[0].__dict__
        with torch.no_grad():
            model(torch.randn(2, 16))
            ema(torch.randn(2, 16))
    assert next(m for m in runtime.mechanisms if isinstance(m, Recompute)).recomputed == 2 * STEPS


def test_a_block_the_model_lacks_is_a_stale_plan():
    model = make()
    with pytest.raises(HeteroError) as e:
        Recompute(RecomputePlan(blocks=["blocks.7"])).bind(model)
    assert e.value.exit_code == STALE_PLAN and "blocks.7" in e.value.message


def _ddp_worker(rank: int, rdzv: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    plain = make(dropout=0.2)
    plain_losses = train(DDP(plain), rank)
    model = make(dropout=0.2)
    with Runtime(recompute_plan(model), script=__file__) as runtime:
        losses = train(DDP(model), rank)
    recomputed = runtime.find(Recompute).recomputed
    torch.save({"plain": (plain_losses, plain.state_dict()), "planned": (losses, model.state_dict()),
                "recomputed": recomputed},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_recomputed_blocks_under_ddp_train_every_rank_as_plain_ddp(tmp_path):
    mp.spawn(_ddp_worker, args=(str(tmp_path / "rdzv"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        (expected, reference), (losses, weights) = r["plain"], r["planned"]
        assert r["recomputed"] == 2 * STEPS  # two blocks a forward, under DDP too
        assert_close(torch.tensor(losses), torch.tensor(expected))
        for name, w in weights.items():
            assert_close(w, reference[name])
    for name, w in ranks[0]["planned"][1].items():
        assert torch.equal(ranks[1]["planned"][1][name], w), name  # replicas bitwise equal
