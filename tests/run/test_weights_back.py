"""Weights back per bucket (issue 55 item 6), on the stand-in device, for a plan shaped like the GPU bench's: a GPU
model whose layers are DHA with host gradients where the layers section names them and resident (device memory,
gradients on the GPU) where it leaves them out, Adam on the host in buckets. Each bucket's update starts its
resident weights back to device memory (async uploads, one event per bucket) right after it runs, on the driver
thread, or in step() for updates that overlapped backward; the next kernels wait on the stream, never the host.
Training stays bit-equal to torch's AdamW(fused=True)."""

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
RESIDENT = ("h.1.",)  # left out of the layers section: weights and gradients in device memory


def bench_plan(model, overlap: bool):
    """DHA layers with host gradients (embeddings, first block, the tied output layer), the rest resident."""
    plan = optimizer_plan(model, device="host", overlap=overlap)
    plan.layers = [LayerPlan(name=s.name, mode="dha", grad="host") for s in select_layers(model, "module")
                   if not s.name.startswith(RESIDENT)]
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


def per_step(model, stand_in: StandInDevice, tally: Tally) -> dict:
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
    return work


@pytest.mark.parametrize("overlap", [False, True])
def test_weights_go_back_per_bucket_without_a_host_wait(stand_ins, small_buckets, monkeypatch, overlap):
    model = stand_ins.to(gpt(), 0)
    resident = [p for n, p in model.named_parameters() if n.startswith(RESIDENT)]
    with counting(monkeypatch, lambda: [p.data for p in model.parameters()]) as tally, \
            Runtime(bench_plan(model, overlap), script=__file__):
        work = per_step(model, stand_ins.all[0], tally)
    buckets = work["buckets"]
    assert buckets == 7 and len(resident) == 12
    assert work["adam calls"] == buckets
    # one host wait per bucket, on the optimizer's driver; overlapped updates keep the shadow model's wait for its
    # copies before the step (step() then writes the DHA layers' host copies from the homes' own masters)
    assert work["host waits"] == {"hetero-host-adam": buckets, **({"MainThread": 1} if overlap else {})}
    # none into resident weights; overlapped updates of DHA layers copy their masters into the host copies in step()
    # (as before: such homes keep a master of their own until step(), and a DHA layer's weights are its host copy)
    dha = sum(1 for _ in model.parameters()) - len(resident)
    assert work.get("host copies of weights in step()", 0) == (dha if overlap else 0)
    assert work["prefetch host to device"] == len(resident)  # one async upload per resident parameter
    assert work["record_prefetch uploaded"] == len(resident)
    assert work["d2h device to host"] == len(resident)  # their gradients, downloaded by the driver
    # one event per bucket holding resident weights (3 of 7), waited on by the compute stream, never the host
    assert work["compute_waits uploaded"] == 3 and "synchronize uploaded" not in work
    assert work["whole-device waits"] == 0


@pytest.mark.parametrize("rollback", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_training_is_bit_equal_to_fused_adamw(stand_ins, small_buckets, overlap, rollback):
    """With `rollback`, a checkpoint loaded mid-training (the optimizer's loads wait for the last uploads first)."""
    ref, reference = fused_reference(rollback)
    model = stand_ins.to(gpt(), 0)
    with Runtime(bench_plan(model, overlap), script=__file__):
        out = script(model, rollback=rollback)
    assert out == ref and bit_equal(model, reference)
