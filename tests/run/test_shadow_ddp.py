"""The shadow model under DistributedDataParallel: 2 gloo ranks, each on its own stand-in device, training with a
shadow-model plan (DHA, GFGB and DFGB layers, gradients on the device or in host memory, with and without routed
sync) must equal plain DDP, and the replicas must stay bit for bit equal. The stand-in's strict parameters make a
parameter that changes device at the step boundary an error, as it is in effect on CUDA (its gradient accumulator
is replaced, DDP's hooks with it, and from the second step no all-reduce fires). With `resident`, the GPU bench's
plan (tests/run/test_weights_back.py): one block's parameters stay device memory, which the optimizer lays out flat
per bucket at the first step (`p.data` = a view on the same device: DDP's hooks stay).

Updates overlapped with backward are left out: the optimizer's post-accumulate-grad hook runs before DDP's hook on
the gradient accumulator, so an overlapped update reads the rank's own gradient, not the average (an optimizer
matter, hetero.run.optimizer, found here)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hetero.kernels import dha
from hetero.run.runtime import Runtime
from tests.run.test_routing import routed_plan
from tests.run.test_shadow import batch, compare, gpt, layer_plan
from tests.run.test_weights_back import bench_plan
from tests.standin import StandInDevices, strict_parameters

STEPS = 4
WORLD = 2


def train(ddp: DDP, rank: int) -> list[float]:
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    vocab, length = ddp.module.wte.num_embeddings, ddp.module.wpe.num_embeddings
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank, vocab, length)  # each rank its own data: the average matters
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


CONFIGS = [("gpu", False, False), ("host", False, False), ("gpu", False, True), ("host", False, True),
           ("resident", False, False)]


def _worker(rank: int, rdzv: str, out: str) -> None:
    """Plain DDP once, then every configuration on fresh stand-in devices, in one spawn of the ranks (each spawn
    starts two interpreters and a process group: seconds)."""
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=WORLD)
    reference = gpt()
    results = {"ref": (train(DDP(reference), rank), _params(reference))}
    for grad, overlap, routed in CONFIGS:
        devices = dha.devices = StandInDevices()
        model = gpt()
        plan = bench_plan(model, overlap) if grad == "resident" else layer_plan(model, "mixed", grad, overlap)
        if routed:
            plan.routing = routed_plan(model, threshold=1024, shard=4096, dual_sync=8192).routing
            plan.omitted.pop("routing")
        with strict_parameters(devices), Runtime(plan, script=__file__):
            devices.set_device(rank)  # as a torchrun worker: after the runtime was made
            losses = train(DDP(devices.to(model, rank)), rank)
        results[grad, overlap, routed] = {"run": (losses, _params(model)), "used": [bool(d.log) for d in devices.all]}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _as_model(params: dict[str, torch.Tensor]) -> nn.Module:
    model = gpt()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("shadow-ddp")
    mp.spawn(_worker, args=(str(out / "rdzv"), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("grad, overlap, routed", CONFIGS)
def test_shadow_model_ranks_train_as_plain_ddp(ranks, grad, overlap, routed):
    for rank, results in enumerate(ranks):
        result = results[grad, overlap, routed]
        assert result["used"] == [d == rank for d in range(WORLD)]  # each rank on its own device only
        (ref_losses, ref_params), (losses, params) = results["ref"], result["run"]
        compare(_as_model(params), _as_model(ref_params), losses, ref_losses)
    for name, p in ranks[0][grad, overlap, routed]["run"][1].items():
        assert torch.equal(ranks[1][grad, overlap, routed]["run"][1][name], p), name  # replicas in step, bit for bit
