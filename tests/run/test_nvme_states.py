"""Optimizer states on NVMe without an AXDIMM: every state in files, staged through host memory in pieces, trains
exactly as torch's AdamW (fused arithmetic), and its state_dict reads back torch's format from the files."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from hetero.run import nvme_states
from hetero.run.runtime import Runtime
from hetero.schema.plan import NvmeOverflow
from tests.run.plans import optimizer_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8))


def train(net: nn.Module, *, micro: int = 1, clip: float = 0.0, zero: str = "optimizer", steps: int = 3,
          seen: list | None = None) -> tuple[list[float], dict]:
    """Gradient accumulation over `micro` backward passes, an optional clip, zeroing by the optimizer or module."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    losses = []
    for step in range(steps):
        (opt if zero == "optimizer" else net).zero_grad()
        for m in range(micro):
            g = torch.Generator().manual_seed(10 * step + m)
            loss = F.cross_entropy(net(torch.randn(16, 24, generator=g)), torch.randint(8, (16,), generator=g))
            (loss / micro).backward()
            losses.append(loss.item())
        if seen is not None:
            seen.append([p.grad is None for p in net.parameters()])
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return losses, opt.state_dict()


@pytest.mark.parametrize("chunk", [NvmeOverflow.STAGING_PIECE_PARAMS, 100], ids=["whole", "pieces of 100"])
def test_every_state_on_nvme_trains_as_torch(chunk, tmp_path, monkeypatch):
    monkeypatch.setattr(NvmeOverflow, "STAGING_PIECE_PARAMS", chunk)
    reference = model()
    ref_losses, ref_state = train(reference)
    net = model()
    names = tuple(n for n, _ in net.named_parameters())
    with Runtime(optimizer_plan(net, device="host", nvme=names, nvme_path=str(tmp_path)), script=__file__):
        losses, state = train(net)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        assert_close(p, q, msg=name)
    for k, s in ref_state["state"].items():
        for field in ("exp_avg", "exp_avg_sq"):
            assert_close(state["state"][k][field], s[field])
    assert not list(tmp_path.rglob("*.bin"))  # the files went with the run


def test_pieces_cover_a_tensor_once_and_a_gpus_whole():
    assert nvme_states.pieces(10, on_cpu=True) == [(0, 10)]
    n = 2 * NvmeOverflow.STAGING_PIECE_PARAMS + 5
    spans = nvme_states.pieces(n, on_cpu=True)
    assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert max(b - a for a, b in spans) == NvmeOverflow.STAGING_PIECE_PARAMS
    assert nvme_states.pieces(n, on_cpu=False) == [(0, n)]


@pytest.mark.parametrize(("micro", "clip", "zero"), [(1, 0.0, "optimizer"), (3, 0.0, "module"), (2, 0.05, "optimizer")],
                         ids=["one micro-batch", "accumulated, module zero_grad", "clipped"])
def test_gradients_kept_on_nvme_train_as_torch(micro, clip, zero, tmp_path, monkeypatch):
    monkeypatch.setattr(NvmeOverflow, "STAGING_PIECE_PARAMS", 100)
    reference = model()
    ref_losses, ref_state = train(reference, micro=micro, clip=clip, zero=zero)
    net = model()
    names = tuple(n for n, _ in net.named_parameters())
    seen: list = []
    plan = optimizer_plan(net, device="host", overlap=False, micro_batches=micro, nvme=names,
                          nvme_path=str(tmp_path), grads=True)
    with Runtime(plan, script=__file__):
        losses, state = train(net, micro=micro, clip=clip, zero=zero, seen=seen)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        assert_close(p, q, msg=name)
    for k, s in ref_state["state"].items():
        assert_close(state["state"][k]["exp_avg_sq"], s["exp_avg_sq"])
    assert all(all(step) for step in seen)  # host memory held no gradient between backward and step
    assert not list(tmp_path.rglob("*.bin"))


def test_zero_grad_forgets_a_kept_gradient(tmp_path):
    def run(net: nn.Module) -> None:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        torch.manual_seed(1)
        net(torch.randn(4, 24)).sum().backward()
        opt.zero_grad()  # the first gradient must not reach the update
        net(torch.randn(4, 24)).square().sum().backward()
        opt.step()

    reference, net = model(), model()
    run(reference)
    names = tuple(n for n, _ in net.named_parameters())
    with Runtime(optimizer_plan(net, device="host", overlap=False, nvme=names, nvme_path=str(tmp_path), grads=True),
                 script=__file__):
        run(net)
    for p, q in zip(net.parameters(), reference.parameters()):
        assert_close(p, q)
