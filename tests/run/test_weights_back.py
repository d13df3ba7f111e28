"""Weights back per bucket (issue 55 items 5 and 6), on the stand-in device, for a plan shaped like the GPU bench's: a
GPU model whose layers are DHA with host gradients where the layers section names them and resident (device memory,
gradients on the GPU) where it leaves them out, Adam on the host in buckets; and for a model resident whole (no layers
section), where every bucket's weights go back. At the first step each bucket's resident weights become views into
one device buffer, their masters views into one pinned host buffer (hetero.run.states.flatten), so each bucket's
update starts its weights back to device memory with one async upload (one event) right after it runs, on the driver
thread, or in step() for updates that overlapped backward: Adam calls = weight uploads = buckets holding resident
weights, and the next kernels wait on the stream, never the host. Training stays bit-equal to torch's
AdamW(fused=True)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from hetero.harness.layers import select_layers
from hetero.kernels.adam import AdamKernel
from hetero.run import offloaded_adam
from hetero.run.runtime import Runtime
from hetero.schema.names import UpdateBuckets
from hetero.schema.plan import LayerPlan
from tests.run.plans import optimizer_plan
from tests.run.test_one_master import bit_equal, fused_reference, script
from tests.run.test_shadow import batch, gpt
from tests.standin import StandInDevice

pytestmark = pytest.mark.usefixtures("one_thread")
WARM, MEASURED = 2, 2
BUCKET_BYTES = 20 << 10  # the tiny GPT's modules in several buckets, as a large model's are at 32 MiB
BENCH, WHOLE = "h.1.", ""  # left out of the layers section (weights and gradients in device memory): one block, all


def bench_plan(model, overlap: bool, resident: str = BENCH):
    """DHA layers with host gradients (with BENCH: embeddings, first block, the tied output layer), the layers whose
    names start with `resident` resident (WHOLE: no layers section)."""
    plan = optimizer_plan(model, device="host", overlap=overlap)
    if resident != WHOLE:
        plan.layers = [LayerPlan(name=s.name, mode="dha", grad="host") for s in select_layers(model, "module")
                       if not s.name.startswith(resident)]
        plan.omitted.pop("layers")
    return plan


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(offloaded_adam, "buckets",
                        functools.partial(offloaded_adam.buckets, policy=UpdateBuckets(target_bytes=BUCKET_BYTES)))


class Tally:
    """Per-step counts: Adam calls, and host copies into the weights made in step() on its thread."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.on = False
        self.where = threading.local()  # `step`: inside step(); `device`: running the stand-in's queued copies

    def add(self, what: str) -> None:
        if self.on:
            self.counts[what] += 1

    def inside(self, what: str) -> bool:
        return bool(getattr(self.where, what, 0))


@contextlib.contextmanager
def counting(monkeypatch, weights):
    """A Tally of Adam calls and of host copies into `weights()` (tensors) made inside step() on its thread, the
    stand-in's own queued copies (which stand for the device's) excepted."""
    tally = Tally()
    many = AdamKernel.many
    monkeypatch.setattr(AdamKernel, "many", lambda self, *a, **k: (tally.add("adam calls"), many(self, *a, **k))[1])
    run, real = StandInDevice._run, torch.Tensor.copy_

    def device_run(self, event):
        tally.where.device = getattr(tally.where, "device", 0) + 1  # nested: a stream waits for another first
        try:
            run(self, event)
        finally:
            tally.where.device -= 1

    def copy_(dst, *args, **kwargs):
        if tally.inside("step") and not tally.inside("device") and \
                any(w.data_ptr() <= dst.data_ptr() < w.data_ptr() + w.nbytes for w in weights()):
            tally.add("host copies of weights in step()")
        return real(dst, *args, **kwargs)

    monkeypatch.setattr(StandInDevice, "_run", device_run)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    yield tally


def per_step(model, stand_in: StandInDevice, tally: Tally, resident: list) -> dict:
    """Train WARM + MEASURED steps; what each measured step did (see the module's docstring)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(WARM + MEASURED):
        if step == WARM:
            stand_in.log.clear()
            stand_in.ops.clear()
            stand_in.synchronized.clear()
            tally.on = True
        x, y = batch(step, 0, model.wte.num_embeddings, model.wpe.num_embeddings)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        tally.where.step = True
        opt.step()
        tally.where.step = False
        opt.zero_grad()
    tally.on = False
    out = Counter(tally.counts)
    out.update(f"{stream} {what}" for stream, what in stand_in.ops)
    out.update(f"{op} uploaded" for op, name in stand_in.log if name == "uploaded")
    out["whole-device waits"] = stand_in.log.count(("synchronize", "step"))
    work = {what: n // MEASURED for what, n in out.items()}
    work["host waits"] = {thread.split("_")[0]: n // MEASURED for thread, n in stand_in.synchronized.items()}
    work["buckets"] = len({id(b) for b in opt._buckets.values()})
    work["buckets holding resident weights"] = len({id(opt._buckets[p]) for p in resident})
    return work


@pytest.mark.parametrize("resident", [BENCH, WHOLE])
@pytest.mark.parametrize("overlap", [False, True])
def test_weights_go_back_per_bucket_without_a_host_wait(stand_ins, small_buckets, monkeypatch, overlap, resident):
    model = stand_ins.to(gpt(), 0)
    params = [p for n, p in model.named_parameters() if n.startswith(resident)]  # the tied weight once
    with counting(monkeypatch, lambda: [p.data for p in model.parameters()]) as tally, \
            Runtime(bench_plan(model, overlap, resident), script=__file__):
        work = per_step(model, stand_ins.all[0], tally, params)
    buckets, back = work["buckets"], work["buckets holding resident weights"]
    assert buckets == 7 and len(params) == (12 if resident == BENCH else 28)
    assert back == (3 if resident == BENCH else buckets)
    assert work["adam calls"] == buckets
    # one host wait per bucket, on the optimizer's driver; overlapped updates keep the shadow model's wait for its
    # copies before the step (step() then writes the DHA layers' host copies from the homes' own masters)
    shadow = overlap and resident == BENCH
    assert work["host waits"] == {"hetero-host-adam": buckets, **({"MainThread": 1} if shadow else {})}
    # none into resident weights; overlapped updates of DHA layers copy their masters into the host copies in step()
    # (as before: such homes keep a master of their own until step(), and a DHA layer's weights are its host copy)
    dha = sum(1 for _ in model.parameters()) - len(params)
    assert work.get("host copies of weights in step()", 0) == (dha if overlap else 0)
    assert work["prefetch host to device"] == back  # one async upload per bucket holding resident weights
    assert work["record_prefetch uploaded"] == back
    assert work["d2h device to host"] == len(params)  # their gradients, downloaded by the driver one by one
    # one event per bucket holding resident weights, waited on by the compute stream, never the host
    assert work["compute_waits uploaded"] == back and "synchronize uploaded" not in work
    assert work["whole-device waits"] == 0
    assert not stand_ins.all[0].violations  # no device buffer freed under a queued copy
    assert len({p.untyped_storage().data_ptr() for p in params}) == back  # each bucket's weights: one buffer


@pytest.mark.parametrize("rollback, resident", [(False, BENCH), (True, BENCH), (True, WHOLE)])
@pytest.mark.parametrize("overlap", [False, True])
def test_training_is_bit_equal_to_fused_adamw(stand_ins, small_buckets, overlap, rollback, resident):
    """With `rollback`, a checkpoint loaded mid-training (the optimizer's loads wait for the last uploads first)."""
    ref, reference = fused_reference(rollback)
    model = stand_ins.to(gpt(), 0)
    with Runtime(bench_plan(model, overlap, resident), script=__file__):
        out = script(model, rollback=rollback)
    assert out == ref and bit_equal(model, reference)


def test_a_parameter_given_other_memory_still_gets_its_weights(stand_ins, small_buckets):
    """After the first step the script gives a resident parameter new device memory (`p.data = ...`, not in its
    bucket's flat buffer any more): its bucket's weights then go back one copy each, and training still equals
    torch's."""
    def train(model, fused=None):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
        for step in range(3):
            x, y = batch(step, 0, model.wte.num_embeddings, model.wpe.num_embeddings)
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                p = model.h[1].mlp.c_fc.weight
                p.data = p.data.clone()

    reference = gpt()
    train(reference, fused=True)
    model = stand_ins.to(gpt(), 0)
    with Runtime(bench_plan(model, overlap=False), script=__file__):
        train(model)
    assert bit_equal(model, reference)
