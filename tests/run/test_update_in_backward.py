"""The plan's `update_in_backward`: the script's own Adam(W) steps each parameter from its post-accumulate-grad hook
and frees the gradient, training bit for bit as plain torch (LR schedule and state_dict included); what it cannot
train the same way (a second backward before step, clipping) stops the run with one line, and another model's
optimizer stays torch's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetero.errors import STALE_PLAN
from hetero.harness.script import StopScript
from hetero.run import update_in_backward
from hetero.run.runtime import Runtime
from hetero.run.update_in_backward import LANES, pieces
from hetero.schema.plan import UpdateInBackward
from tests.run.plans import optimizer_plan
from tests.run.test_nvme_states import model

pytestmark = pytest.mark.usefixtures("one_thread")


def in_backward(net: nn.Module, kind: str = "adamw"):
    plan = optimizer_plan(net, device="host", kind=kind)
    return replace(plan, optimizer=None, update_in_backward=UpdateInBackward(kind=kind),
                   omitted={**plan.omitted, "optimizer": "test"})


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 24, generator=g), torch.randint(8, (16,), generator=g)


def train(net: nn.Module, cls: str = "AdamW", steps: int = 4, grads_seen: list | None = None, **options):
    opt = getattr(torch.optim, cls)(net.parameters(), lr=1e-2, **options)  # looked up as a script does, when run
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        if grads_seen is not None:
            grads_seen.append(sum(p.grad is not None for p in net.parameters()))
        opt.step()
        schedule.step()
        losses.append(loss.item())
    return losses, opt.state_dict()


@pytest.mark.parametrize("cls,options", [("AdamW", {"weight_decay": 0.1}), ("Adam", {}), ("AdamW", {"fused": True})],
                         ids=["adamw", "adam", "fused"])
def test_updating_in_backward_trains_bit_for_bit_as_plain(cls, options):
    reference = model()
    expected, expected_state = train(reference, cls, **options)
    net, seen = model(), []
    with Runtime(in_backward(net, cls.lower()), script=__file__) as rt:
        losses, state = train(net, cls, grads_seen=seen, **options)
        summary = [line for m in rt.mechanisms for line in m.summary()]
        assert any("during backward" in line for line in summary), summary
    assert losses == expected and seen == [0] * len(seen)  # every gradient freed by the time backward returns
    for p, q in zip(net.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    for k, s in expected_state["state"].items():
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state["state"][k][field], s[field])
    assert state["param_groups"] == expected_state["param_groups"]  # the schedule's LR, as torch keeps it


def uneven() -> nn.Module:  # weights of 888 and 296 elements: pieces of 64 and a remainder each
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 37), nn.ReLU(), nn.Linear(37, 8))


@pytest.mark.parametrize("cls,options", [("AdamW", {"weight_decay": 0.1}), ("Adam", {"weight_decay": 0.1}),
                                         ("Adam", {"amsgrad": True, "maximize": True})],
                         ids=["adamw", "adam-l2", "amsgrad-maximize"])
def test_a_parameter_larger_than_a_piece_is_stepped_in_pieces_bit_for_bit(cls, options, monkeypatch):
    stepped = []

    def spy(base, optimizer, closure=None):
        stepped.append(max((p.numel() for g in optimizer.param_groups for p in g["params"] if p.grad is not None),
                           default=0))
        return step(base, optimizer, closure)

    step = update_in_backward.torch_step
    monkeypatch.setattr(update_in_backward, "torch_step", spy)
    monkeypatch.setattr(update_in_backward, "update_piece_bytes", lambda threshold: LANES * 4)  # 64 fp32
    reference = uneven()
    expected, expected_state = train(reference, cls, **options)
    net = uneven()
    with Runtime(in_backward(net, cls.lower()), script=__file__):
        losses, state = train(net, cls, **options)
    assert losses == expected and max(stepped) == LANES  # the first step's too
    for p, q in zip(net.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    for k, s in expected_state["state"].items():
        assert state["state"][k].keys() == s.keys()
        for field, value in s.items():
            assert torch.equal(state["state"][k][field], value) and state["state"][k][field].dtype == value.dtype


def test_pieces_are_whole_lanes_but_the_last_and_only_where_torch_loops_element_by_element():
    p = torch.zeros(300, requires_grad=True)
    p.grad = torch.zeros(300)
    assert pieces(p, {}, 4 * 100) == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]
    assert pieces(p, {}, 4 * 320) is None  # one piece: stepped whole
    assert pieces(p, {"foreach": True}, 256) is None and pieces(p, {"fused": True}, 256) is None
    strided = torch.zeros(20, 30, requires_grad=True)
    strided.grad = torch.zeros(30, 20).t()
    assert pieces(strided, {}, 256) is None


def test_a_second_backward_before_step_stops_the_run():
    net = model()
    with Runtime(in_backward(net), script=__file__), pytest.raises(StopScript) as e:
        opt = torch.optim.AdamW(net.parameters())
        for micro in range(2):  # gradient accumulation: the plan's profile saw one backward per step
            x, y = batch(micro)
            F.cross_entropy(net(x), y).backward()
        opt.step()
    assert e.value.error.exit_code == STALE_PLAN and "second backward" in e.value.error.message


def test_clipping_is_refused_rather_than_trained_differently():
    net = model()
    with Runtime(in_backward(net), script=__file__), pytest.raises(StopScript) as e:
        torch.optim.AdamW(net.parameters())
        x, y = batch(0)
        F.cross_entropy(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    assert e.value.error.exit_code == STALE_PLAN and "clips" in e.value.error.message


def test_another_models_optimizer_stays_torchs():
    net, other = model(), nn.Linear(24, 8)
    with Runtime(in_backward(net), script=__file__):
        ours, theirs = torch.optim.AdamW(net.parameters()), torch.optim.AdamW(other.parameters())
        x, y = batch(0)
        (F.cross_entropy(net(x), y) + F.cross_entropy(other(x), y)).backward()
        assert all(p.grad is None for p in net.parameters())
        assert all(p.grad is not None for p in other.parameters())  # left for the script's own step
        before = [p.detach().clone() for p in other.parameters()]
        ours.step()
        theirs.step()
        assert all(not torch.equal(p, q) for p, q in zip(other.parameters(), before))


def test_several_ranks_are_refused_rather_than_updated_before_their_all_reduce(monkeypatch):
    from hetero.run import update_in_backward
    monkeypatch.setattr(update_in_backward, "several_ranks", lambda: True)  # a 2-rank process group, as DDP sees it
    net = model()
    with Runtime(in_backward(net), script=__file__), pytest.raises(StopScript) as e:
        torch.optim.AdamW(net.parameters())
        x, y = batch(0)
        F.cross_entropy(net(x), y).backward()
    assert e.value.error.exit_code == STALE_PLAN and "several ranks" in e.value.error.message
