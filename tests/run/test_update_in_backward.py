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
from hetero.run.runtime import Runtime
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
