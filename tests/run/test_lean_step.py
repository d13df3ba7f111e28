"""The runtime's host-side work per training step, counted on the stand-in device and pinned, so that a change that
adds work per step fails here (issue 30: on a GPU the runtime's host-side work, not the GPU, set the step time).

One small GPT under a GPU plan with every per-step mechanism: DHA, GFGB and DFGB layers in turn, gradients written
to host memory, Adam on the host with updates overlapping backward, and saved activations tiered from GPU memory to
pinned host memory. The counts are of steady steps (after two warm-up steps), each step's evictions all written
before its backward (so that every planned prefetch really fetches: the counts do not depend on thread timing).
docs/benchmarks.md has their totals; `python -m tests.run.test_lean_step` prints them."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from hetero.harness.saved_tensors import Chain
from hetero.run import shadow, tiering
from hetero.run.devices.evictions import Record, Worker
from hetero.run.grad_offload import HostGrads
from hetero.run.offloaded_adam import Offloaded
from hetero.run.runtime import Runtime
from hetero.run.shadow import ShadowModel
from hetero.run.states import Driver
from hetero.run.tiering import ActivationTiering
from tests.run.test_shadow import batch, gpt, layer_plan
from tests.run.test_tiering import tiering_plan
from tests.standin import StandInDevice
from tests.waits import until

WARM, MEASURED = 2, 2
CONFIG = {"vocab": 64, "block_size": 16, "n_layer": 2, "n_embd": 32, "n_head": 2}

# What each counted thing is, by kind (issue 30's list).
KINDS = {
    "synchronizations": ("synchronize", "driver waits"),  # of which "whole-device waits"
    "event waits": ("compute_waits", "copy_waits", "d2h_waits", "prefetch_waits"),
    "event records": ("record_compute", "record_copy", "record_d2h", "record_prefetch"),
    "copies": ("copy host to device", "d2h device to host", "prefetch host to device", "compute write"),
    "device allocations": ("allocations",),
    "hook calls": ("saved-tensor pack", "saved-tensor unpack", "module hooks", "backward pre-hooks", "tensor hooks"),
    "queue hand-offs": ("tiering worker jobs", "optimizer driver jobs"),
    "p.data rebinds": ("p.data rebinds",),
    "per-tensor records": ("tiering records", "parameter views"),
}


class Tally:
    """Counts of hetero's host-side work, from wrappers installed before the runtime binds."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.on = False

    def add(self, what: str, n: int = 1) -> None:
        if self.on:
            self.counts[what] += n

    def wrap(self, what: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            self.add(what)
            return fn(*args, **kwargs)
        return counted


@contextlib.contextmanager
def counting(monkeypatch, device: StandInDevice):
    tally = Tally()
    for cls, name, what in [(Chain, "_pack", "saved-tensor pack"), (HostGrads, "_arrive", "tensor hooks"),
                            (HostGrads, "_landed", "tensor hooks"), (Offloaded, "_grad_final", "tensor hooks"),
                            (Worker, "put", "tiering worker jobs"), (Driver, "submit", "optimizer driver jobs"),
                            (Record, "__init__", "tiering records")]:
        monkeypatch.setattr(cls, name, tally.wrap(what, getattr(cls, name)))
    unpack = Chain.__dict__["_unpack"].__func__
    monkeypatch.setattr(Chain, "_unpack", staticmethod(tally.wrap("saved-tensor unpack", unpack)))
    views = ShadowModel.pack
    monkeypatch.setattr(ShadowModel, "pack", lambda self, t: _seen(tally, "parameter views", views(self, t)))
    drain = Driver.drain
    monkeypatch.setattr(Driver, "drain", lambda self: (tally.add("driver waits", len(self.pending)), drain(self))[1])
    for module in (shadow, tiering):
        hooks = module.hooks
        monkeypatch.setattr(module, "hooks", _CountedHooks(hooks, tally))
        before = module.before_backward
        monkeypatch.setattr(module, "before_backward",
                            lambda output, hook, before=before: before(output, tally.wrap("backward pre-hooks", hook)))
    data = nn.Parameter.__dict__["data"]  # the stand-in's strict property
    nn.Parameter.data = property(data.fget, lambda p, new: (tally.add("p.data rebinds"), data.fset(p, new)))
    try:
        yield tally
    finally:
        nn.Parameter.data = data


def _seen(tally: Tally, what: str, packed):
    if packed is not None:
        tally.add(what)
    return packed


class _CountedHooks:
    """hetero.harness.hooks with every module hook registered through it counted when called."""

    def __init__(self, hooks, tally: Tally):
        self._hooks, self._tally = hooks, tally

    def forward(self, module, hook, **kwargs):
        return self._hooks.forward(module, self._tally.wrap("module hooks", hook), **kwargs)

    def forward_pre(self, module, hook, **kwargs):
        return self._hooks.forward_pre(module, self._tally.wrap("module hooks", hook), **kwargs)

    def __getattr__(self, name):
        return getattr(self._hooks, name)


def per_step_work(stand_in: StandInDevice, monkeypatch, tmp_path) -> dict[str, float]:
    """Each counted thing per steady step (see the module's docstring)."""
    torch.manual_seed(0)
    model = gpt(**CONFIG)
    plan = layer_plan(model, "mixed", "host", overlap=True)
    plan.activations = tiering_plan(model, str(tmp_path / "nvme"), 1 << 30, min_tensor=1024).activations
    plan.activations.fast, plan.activations.slow, plan.activations.slow_path = "gpu", "dram", None
    plan.omitted.pop("activations")
    with counting(monkeypatch, stand_in) as tally:
        runtime = Runtime(plan, script=__file__)
        with runtime:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            for step in range(WARM + MEASURED):
                if step == WARM:
                    stand_in.log.clear()
                    stand_in.ops.clear()
                    allocated = len(stand_in.allocations)
                    tally.on = True
                x, y = batch(step, 0, CONFIG["vocab"], CONFIG["block_size"])
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                tiered = next(m for m in runtime.mechanisms if isinstance(m, ActivationTiering))
                until(tiered.mover.writer.idle)
                loss.backward()
                opt.step()
                opt.zero_grad()
            tally.on = False
            tally.counts["allocations"] = len(stand_in.allocations) - allocated
            tally.counts.update(op for op, _ in stand_in.log)
            tally.counts["whole-device waits"] = stand_in.log.count(("synchronize", "step"))
            tally.counts.update(f"{stream} {what}" for stream, what in stand_in.ops)
    return {what: n // MEASURED for what, n in sorted(tally.counts.items())}


def by_kind(work: dict[str, float]) -> dict[str, float]:
    return {kind: sum(work.get(what, 0) for what in whats) for kind, whats in KINDS.items()}


# Per steady step (torch 2.13's saved tensors for this model; every count but the saved-tensor hooks' is fixed by the
# model's parameters, the plan and hetero). Before the lean-step changes (issue 30 item 3) these were, by kind:
# synchronizations 106, event waits 88, event records 143, copies 78, device allocations 24, hook calls 268, queue
# hand-offs 90, p.data rebinds 38, per-tensor records 48. With a bucket of updates per module (before issue 55 item 5):
# synchronizations 31, event records 119, queue hand-offs 53.
PINNED = {
    "allocations": 14,  # one per prefetch request (a layer's fetches share one buffer)
    "backward pre-hooks": 20,
    "compute write": 20,
    "compute_waits": 34,
    "copy host to device": 10,
    "copy_waits": 6,
    "d2h device to host": 24,
    "d2h_waits": 24,
    "driver waits": 1,  # one job per bucket of updates: this model's modules all fit in one
    "module hooks": 46,
    "optimizer driver jobs": 1,
    "p.data rebinds": 38,
    "parameter views": 10,
    "prefetch host to device": 24,
    "prefetch_waits": 48,  # an upload waits for its landing buffer's allocation and for the download it reads
    "record_compute": 45,
    "record_copy": 12,
    "record_d2h": 24,
    "record_prefetch": 24,
    "saved-tensor pack": 59,
    "saved-tensor unpack": 59,
    "synchronize": 2,  # the bucket's gradients (1), the copies before the step (1); none for an eviction's download
    "tensor hooks": 84,
    "tiering records": 24,  # storages of at least min_tensor only
    "tiering worker jobs": 38,  # evictions (24) and prefetch requests (14); a fetched copy in memory goes inline
    "whole-device waits": 0,  # before: 1, at the step boundary
}


def test_per_step_work_is_pinned(stand_in, monkeypatch, tmp_path):
    """More work per step than pinned is a regression; less is progress: lower the numbers here and the totals in
    docs/benchmarks.md."""
    work = per_step_work(stand_in, monkeypatch, tmp_path)
    assert work == PINNED, {k: (work.get(k), PINNED.get(k)) for k in work.keys() | PINNED.keys()
                            if work.get(k) != PINNED.get(k)}


if __name__ == "__main__":  # the counts docs/benchmarks.md sums up
    import tempfile
    from pathlib import Path

    import pytest

    from hetero.kernels import dha
    from tests.standin import StandInDevices, strict_parameters

    devices = StandInDevices()
    with pytest.MonkeyPatch.context() as mp, strict_parameters(devices), tempfile.TemporaryDirectory() as tmp:
        mp.setattr(dha, "devices", devices)
        measured = per_step_work(devices.all[0], mp, Path(tmp))
    for kind, whats in KINDS.items():
        print(f"| {kind} | {sum(measured.get(w, 0) for w in whats):g} | "
              + ", ".join(f"{w} {measured.get(w, 0):g}" for w in whats) + " |")
