"""The optimizer's GPU paths on the stand-in devices: gradients come down on the download stream (never the compute
stream), after their ready event, into host memory the update reads only once the copy's own event completed; and
every device the run uses is the one the model is on, whichever was current when the runtime was made."""

from __future__ import annotations

from collections import Counter

import pytest

from hetero.run.runtime import Runtime
from hetero.run.states import GradientSource
from tests.run.plans import optimizer_plan
from tests.run.test_shadow import STEPS, compare, gpt, layer_plan, shadow_of, train
from tests.standin import COMPUTE, D2H


def run_plan(device: str, overlap: bool, grad: str = "gpu", model=None):
    ref_model, model = gpt(), model or gpt()
    ref = train(ref_model)
    plan = layer_plan(model, "mixed", grad, overlap)
    plan.optimizer = optimizer_plan(model, device=device, overlap=overlap).optimizer
    with Runtime(plan, script=__file__):
        out = train(model)
    compare(model, ref_model, out, ref)
    return model


def check_downloads(dev, model) -> None:
    """One download per parameter and step, each on the D2H stream after a compute-stream event; no host copy on
    the compute stream."""
    params = sum(1 for _ in model.parameters())
    assert dev.ops.count((D2H, "device to host")) == STEPS * params
    assert not [op for op in dev.ops if op[0] == COMPUTE and op[1] != "write"]
    waits = [name for op, name in dev.log if op == "d2h_waits"]
    assert waits == ["gradient ready"] * (STEPS * params)


@pytest.mark.parametrize("device", ["host", "axdimm"])
@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_gradients_come_down_on_the_download_stream(stand_in, device, overlap):
    model = run_plan(device, overlap)
    check_downloads(stand_in, model)


def test_spilled_states_gradients_come_down_the_same_way(stand_in, tmp_path):
    """Updated inside step() through the staging slots (hetero.run.states.NvmeStaging)."""
    ref_model, model = gpt(), gpt()
    ref = train(ref_model)
    plan = layer_plan(model, "mixed", "gpu")
    spilled = ("h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "h.1.mlp.c_proj.weight")
    plan.optimizer = optimizer_plan(model, device="axdimm", nvme=spilled, nvme_path=str(tmp_path)).optimizer
    with Runtime(plan, script=__file__):
        out = train(model)
    compare(model, ref_model, out, ref)
    check_downloads(stand_in, model)


def test_optimizer_states_are_pinned_at_their_exact_size(stand_in):
    """Master, m, v and the gradient's landing place: four fp32 buffers of each parameter's size, not blocks rounded
    up to a power of two by torch's pinned allocator."""
    model = gpt()
    plan = layer_plan(model, "mixed", "gpu")
    with Runtime(plan, script=__file__) as runtime:
        train(model, steps=1)
        layers = sum(st.host.nbytes for st in shadow_of(runtime).layers)
    states = [4 * p.numel() for p in model.parameters() for _ in range(4)]
    assert Counter(states) <= Counter(stand_in.pinned_sizes)
    assert sum(stand_in.pinned_sizes) == sum(states) + layers  # and the shadow model's host copies, nothing else


def test_host_gradients_are_read_in_place(stand_in):
    run_plan("host", True, grad="host")
    assert (D2H, "device to host") not in stand_in.ops  # `grad: host`: the update reads the host bytes themselves


def test_a_copy_on_the_drivers_current_stream_is_caught(stand_in, monkeypatch):
    """What hetero did before: the driver thread copied the gradient itself, on its current stream (on a GPU the
    legacy default stream, where the script computes)."""
    def copy_here(self, dst, grad, ready):
        dst.copy_(grad)

    monkeypatch.setattr(GradientSource, "download_async", copy_here)
    monkeypatch.setattr(GradientSource, "finish", lambda self, done: None)
    model = run_plan("host", True)
    with pytest.raises(AssertionError):
        check_downloads(stand_in, model)


def test_an_update_that_does_not_wait_for_its_download_diverges(stand_in, monkeypatch):
    monkeypatch.setattr(GradientSource, "finish", lambda self, done: None)
    with pytest.raises(AssertionError):
        run_plan("host", True)  # the update read the poisoned (NaN) destination


@pytest.mark.parametrize("device", ["host", "axdimm"])
def test_the_run_binds_to_the_device_the_model_is_on(stand_ins, device):
    """As a torchrun worker: the runtime exists before the script picks its GPU (set_device, model.to)."""
    ref_model, model = gpt(), gpt()
    ref = train(ref_model)
    plan = layer_plan(model, "mixed", "gpu")
    plan.optimizer = optimizer_plan(model, device=device).optimizer
    with Runtime(plan, script=__file__):
        stand_ins.set_device(1)
        out = train(stand_ins.to(model, 1))
    compare(model, ref_model, out, ref)
    first, second = stand_ins.all
    assert second.allocations and second.log
    check_downloads(second, model)
    assert not first.allocations and not first.log and not first.ops
