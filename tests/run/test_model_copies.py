"""`torch.save(model)` and `copy.deepcopy(model)` mid-training under every mechanism: the copy and the loaded model
carry none of hetero's hooks, forward overrides or state (the saved bytes name nothing of hetero, so they load in a
process without it), equal the model's weights when copied, and training goes on as plain PyTorch's. The model has
an nn.LSTM, whose class defines its own `__getstate__` (pytorch/examples' word language model saves one whole)."""

from __future__ import annotations

import copy
import io
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from hetero.harness.layers import select_layers
from hetero.run.runtime import Runtime
from hetero.schema.plan import (
    ActivationPlan,
    Eviction,
    LayerPlan,
    RecomputePlan,
    RoutingPlan,
    UpdateInBackward,
)
from tests.run.plans import optimizer_plan

STEPS = 3
pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.rnn = nn.LSTM(16, 16, batch_first=True)
        self.blocks = nn.ModuleList(Block(16) for _ in range(2))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        x, _ = self.rnn(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x[:, -1])


def make() -> Net:
    torch.manual_seed(0)
    return Net()


def plan_for(mechanism: str, model: nn.Module, workdir: str):
    """A hand-made plan with `mechanism` alone (the optimizer's: AdamW's states on the host or the emulated AXDIMM;
    `resident`: on the host for a model on a GPU, whose weights it lays out flat per bucket)."""
    device = mechanism if mechanism in ("host", "axdimm") else "host"
    plan = optimizer_plan(model, device=device)
    if mechanism not in ("host", "axdimm", "resident"):
        plan = replace(plan, optimizer=None, omitted={**plan.omitted, "optimizer": "test"})
    omitted = {k: v for k, v in plan.omitted.items() if k not in ("activations", "layers", "routing")}
    names = [s.name for s in select_layers(model, "module")]
    if mechanism == "tiering":
        schedule = [Eviction(layer=n, evict_bytes=1 << 30, prefetch_at_s=0.0, prefetch_after=n) for n in names]
        return replace(plan, omitted={**omitted, "layers": "test", "routing": "test"},
                       activations=ActivationPlan(fast="dram", slow="nvme0", slow_path=workdir, stay_time_s=0.0,
                                                  min_tensor_bytes=0, schedule=schedule))
    if mechanism == "in_backward":
        return replace(plan, update_in_backward=UpdateInBackward(kind="adamw"))
    if mechanism == "recompute":
        return replace(plan, recompute=RecomputePlan(blocks=["blocks.0", "blocks.1"]))
    if mechanism == "shadow":  # each mode in turn, Adam on the host (layers off the GPU need it)
        modes = ("dha", "gfgb", "dfgb")
        return replace(optimizer_plan(model, device="host"), omitted={"activations": "test", "routing": "test"},
                       layers=[LayerPlan(name=n, mode=modes[i % 3], grad="host") for i, n in enumerate(names)])
    if mechanism == "routing":
        return replace(plan, omitted={**omitted, "layers": "test", "activations": "test"},
                       routing=RoutingPlan(threshold_bytes=1024, latency_peer=0, bandwidth_peer=0, shard_bytes=4096,
                                           dual_sync_bytes=4096))
    return plan


def train(model: nn.Module, copies: list | None = None, wrap=lambda m: m) -> list[float]:
    """Adam(W) steps; with `copies`, after the second step a pickle and a deep copy of the model join it."""
    trained = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        loss = F.cross_entropy(trained(torch.randn(4, 5, 8, generator=g)), torch.randint(4, (4,), generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if copies is not None and step == 1:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            copies += [buffer.getvalue(), copy.deepcopy(model), {k: v.detach().cpu().clone()
                                                                 for k, v in model.state_dict().items()}]
    return losses


def hetero_left(module: nn.Module) -> int:
    """Module hooks and instance forwards on `module` and its children."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._state_dict_pre_hooks)
               + ("forward" in m.__dict__) for m in module.modules())


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


MECHANISMS = ("tiering", "host", "axdimm", "in_backward", "recompute", "shadow", "routing", "resident")


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_model_saved_and_deep_copied_mid_training_carries_nothing_of_hetero(mechanism, tmp_path, request):
    if mechanism == "shadow":
        request.getfixturevalue("stand_in")
    if mechanism == "routing":
        request.getfixturevalue("one_rank")
    wrap = DDP if mechanism == "routing" else (lambda m: m)
    reference = make()
    expected = train(reference, wrap=wrap)
    model, workdir, copies = make(), str(tmp_path / "work"), []
    if mechanism == "resident":
        request.getfixturevalue("stand_ins").to(model, 0)
    os.makedirs(workdir)
    with Runtime(plan_for(mechanism, model, workdir), script=__file__):
        losses = train(model, copies, wrap)
        # the mechanism's hooks are on the model then (the optimizer's are on its parameters; routing's come off
        # once the first forward gave the parameters' order)
        assert hetero_left(model) > 0 or mechanism in ("host", "axdimm", "in_backward", "routing", "resident")
    saved, twin, state = copies
    assert b"hetero" not in saved  # no class or function of hetero's: it loads in a process without it
    loaded = torch.load(io.BytesIO(saved), weights_only=False)
    for other in (loaded, twin):
        assert hetero_left(other) == 0
        for key, value in other.state_dict().items():
            assert_close(value.cpu(), state[key], msg=key)
        other.to("cpu")(torch.randn(2, 5, 8)).sum().backward()  # a model of its own, trainable without hetero
    assert_close(torch.tensor(losses), torch.tensor(expected))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p.detach().cpu(), q)
