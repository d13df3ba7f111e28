"""Equivalence: training under the offloaded optimizer equals plain torch.optim.AdamW from the same seed."""

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from hetero.harness.script import StopScript
from hetero.kernels.adam import AdamKernel
from hetero.run import offloaded_adam
from hetero.run.offloaded_adam import Offloaded
from hetero.run.runtime import Runtime
from hetero.run.states import Driver
from hetero.schema.names import UPDATE_BUCKETS, UpdateBuckets, update_buckets
from tests.figures import figures
from tests.run.plans import optimizer_plan

STEPS = 20


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 5))


def batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(8, 12, generator=g), torch.randint(5, (8,), generator=g)


def train(model, steps=STEPS, *, accum=1, clip=None, schedule=False, kind="AdamW", start=0, opt_state=None):
    """The script under test: a plain loop as users write it; returns losses and the optimizer."""
    opt = getattr(torch.optim, kind)(model.parameters(), lr=1e-2, weight_decay=0.1)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5)) if schedule else None
    losses = []
    for step in range(start, start + steps):
        for micro in range(accum):
            x, y = batch(step, micro)
            loss = F.cross_entropy(model(x), y) / accum
            loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses, opt


def compare(reference, model_ref, result, model_run):
    assert_close(torch.tensor(result), torch.tensor(reference))
    for p, q in zip(model_run.parameters(), model_ref.parameters()):
        assert_close(p, q)


def run_both(plan_kwargs=None, **train_kwargs):
    ref_model, model = make_model(), make_model()
    ref, _ = train(ref_model, **train_kwargs)
    with Runtime(optimizer_plan(model, **(plan_kwargs or {})), script=__file__):
        out, opt = train(model, **train_kwargs)
        assert isinstance(opt, Offloaded), "the script's AdamW was not replaced"
    compare(ref, ref_model, out, model)


@pytest.mark.parametrize("device", ["axdimm", "host"])
def test_plain_training_is_equivalent(device):
    run_both({"device": device})


def test_adam_without_decoupled_weight_decay():
    run_both({"kind": "adam"}, kind="Adam")


def test_gradient_accumulation_launches_on_the_last_micro_batch():
    run_both({"micro_batches": 4}, accum=4)


def test_clipping_with_updates_after_backward():
    run_both({"overlap": False}, clip=0.5)


def test_clipping_after_overlapped_updates_stops_the_run_before_the_model_changes():
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StopScript) as e, Runtime(optimizer_plan(model, overlap=True), script=__file__):
        train(model, clip=0.5)
    assert e.value.error.exit_code == 4
    for key, value in model.state_dict().items():  # the first step's updates never reached the weights
        assert torch.equal(value, before[key]), key


def test_lr_scheduler_drives_the_offloaded_lr():
    run_both(schedule=True)


def test_nvme_overflow_is_equivalent_and_leaves_no_files(tmp_path):
    names = [n for n, _ in make_model().named_parameters()]
    run_both({"nvme": tuple(names[:3]), "nvme_path": str(tmp_path)})
    assert os.listdir(tmp_path) == []


def test_state_dict_continues_identically_in_torch_and_in_hetero(tmp_path):
    ref_model = make_model()
    ref, _ = train(ref_model, steps=STEPS)

    model = make_model()
    plan = optimizer_plan(model, nvme=("3.weight",), nvme_path=str(tmp_path))
    with Runtime(plan, script=__file__):
        first, opt = train(model, steps=10)
        torch.save(opt.state_dict(), tmp_path / "opt.pt")  # a checkpoint, as scripts write one
        params = [p.detach().clone() for p in model.parameters()]
    state = torch.load(tmp_path / "opt.pt")
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and state["state"][0]["step"] == 10

    torch_model = make_model()  # continue in plain torch
    with torch.no_grad():
        for p, q in zip(torch_model.parameters(), params):
            p.copy_(q)
    rest, _ = train(torch_model, steps=10, start=10, opt_state=torch.load(tmp_path / "opt.pt"))
    compare(ref, ref_model, first + rest, torch_model)

    hetero_model = make_model()  # continue in hetero, loading before the model's first forward
    with torch.no_grad():
        for p, q in zip(hetero_model.parameters(), params):
            p.copy_(q)
    with Runtime(optimizer_plan(hetero_model, nvme=("3.weight",), nvme_path=str(tmp_path)), script=__file__):
        rest, _ = train(hetero_model, steps=10, start=10, opt_state=torch.load(tmp_path / "opt.pt"))
    compare(ref, ref_model, first + rest, hetero_model)


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["axdimm", "host"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_cuda_model_trains_identically_with_states_off_the_gpu(device, overlap):
    """Gradients come down from the GPU (an event marks when each is final) and updated weights go back up in
    step(); the model never leaves the GPU."""
    ref_model, model = make_model().cuda(), make_model().cuda()
    ref, _ = train_on(ref_model, "cuda")
    with Runtime(optimizer_plan(model, device=device, overlap=overlap), script=__file__):
        out, opt = train_on(model, "cuda")
        assert isinstance(opt, Offloaded)
    assert all(p.is_cuda for p in model.parameters())
    compare(ref, ref_model, out, model)


def train_on(model, device: str, steps: int = 10):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


def train_fused(model, fused=True):
    """The test script: AdamW(fused=`fused`; None: torch's default), weight decay on, STEPS steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    for step in range(STEPS):
        x, y = batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("device", ["host", "axdimm"])
def test_updates_are_bit_for_bit_torchs_fused_adamw(device):
    """What "exactly" means: hetero's update is torch's fused AdamW op on flat buffers, bit for bit; torch's default
    single-tensor AdamW on CPU rounds differently, about 1 ULP per step (the other tests' assert_close)."""
    fused, default, ours = make_model(), make_model(), make_model()
    train_fused(fused)
    train_fused(default, fused=None)
    with Runtime(optimizer_plan(ours, device=device), script=__file__):
        train_fused(ours, fused=None)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), fused.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(ours.parameters(), default.parameters()))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("policy", [UPDATE_BUCKETS, UpdateBuckets(target_bytes=200 * 4)], ids=["default", "small"])
def test_a_step_makes_one_adam_call_and_one_driver_job_per_bucket(monkeypatch, overlap, policy):
    """3 modules far smaller than the default target share one bucket: one fused Adam call and one job for the host's
    driver (one wait) per step, launched from the gradient hooks or from step(); with a target of 200 elements the
    schema's rule makes 2 buckets, and the runtime as many calls. Training stays torch's fused AdamW, bit for bit."""
    calls: list[str] = []
    for cls, name in ((AdamKernel, "many"), (Driver, "submit")):
        monkeypatch.setattr(cls, name, counted(calls, name, getattr(cls, name)))
    monkeypatch.setattr(offloaded_adam, "buckets", functools.partial(offloaded_adam.buckets, policy=policy))
    fused, ours = make_model(), make_model()
    expected = len(set(update_buckets([(n, p.numel()) for n, p in ours.named_parameters()], policy).values()))
    modules = len({n.rpartition(".")[0] for n, _ in ours.named_parameters()})
    train_fused(fused)
    with Runtime(optimizer_plan(ours, device="host", overlap=overlap), script=__file__):
        train_fused(ours, fused=None)
    assert expected < modules == 3
    assert calls.count("many") == calls.count("submit") == STEPS * expected
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), fused.parameters()))


def counted(calls: list[str], name: str, fn):
    @functools.wraps(fn)
    def counting(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return counting



def test_an_accumulation_mismatch_stops_the_script_even_through_its_except_exception():
    model = make_model()
    with pytest.raises(StopScript) as stop, Runtime(optimizer_plan(model, micro_batches=2), script=__file__):
        try:
            train(model, steps=1, accum=1)  # the plan expects 2 backward passes per step
        except Exception:  # a script's catch-all must not swallow hetero's refusal
            pass
    assert stop.value.error.exit_code == 4 and "had 1 backward pass(es)" in stop.value.error.message


def test_an_optimizer_mixing_the_model_with_other_parameters_is_refused_in_one_line():
    model = make_model()
    extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(StopScript) as e, Runtime(optimizer_plan(model, overlap=False), script=__file__):
        opt = torch.optim.AdamW([*model.parameters(), extra])
        F.cross_entropy(model(batch(0)[0]), batch(0)[1]).backward()
        opt.step()
    error = e.value.error
    assert error.exit_code == 5 and "\n" not in error.message  # one line, naming the optimizer and what it adds
    assert "AdamW" in error.message and figures(error.message) == ["1"]


def test_an_optimizer_of_another_model_stays_torchs_own():
    ref_model, model = make_model(), make_model()
    torch.manual_seed(1)
    other_ref = nn.Linear(4, 2)
    torch.manual_seed(1)
    other = nn.Linear(4, 2)

    def side(net):  # a second model trained by its own Adam, beside the planned one
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for step in range(3):
            net(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        return opt

    ref, _ = train(ref_model)
    side(other_ref)
    with Runtime(optimizer_plan(model), script=__file__):
        out, _ = train(model)
        opt = side(other)
        assert opt._own and opt.state_bytes().params == 0 and set(opt.state_dict()["state"]) == {0, 1}
    compare(ref, ref_model, out, model)
    assert_close(other.weight, other_ref.weight)


def test_the_runtimes_buckets_are_the_calls_the_planner_prices():
    """One rule (hetero.schema.names.update_buckets) groups the updates the runtime hands its host Adam and the calls
    the planner prices: whole modules from the last one back, up to the target size (here 40 elements), the root
    module's own parameters among them."""
    from hetero.plan import axdimm
    from hetero.run.offloaded_adam import buckets
    from hetero.schema.names import UpdateBuckets
    from hetero.schema.plan import StatePlacement

    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 2, bias=False)))
    model.register_parameter("scale", nn.Parameter(torch.ones(1)))
    policy = UpdateBuckets(target_bytes=40 * 4)
    named = dict(model.named_parameters())
    of = buckets({p: n for n, p in named.items()}, policy)
    ran = {frozenset(n for n, p in named.items() if of[p] is bucket) for bucket in of.values()}
    params = [axdimm.Param(name=n, layer=0, num_params=p.numel()) for n, p in named.items()]
    where = {n: StatePlacement(param=n, tier="host") for n in named}
    priced = {frozenset(p.name for p in call) for call in axdimm.calls(params, where, bucketed=True, policy=policy)}
    assert ran == priced == {frozenset({"0.weight", "0.bias"}), frozenset({"1.0.weight", "1.0.bias", "1.1.weight"}),
                             frozenset({"scale"})}
