"""One master copy: where host Adam's updates run in step() (OptimizerPlan.shares_master), each home's master is
the parameter's own host bytes (a CPU parameter's data, the shadow model's pinned host copy on a GPU): no master
buffer is allocated, no host copy of the weights happens in step(), the home holds 4 bytes a parameter fewer, and
training is bit for bit torch's AdamW(fused=True), through checkpoints saved and loaded mid-training too. The GPT
has tied weights (its embedding and its output layer share one parameter)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from hetero.run.optimizer import OptimizerOffload
from hetero.run.runtime import Runtime
from hetero.run.states import HostHome
from tests.run.plans import optimizer_plan
from tests.run.test_shadow import batch, compare, gpt, layer_plan, shadow_of, train

STEPS = 4
pytestmark = pytest.mark.usefixtures("one_thread")


def script(model, fused=None, rollback: bool = False, copies: list | None = None) -> list[float]:
    """AdamW steps; with `rollback`, a checkpoint saved after every step and, after the third, the first's loaded
    back (model, then optimizer); with `copies`, each step()'s writes into host memory recorded there."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    vocab, length = model.wte.num_embeddings, model.wpe.num_embeddings
    losses, first = [], None
    for step in range(STEPS + 2 * rollback):
        x, y = batch(step, 0, vocab, length)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        with recording(copies):
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rollback:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
            first = first or saved
            if step == 2:
                model.load_state_dict(first[0])
                opt.load_state_dict(first[1])
    return losses


@contextlib.contextmanager
def recording(into: list | None):
    """Meanwhile, the destination of every `Tensor.copy_` is appended to `into` (None: nothing recorded)."""
    real = torch.Tensor.copy_

    def copy_(dst, *args, **kwargs):
        into.append(dst)
        return real(dst, *args, **kwargs)

    if into is not None:
        torch.Tensor.copy_ = copy_
    try:
        yield
    finally:
        torch.Tensor.copy_ = real


def fused_reference(rollback: bool = False):
    model = gpt()
    return script(model, fused=True, rollback=rollback), model


def bit_equal(model, reference) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), reference.state_dict().values()))


def homes(runtime: Runtime) -> dict[torch.nn.Parameter, HostHome]:
    opt = runtime.find(OptimizerOffload).optimizers[0]
    return {p: slot.home for p, slot in opt._params.items()}


def held(runtime: Runtime) -> int:
    return runtime.find(OptimizerOffload).resident_bytes()["host"]["optimizer states"]


def landed_in(copies: list[torch.Tensor], weights: list[torch.Tensor]) -> int:
    """How many of `copies` wrote into the bytes of `weights` (host tensors)."""
    spans = [(w.data_ptr(), w.data_ptr() + w.nbytes) for w in weights]
    return sum(any(a <= c.data_ptr() < b for a, b in spans) for c in copies)


@pytest.mark.parametrize("overlap", [False, True])
def test_on_the_cpu_the_master_is_the_parameter(overlap):
    ref, reference = fused_reference()
    model, copies = gpt(), []
    numel = sum(p.numel() for p in model.parameters())
    with Runtime(optimizer_plan(model, device="host", overlap=overlap), script=__file__) as runtime:
        out = script(model, copies=copies)
        shared = [home.buffers[0].data_ptr() == p.data_ptr() for p, home in homes(runtime).items()]
        assert held(runtime) == (12 if overlap else 8) * numel  # m and v, and a master unless shared
    assert out == ref and bit_equal(model, reference)
    assert shared == [not overlap] * len(shared)
    assert landed_in(copies, list(model.parameters())) == (STEPS * len(shared) if overlap else 0)


@pytest.mark.parametrize("grad", ["gpu", "host"])
@pytest.mark.parametrize("overlap", [False, True])
def test_on_a_gpu_the_master_is_the_shadow_models_host_copy(stand_in, grad, overlap):
    ref, reference = fused_reference()
    model, copies = gpt(), []
    numel = sum(p.numel() for p in model.parameters())
    with Runtime(layer_plan(model, "mixed", grad, overlap), script=__file__) as runtime:
        out = script(model, copies=copies)
        layers = shadow_of(runtime).layers
        hosts = [st.host for st in layers]
        shared = {p: landed_in([home.buffers[0]], hosts) == 1 for p, home in homes(runtime).items()}
        assert held(runtime) == (16 if overlap else 12) * numel  # m, v, the gradient's landing place, a master
        grads = shadow_of(runtime).grads
    assert out == ref and bit_equal(model, reference)
    assert list(shared.values()) == [not overlap] * len(shared)
    assert landed_in(copies, hosts) == (STEPS * len(shared) if overlap else 0)
    buffers = 4 if overlap else 3
    extra = grads.host.nbytes if grads is not None else 0
    assert sum(stand_in.pinned_sizes) == buffers * 4 * numel + sum(h.nbytes for h in hosts) + extra


@pytest.mark.parametrize("where", ["cpu", "gpu"])
def test_a_checkpoint_loaded_mid_training_continues_as_torch(request, where):
    """The script rolls model and optimizer back to an earlier checkpoint between steps: on a GPU the loaded
    weights reach a GFGB layer's device buffer only, and the next step writes them into its host copy first."""
    ref, reference = fused_reference(rollback=True)
    model = gpt()
    plan = layer_plan(model, "mixed", "gpu", overlap=False) if where == "gpu" else \
        optimizer_plan(model, device="host", overlap=False)
    if where == "gpu":
        request.getfixturevalue("stand_in")
    with Runtime(plan, script=__file__):
        out = script(model, rollback=True)
    assert out == ref and bit_equal(model, reference)


def test_a_gpu_parameter_without_a_host_copy_gets_a_master_of_its_own(stand_ins):
    """No layers section: no shadow model places the parameters, so they have no host bytes to share; each home
    makes its master at the first step, and training still equals torch's."""
    ref, reference = fused_reference()
    model = stand_ins.to(gpt(), 0)
    numel = sum(p.numel() for p in model.parameters())
    with Runtime(optimizer_plan(model, device="host", overlap=False), script=__file__) as runtime:
        out = script(model)
        assert not any(home.shared for home in homes(runtime).values())
        assert held(runtime) == 16 * numel
    assert out == ref and bit_equal(model, reference)


@pytest.mark.gpu
def test_on_a_cuda_gpu_the_master_is_the_pinned_host_copy():
    ref_model, model = gpt().cuda(), gpt().cuda()
    ref = train(ref_model, device="cuda")
    with Runtime(layer_plan(model, "mixed", "gpu", overlap=False), script=__file__) as runtime:
        out = train(model, device="cuda")
        hosts = [st.host for st in shadow_of(runtime).layers]
        assert all(landed_in([home.buffers[0]], hosts) == 1 for home in homes(runtime).values())
    compare(model, ref_model, out, ref)
