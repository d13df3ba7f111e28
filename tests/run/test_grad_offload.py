"""Host gradients (GO-MemFerry): every gradient of a `grad: host` parameter is the host buffer itself, written by the
backward GEMM where the op allows, and equal to autograd's own gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from hetero.kernels.dha import CudaDevice, same_memory
from hetero.run.grad_offload import HostGrads, LinearToHost
from tests.run.test_shadow import TINY, batch, gpt
from tests.standin import StandInDevice


def backward(model: nn.Module, micro: int = 0, device: str = "cpu") -> None:
    x, y = batch(0, micro, TINY["vocab"], TINY["block_size"], device)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()


def offload_all(model: nn.Module, device=None) -> HostGrads:
    return HostGrads(device or StandInDevice(), list(model.named_parameters()), model)


def assert_in_host_memory(grads: HostGrads) -> None:
    for slot in grads.slots.values():
        assert slot.param.grad is not None and same_memory(slot.param.grad, slot.alias)


def test_gradients_are_the_host_buffers_and_equal_autograds():
    ref, model = gpt(), gpt()
    grads = offload_all(model)
    backward(ref)
    backward(model)
    assert_in_host_memory(grads)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
    linear = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    assert {n for n, m in model.named_modules() if m in grads.patched} == set(linear)  # the tied head is not
    assert grads.counts == {"direct": 2 * len(linear), "copied": len(grads.slots) - 2 * len(linear)}


def test_micro_batches_accumulate_in_place():
    ref, model = gpt(), gpt()
    grads = offload_all(model)
    for micro in range(3):
        backward(ref, micro)
        backward(model, micro)
        assert_in_host_memory(grads)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)
    assert sum(grads.counts.values()) == len(grads.slots)  # written into host memory on the first micro-batch only


def test_an_unused_parameter_keeps_no_gradient():
    model = nn.ModuleDict({"used": nn.Linear(4, 2), "unused": nn.Linear(4, 2)})
    grads = offload_all(model)
    model["used"](torch.randn(3, 4)).sum().backward()
    assert model["unused"].weight.grad is None and model["used"].weight.grad is not None
    assert grads.counts["direct"] == 2


def test_a_gradient_put_elsewhere_is_moved_to_host_memory():
    torch.manual_seed(0)
    ref, model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model.load_state_dict(ref.state_dict())
    grads = offload_all(model)
    x = torch.randn(3, 4)
    for m in (ref, model):
        m[1].weight.grad = torch.ones(4)  # the script's own buffer: AccumulateGrad adds into it
        (m(x) ** 2).sum().backward()
    assert_in_host_memory(grads)
    assert grads.counts["fallback"] == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)


def test_linear_to_host_equals_linear():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 6, requires_grad=True)
    ref, lin = nn.Linear(6, 3), nn.Linear(6, 3)
    lin.load_state_dict(ref.state_dict())
    g = torch.randn(2, 5, 3)
    F.linear(x, ref.weight, ref.bias).backward(g)
    expected = x.grad.clone(), ref.weight.grad, ref.bias.grad
    x.grad = None
    grads = offload_all(lin)
    LinearToHost.apply(x, lin.weight, lin.bias, grads).backward(g)
    for got, want in zip((x.grad, lin.weight.grad, lin.bias.grad), expected):
        assert_close(got, want)
    assert grads.counts["direct"] == 2


def test_the_step_reads_the_host_bytes_behind_the_gradients_and_close_restores_the_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
    device = StandInDevice()
    grads = offload_all(model, device)
    model(torch.randn(3, 4)).sum().backward()
    slots = list(grads.slots.values())
    assert all(grads.host_of(s.param) is s.host for s in slots) and grads.host_of(torch.zeros(1)) is None
    for s in slots:  # `.grad` stays a device view (a parameter and its gradient never change device)
        host = device.host_view(s.param.grad)
        assert not device.is_host(s.param.grad) and device.is_host(host) and same_memory(host, s.host)
        assert host.shape == s.param.shape and torch.equal(host, s.param.grad)
    assert device.host_view(torch.zeros(4)) is None
    grads.close()
    assert all("forward" not in m.__dict__ for m in model)
    model.zero_grad(set_to_none=True)
    model(torch.randn(3, 4)).sum().backward()
    assert not any(same_memory(s.param.grad, s.alias) for s in slots)


@pytest.mark.gpu
def test_gpu_gradients_live_in_host_memory_only():
    ref, model = gpt().cuda(), gpt().cuda()
    grads = offload_all(model, CudaDevice())
    backward(ref, device="cuda")
    backward(model, device="cuda")  # warm-up: cuBLAS workspaces, the autograd thread's too
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    backward(model, device="cuda")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before  # no gradient buffer stays on the GPU
    assert_in_host_memory(grads)
    assert all(s.param.grad.is_cuda for s in grads.slots.values())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)
    assert grads.counts["direct"] > 0 and grads.counts["fallback"] == 0
