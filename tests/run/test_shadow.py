"""The shadow model: the plan's per-layer storage and stream schedule (pure), and training through it, which must
equal plain PyTorch from the same seed: on the CPU stand-in device here (strict ordering: a copy poisons its
destination until something waits for it), on a CUDA GPU under the `gpu` marker."""

from __future__ import annotations

import gc
import importlib.util
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from hetero.errors import INVALID_FILE, STALE_PLAN, HeteroError
from hetero.harness.layers import select_layers
from hetero.harness.script import StopScript
from hetero.kernels.dha import same_memory
from hetero.run.runtime import Runtime
from hetero.run.shadow import ShadowModel
from hetero.run.shadow_layout import schedule
from hetero.schema.plan import LayerPlan, Plan
from tests.run.plans import optimizer_plan
from tests.standin import StandInDevice

STEPS = 10
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"
TINY = {"vocab": 64, "block_size": 16, "n_layer": 2, "n_embd": 32, "n_head": 2}


def gpt(**config) -> nn.Module:
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.GPT(**(config or TINY))


def batch(step: int, micro: int, vocab: int, length: int, device: str = "cpu", size: int = 4):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randint(vocab, (size, length), generator=g)
    return x.to(device), ((x + 1) % vocab).to(device)


def train(model: nn.Module, steps: int = STEPS, accum: int = 1, device: str = "cpu", size: int = 4,
          after_backward=None, after_forward=None) -> list[float]:
    """The script under test: a plain loop as users write it (with the test's callbacks)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    vocab, length = model.wte.num_embeddings, model.wpe.num_embeddings
    losses = []
    for step in range(steps):
        for micro in range(accum):
            x, y = batch(step, micro, vocab, length, device, size)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / accum
            if after_forward is not None:
                after_forward(step)
            loss.backward()
        if after_backward is not None:
            after_backward(step)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def compare(model: nn.Module, ref_model: nn.Module, out: list[float], ref: list[float]) -> None:
    """Losses and parameters equal. The key third of each attention input bias is left out: softmax is invariant to
    it, so its gradient is pure rounding noise, which Adam scales up to lr-sized steps that differ between any two
    implementations (hetero's host Adam against torch's, or a GEMM in another order); it never reaches the loss."""
    assert_close(torch.tensor(out), torch.tensor(ref))
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        p, q = p.detach().cpu(), q.detach().cpu()
        if name.endswith("attn.c_attn.bias"):
            c = p.numel() // 3
            p, q = torch.cat([p[:c], p[2 * c:]]), torch.cat([q[:c], q[2 * c:]])
        assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")


MODES = ("dha", "gfgb", "dfgb")


def layer_plan(model: nn.Module, mode: str, grad: str, overlap: bool = True, accum: int = 1) -> Plan:
    """Every layer in `mode` (`mixed`: dha, gfgb, dfgb in turn) with gradients on `grad`, Adam on the host."""
    plan = optimizer_plan(model, device="host", overlap=overlap, micro_batches=accum)
    names = [s.name for s in select_layers(model, "module")]
    plan.layers = [LayerPlan(name=n, mode=MODES[i % 3] if mode == "mixed" else mode, grad=grad)
                   for i, n in enumerate(names)]
    plan.omitted.pop("layers")
    return plan


def shadow_of(runtime: Runtime) -> ShadowModel:
    return next(m for m in runtime.mechanisms if isinstance(m, ShadowModel))


# -- the pure part ------------------------------------------------------------------------------------------------


def names(model: nn.Module) -> tuple[list[str], list[str]]:
    return [n for n, _ in model.named_modules()], [n for n, _ in model.named_parameters()]


def test_each_parameter_belongs_to_its_planned_layer():
    model = gpt()
    plan = layer_plan(model, "mixed", "host")
    sched = schedule(plan.layers, *names(model))
    # forward order, as planned; lm_head places nothing: its weight is wte's (tied), placed once
    assert [x.name for x in sched.layers] == [e.name for e in plan.layers if e.name != "lm_head"]
    assert sched.layers[0].params == ("wte.weight",)
    storage = sched.storage()
    assert set(storage) == {n for n, _ in model.named_parameters()}
    assert storage["h.0.attn.c_attn.weight"] == storage["h.0.attn.c_attn.bias"]
    assert sched.host_grads() == list(storage)


def test_block_granularity_places_everything_inside_a_block():
    model = gpt()
    entries = [LayerPlan(name=s.name, mode="dha", grad="gpu") for s in select_layers(model, "block")]
    sched = schedule(entries, *names(model))
    block = next(x for x in sched.layers if x.name == "h.1")
    assert block.params == tuple(n for n, _ in model.named_parameters() if n.startswith("h.1."))


def test_stream_plan():
    """GFGB copies after the step in forward order, each waited for by its own forward; DFGB copies after the
    forward in backward order, each switched before its own backward."""
    model = gpt()
    plan = layer_plan(model, "mixed", "gpu")
    sched = schedule(plan.layers, *names(model))
    placed = {x.name for x in sched.layers}
    gfgb = [e.name for e in plan.layers if e.mode == "gfgb" and e.name in placed]
    dfgb = [e.name for e in plan.layers if e.mode == "dfgb" and e.name in placed]
    assert gfgb and dfgb
    assert sched.copies_after_step() == sched.waits_before_forward() == gfgb
    assert sched.copies_after_forward() == dfgb[::-1]
    assert sched.switches_before_backward() == dfgb
    assert sched.host_grads() == []


def test_a_layer_the_model_lacks_is_a_clear_error(stand_in):
    model = gpt()
    plan = layer_plan(model, "dha", "gpu")
    plan.layers.append(LayerPlan(name="h.7.mlp.c_fc", mode="dha", grad="gpu"))
    with pytest.raises(HeteroError) as e:
        schedule(plan.layers, *names(model))
    assert e.value.exit_code == STALE_PLAN and "h.7.mlp.c_fc" in e.value.message
    with pytest.raises(StopScript) as stopped, Runtime(plan, script=__file__):
        train(model, steps=1)
    assert stopped.value.error.exit_code == STALE_PLAN and "does not have" in stopped.value.error.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_a_plan_with_layers_needs_a_gpu():
    model = gpt()
    with pytest.raises(HeteroError) as e:
        Runtime(layer_plan(model, "gfgb", "gpu"), script=__file__)
    assert e.value.exit_code == STALE_PLAN and "no CUDA device" in e.value.message


def test_layers_off_the_gpu_need_an_offloaded_optimizer(stand_in):
    model = gpt()
    plan = layer_plan(model, "dha", "gpu")
    plan.optimizer = None
    with pytest.raises(HeteroError) as e:
        Runtime(plan, script=__file__)
    assert e.value.exit_code == INVALID_FILE and "optimizer" in e.value.message
    plan.layers = [LayerPlan(name=x.name, mode="gfgb", grad="gpu") for x in plan.layers]
    assert Runtime(plan, script=__file__).mechanisms == []  # parameters stay where the script put them


# -- training through the stand-in ----------------------------------------------------------------------------------


def run_both(device: StandInDevice, mode: str, grad: str, overlap: bool = True, accum: int = 1, **kwargs):
    ref_model, model = gpt(), gpt()
    ref = train(ref_model, accum=accum)
    runtime = Runtime(layer_plan(model, mode, grad, overlap, accum), script=__file__)
    with runtime:
        out = train(model, accum=accum, **kwargs)
        sm = shadow_of(runtime)
        summary = runtime.summary()
    compare(model, ref_model, out, ref)
    return sm, summary


@pytest.mark.parametrize("mode", ["gfgb", "dha", "dfgb", "mixed"])
@pytest.mark.parametrize("grad", ["gpu", "host"])
def test_training_equals_plain_pytorch(stand_in, mode, grad):
    sm, summary = run_both(stand_in, mode, grad)
    for st in sm.layers:
        if st.spec.mode == "dha":  # computes on host memory itself
            assert all(same_memory(p, st.alias[off:]) for p, off in zip(st.params, st.offsets))
        if st.spec.mode == "gfgb":
            assert all(same_memory(p, st.gpu[off:]) for p, off in zip(st.params, st.offsets))
    buffers = [st for st in sm.layers if st.spec.mode != "dha"]
    assert len(stand_in.allocations) == len(buffers)  # allocated once at bind, never per step
    assert summary[0].startswith("shadow model on stand-in")


@pytest.mark.parametrize("overlap", [True, False])
def test_gradient_accumulation_and_updates_after_backward(stand_in, overlap):
    run_both(stand_in, "mixed", "host", overlap=overlap, accum=3)


@pytest.mark.parametrize("grad", ["gpu", "host"])
def test_dfgb_backward_reads_the_device_copy_only(stand_in, grad):
    """Once a DFGB layer's copy is made, its backward reads nothing of the host copy: the test poisons the host
    copies after the forward (the optimizer's master weights are elsewhere and rewrite them at the step), and
    training still equals plain; every saved view of a DFGB parameter came back as a view of the device copy (public
    torch only: saved-tensor hooks and `p.data`), and the parameters point at it after backward."""
    on_device = []

    def poison(step):
        sm = shadow_of(runtime)
        sm.device.synchronize(sm.copied)
        for st in sm.layers:
            st.host.fill_(255)  # NaN in every float format

    def check(step):
        for st in shadow_of(runtime).layers:
            on_device.append(st.on_gpu and all(same_memory(p, st.gpu[off:]) for p, off in zip(st.params, st.offsets)))

    ref_model, model = gpt(), gpt()
    ref = train(ref_model, steps=3)
    runtime = Runtime(layer_plan(model, "dfgb", grad), script=__file__)
    with runtime:
        out = train(model, steps=3, after_forward=poison, after_backward=check)
        layers = shadow_of(runtime).layers
        assert all(same_memory(p, st.alias[off:]) for st in layers for p, off in zip(st.params, st.offsets))
    assert all(on_device) and len(on_device) == 3 * len(layers)
    compare(model, ref_model, out, ref)


@pytest.mark.parametrize("overlap", [True, False])
def test_dfgb_with_tiering_and_host_gradients(stand_in, tmp_path, overlap):
    """DFGB's parameter views and tiering's evictions share the one saved-tensor hook pair: with both (and host
    gradients, Adam on the host), training equals plain, tiering moved bytes, and the backward read no host copy
    (poisoned from the forward's end until backward is done: updated in step(), the host copies are the master)."""
    from tests.run.test_tiering import tiering_plan

    ref_model, model = gpt(), gpt()
    ref = train(ref_model, steps=4)
    plan = layer_plan(model, "mixed", "host", overlap=overlap)
    plan.activations = tiering_plan(model, str(tmp_path / "nvme"), 1 << 30, min_tensor=256).activations
    plan.omitted.pop("activations")
    runtime = Runtime(plan, script=__file__)
    saved = {}

    def poison(step):
        sm = shadow_of(runtime)
        sm.device.synchronize(sm.copied)
        for st in sm.layers:
            if st.spec.mode == "dfgb":
                saved[id(st)] = st.host.clone()
                st.host.fill_(255)

    def restore(step):
        for st in shadow_of(runtime).layers:
            if id(st) in saved:
                st.host.copy_(saved.pop(id(st)))

    with runtime:
        out = train(model, steps=4, after_forward=poison, after_backward=restore)
        tiering = next(m for m in runtime.mechanisms if type(m).__name__ == "ActivationTiering")
        assert tiering.ledger.report().evictions > 0
    compare(model, ref_model, out, ref)


def test_schedule_happens_in_order(stand_in):
    """What the log shows for two steps of a mixed plan: GFGB copies issued after the step and each waited for by
    its own forward; DFGB copies issued after the forward, latest layer first, each after its forward's end and
    waited for before its own backward."""
    model = gpt()
    plan = layer_plan(model, "mixed", "gpu")
    with Runtime(plan, script=__file__):
        train(model, steps=2)
    log = stand_in.log
    dfgb = [e.name for e in plan.layers if e.mode == "dfgb"]
    gfgb = [e.name for e in plan.layers if e.mode == "gfgb"]
    first_step = log.index(("record_compute", "step"))
    copies = [name.removeprefix("ready ") for op, name in log[:first_step] if op == "record_copy" and name != "copies"]
    assert copies == dfgb[::-1]
    assert [n.removeprefix("forward ") for op, n in log[:first_step] if op == "copy_waits"] == dfgb[::-1]
    for name in dfgb:
        assert log.index(("record_copy", f"ready {name}")) < log.index(("compute_waits", f"ready {name}"))
    after = log[first_step:]
    step_copies = [n.removeprefix("ready ") for op, n in after if op == "record_copy" and n.startswith("ready ")]
    assert step_copies[:len(gfgb)] == gfgb
    assert ("synchronize", "copies") in after  # the host waited for the copies before the optimizer wrote
    assert log.count(("synchronize", "step")) == 1  # the whole device at close only: an update waits for its gradients
    for name in gfgb:
        issued = after.index(("record_copy", f"ready {name}"))
        assert ("compute_waits", f"ready {name}") in after[issued:]


@pytest.mark.parametrize("skip", ["forward wait", "backward wait"])
def test_the_stand_in_catches_a_missing_wait(stand_in, monkeypatch, skip):
    """The ordering above is necessary: drop any one of the waits and training diverges (poisoned or stale data)."""
    if skip == "forward wait":
        monkeypatch.setattr(ShadowModel, "_await_copy", lambda self, st, module, args: None)
    elif skip == "backward wait":
        def switch_without_waiting(self, st, grad_outputs):
            if st.copied and not st.on_gpu:
                st.point(st.gpu)
                st.on_gpu = True
        monkeypatch.setattr(ShadowModel, "_before_backward", switch_without_waiting)
    with pytest.raises(AssertionError):
        run_both(stand_in, "mixed", "gpu", overlap=False)


def test_state_dict_waits_for_weights_in_flight(stand_in):
    model = gpt()
    with Runtime(layer_plan(model, "gfgb", "gpu"), script=__file__):
        train(model, steps=2)
        assert stand_in.queue  # the next step's copies are issued and, here, poisoned until waited for
        state = model.state_dict()
        assert all(t.isfinite().all() for t in state.values())
        assert not stand_in.queue


@pytest.mark.parametrize("mode,grad", [("gfgb", "gpu"), ("dha", "host"), ("mixed", "gpu"), ("dfgb", "gpu")])
def test_the_model_and_its_optimizer_are_freed_when_the_run_ends(stand_in, mode, grad):
    """Nothing of a run outlives it: a process that trains several models (a notebook, these tests) gets their
    memory back (on an H100 each plan's model stayed allocated: the parameters' optimizer hooks held it)."""
    model = gpt()
    with Runtime(layer_plan(model, mode, grad), script=__file__):
        train(model, steps=2)
    freed = [weakref.ref(model), *map(weakref.ref, model.parameters())]
    del model
    gc.collect()
    assert all(ref() is None for ref in freed)


# -- CUDA ---------------------------------------------------------------------------------------------------------

GPU_CONFIG = {"vocab": 256, "block_size": 128, "n_layer": 4, "n_embd": 256, "n_head": 4}
GPU_ARGS = ["--vocab", "256", "--seq-len", "128", "--n-layer", "4", "--n-embd", "256", "--n-head", "4",
            "--batch-size", "8", "--device", "cuda", "--steps", "50"]
GPU_PLANS = {"all-gfgb": ("gfgb", "gpu"), "all-dha": ("dha", "gpu"), "mixed": ("mixed", "gpu"),
             "all-dfgb": ("dfgb", "gpu"), "host-grads": ("dha", "host"), "mixed-host-grads": ("mixed", "host"),
             "planned": None}


@pytest.fixture(scope="module")
def gpu_profile(tmp_path_factory):
    from hetero.profile.profiler import ProfileOptions, profile_script

    return profile_script(str(EXAMPLE), GPU_ARGS,
                          ProfileOptions(steps=3, warmup=2, nvme_dir=str(tmp_path_factory.mktemp("nvme"))))


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(GPU_PLANS))
def test_gpu_training_matches_plain_pytorch_within_predicted_memory(gpu_profile, config):
    """Equal to plain, and the process's reserved GPU peak within 5% of the plan's prediction (anchored on plain
    training's measured reserved peak: cuBLAS's workspaces and the allocator's rounding are in both)."""
    from hetero.plan.simulate import GPU
    from hetero.plan.solve import PlanOptions, plan, predict, predicted_of

    planned = plan(gpu_profile, PlanOptions(optimizer_device="host", reserve=1.0))
    planned.activations = None  # the shadow model alone: activation tiering has its own tests
    planned.omitted["activations"] = "test"
    if GPU_PLANS[config] is not None:
        mode, grad = GPU_PLANS[config]
        planned.layers = [LayerPlan(name=e.name, mode=MODES[i % 3] if mode == "mixed" else mode, grad=grad)
                          for i, e in enumerate(planned.layers)]
    predicted = predicted_of(gpu_profile, planned, predict(gpu_profile, planned)).peak_bytes[GPU]

    ref_model = gpt(**GPU_CONFIG).cuda()
    ref = train(ref_model, device="cuda", size=8)
    ref_model.cpu()  # out of the way of the measured run: only what a process of its own would hold is on the GPU
    gc.collect()
    torch.cuda.empty_cache()
    model = gpt(**GPU_CONFIG).cuda()
    peaks, held = [], []

    def measure(step):
        if step == 0:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # from the second step: the model is bound and placed
        peaks.append(torch.cuda.max_memory_reserved())
        held.append(torch.cuda.memory_allocated())

    with Runtime(planned, script=__file__):
        out = train(model, device="cuda", size=8, after_backward=measure)
    compare(model, ref_model, out, ref)
    assert len(set(held[1:])) == 1, f"GPU memory held after backward changes between steps: {held}"
    used = max(peaks[1:])
    assert used <= 1.05 * predicted, f"{config}: reserved {used / 2**20:.1f} MiB, predicted {predicted / 2**20:.1f} MiB"
