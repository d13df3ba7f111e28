"""Activation tiering: training under the plan's schedule equals plain PyTorch from the same seed, evicts exactly the
planned bytes, keeps parameters and small tensors in place, and leaves no file behind."""

from __future__ import annotations

import importlib.util
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from hetero.harness.capture import fingerprint
from hetero.harness.layers import select_layers
from hetero.harness.script import StopScript
from hetero.plan.model import chunks
from hetero.run.devices.evictions import Mover
from hetero.run.runtime import Runtime
from hetero.run.tiering import ActivationTiering
from hetero.schema.plan import ActivationPlan, Budget, Eviction, Plan, Predicted, Source
from tests.waits import until

STEPS = 10
KiB, GiB = 1 << 10, 1 << 30


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt() -> nn.Module:
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
    spec = importlib.util.spec_from_file_location("train_gpt_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.GPT(vocab=64, block_size=16, n_layer=2, n_embd=32, n_head=2)


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


class Views(nn.Module):
    """One layer saving four storages of known size inside its own forward: `a` (8 KiB) three times, twice as
    strided views; `cat`, `c` and `t` (16 KiB each) once or twice; and a parameter that must stay put."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(width))
        self.head = nn.Linear(2 * width, 4)

    def forward(self, x):
        a = (x + self.shift).exp()
        b = a.sin()[:, ::2] + a[:, ::2] * a[:, 1::2]
        c = torch.cat([b, b, b, b], 1).cos()
        t = c.tanh()
        return self.head(c * t)


def views() -> nn.Module:
    torch.manual_seed(0)
    return Views()


MODELS = {"gpt": tiny_gpt, "cnn": small_cnn}


def batch(name: str, step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    if name == "gpt":
        x = torch.randint(64, (4, 16), generator=g)
        return x, (x + 1) % 64
    if name == "cnn":
        return torch.randn(4, 3, 16, 16, generator=g), torch.randint(10, (4,), generator=g)
    return torch.randn(8, 256, generator=g) * 0.1, torch.randint(4, (8,), generator=g)


def train(model: nn.Module, name: str, steps: int = STEPS, accum: int = 1, between=None) -> list[float]:
    """The script under test: a plain loop as users write it. `between(step)` runs between forward and backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        for micro in range(accum):
            x, y = batch(name, step, micro)
            out = model(x)
            loss = F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten()) / accum
            if between is not None:
                between(step)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def layer_names(model: nn.Module) -> list[str]:
    return [spec.name for spec in select_layers(model, "module")]


def tiering_plan(model: nn.Module, nvme: str, evict: int | dict[str, int], trigger: str = "next",
                 min_tensor: int = 1024) -> Plan:
    """`evict` bytes for every layer (or by layer); the prefetch keyed to the next layer's backward start (`next`),
    to the layer's own (`self`: always late), or to time alone (`time`)."""
    names = layer_names(model)
    schedule = []
    for i, name in enumerate(names):
        nbytes = evict.get(name, 0) if isinstance(evict, dict) else evict
        after = {"next": names[min(i + 1, len(names) - 1)], "self": name, "time": None}[trigger]
        at = 1e9 if trigger == "time" else 0.0  # by time: never due in forward, so due when backward starts
        schedule.append(Eviction(layer=name, evict_bytes=nbytes, prefetch_at_s=at, prefetch_after=after))
    acts = ActivationPlan(fast="dram", slow="nvme0", slow_path=nvme, stay_time_s=1e-3, min_tensor_bytes=min_tensor,
                          schedule=schedule)
    return Plan(source=Source(profile="profile.yaml", profile_sha256="0" * 64, model_fingerprint=fingerprint(model)),
                budget=Budget(gpu_memory_bytes=None, dram_budget_bytes=None, reserve=1.0), layers=[],
                optimizer=None, activations=acts, routing=None, predicted=Predicted(iteration_s=0.0, peak_bytes={}),
                omitted={"layers": "test", "optimizer": "test", "routing": "test"})


def run_both(name: str, make, nvme, evict, trigger="next", min_tensor=1024, accum=1, drain=False):
    """Train plain and under the plan; with `drain`, each backward starts once every eviction is written (so the
    outcome does not depend on how fast the disk is)."""
    ref_model, model = make(), make()
    ref = train(ref_model, name, accum=accum)
    runtime = Runtime(tiering_plan(model, str(nvme), evict, trigger, min_tensor), script=__file__)
    between = (lambda step: until(runtime.find(ActivationTiering).mover.writer.idle)) if drain else None
    with runtime:
        out = train(model, name, accum=accum, between=between)
    assert_close(torch.tensor(out), torch.tensor(ref))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_close(p, q)
    assert not nvme.exists() or os.listdir(nvme) == []
    return runtime.find(ActivationTiering)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", ["full", "partial", "none", "by-time", "late"])
def test_training_equals_plain_pytorch(name, mode, tmp_path):
    evict = {"partial": 3000, "none": 0}.get(mode, GiB)
    trigger = {"by-time": "time", "late": "self"}.get(mode, "next")
    tiering = run_both(name, MODELS[name], tmp_path / "nvme", evict, trigger, drain=mode != "partial")
    r = tiering.ledger.report()
    if mode == "none":
        assert r.evictions == 0 and r.avg_fast == pytest.approx(r.avg_saved)
    elif mode == "partial":
        assert set(r.queued.values()) == {3000 * STEPS}  # every layer chose exactly the planned bytes
    else:
        assert r.evictions > 0 and r.avg_fast < 0.8 * r.avg_saved
    if mode == "late":
        assert r.late > 0


def test_gradient_accumulation(tmp_path):
    tiering = run_both("gpt", tiny_gpt, tmp_path / "nvme", GiB, accum=2, drain=True)
    assert tiering.ledger.report().evictions > 0


def test_evicted_memory_is_released_until_backward(tmp_path):
    model = tiny_gpt()
    with Runtime(tiering_plan(model, str(tmp_path / "nvme"), GiB), script=__file__) as runtime:
        train(model, "gpt", steps=1)
        tiering = runtime.find(ActivationTiering)
        out = model(batch("gpt", 1)[0])
        until(tiering.mover.writer.idle)
        fast, slow, saved = tiering.ledger.now
        assert slow > 0.5 * saved and fast == saved - slow
        evicted = [r for r in (ref() for ref in tiering.last.storages.values()) if r is not None and r.slow]
        assert evicted and all(r.alias.expired() for r in evicted)  # no copy of the bytes is left in memory
        del evicted
        out.sum().backward()
        assert tiering.ledger.now == [0, 0, 0]


def test_whole_storages_then_part_of_one_exactly_as_planned(tmp_path):
    # Views saves 16 KiB three times and 8 KiB once: 25,000 bytes are one 16 KiB and 8,616 bytes of the next, the
    # two transfers the planner times them as.
    tiering = run_both("views", views, tmp_path / "nvme", {"(model)": 25_000}, min_tensor=1024, drain=True)
    r = tiering.ledger.report()
    assert chunks((16 * KiB,) * 3 + (8 * KiB,), 25_000) == [16 * KiB, 25_000 - 16 * KiB]
    assert r.queued == r.evicted == {"(model)": 25_000 * STEPS} and r.evictions == 2 * STEPS


def test_parameters_and_their_views_never_move(tmp_path):
    class ViewOfWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 512) * 0.01)

        def forward(self, x):
            return F.linear(x, self.weight[:, :256])  # saves x and a view of the weight

    def make():
        torch.manual_seed(0)
        return ViewOfWeight()

    tiering = run_both("views", make, tmp_path / "nvme", GiB, min_tensor=1, drain=True)
    assert tiering.ledger.report().evicted == {"(model)": 8 * 256 * 4 * STEPS}  # x only


def test_what_was_evicted_last_comes_back_first(tmp_path, monkeypatch):
    """Prefetches due at once (here: all, when backward starts) are served latest layer first, and within a layer
    the last saved storage first: the order backward needs them in."""
    fetched: list = []
    fetch = Mover._fetch
    monkeypatch.setattr(Mover, "_fetch", lambda self, r, landing: (fetched.append(r), fetch(self, r, landing))[1])
    model = tiny_gpt()
    order = {name: i for i, name in enumerate(layer_names(model))}
    runtime = Runtime(tiering_plan(model, str(tmp_path / "nvme"), GiB, trigger="time"), script=__file__)

    def backward_starts(step):
        until(runtime.find(ActivationTiering).mover.writer.idle)
        fetched.append(None)

    with runtime:
        train(model, "gpt", steps=3, between=backward_starts)
        passes = [[(order[r.group.layer], int(r.key)) for r in part if r is not None]
                  for part in _split(fetched)][1:]
    assert len(passes) == 3 and all(len(p) > 3 for p in passes)
    for p in passes:
        assert p == sorted(p, reverse=True)  # by layer, latest first; within one, last saved first


def _split(items: list) -> list[list]:
    out = [[]]
    for item in items:
        if item is None:
            out.append([])
        else:
            out[-1].append(item)
    return out


class AfterItsLayer(nn.Module):
    """A conv layer that saves only its small input itself; the ReLU and max-pool after it (functional, in the
    model's forward) save its output (32 KiB) and the pool's indices (16 KiB) once it has ended."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.flatten(F.max_pool2d(F.relu(self.conv(x)), 2), 1))


def test_what_a_layer_saves_after_it_ended_leaves_though_it_saved_nothing_movable_itself(tmp_path):
    def make():
        torch.manual_seed(0)
        return AfterItsLayer()

    tiering = run_both("cnn", make, tmp_path / "nvme", {"conv": GiB}, min_tensor=16 * KiB, drain=True)
    # the conv's 3 KiB input stays (under the threshold); the ReLU's output and the pool's int64 indices leave
    assert tiering.ledger.report().evicted == {"conv": (32 + 16) * KiB * STEPS}


class ScaledAtTheRoot(AfterItsLayer):
    """AfterItsLayer with a parameter of the model's own: the model is a layer too, and what its forward saves after
    the conv ended belongs to the conv (the profiler's rule: the last layer to end inside the running one)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return super().forward(x) * self.scale


def test_what_the_model_saves_after_a_layer_ended_inside_it_is_that_layers(tmp_path):
    def make():
        torch.manual_seed(0)
        return ScaledAtTheRoot()

    assert layer_names(make()) == ["(model)", "conv", "fc"]
    tiering = run_both("cnn", make, tmp_path / "nvme", {"conv": GiB}, min_tensor=16 * KiB, drain=True)
    assert tiering.ledger.report().evicted == {"conv": (32 + 16) * KiB * STEPS}


def test_a_prefetch_due_by_time_waits_for_what_its_layer_saves_after_its_end(tmp_path):
    """A step slower than profiled reaches a time-keyed prefetch (here: due at once) at the layer's end already; the
    storages saved after it (the ReLU's and the pool's) are queued as planned before it is requested."""
    def make():
        torch.manual_seed(0)
        return AfterItsLayer()

    model, reference = make(), make()
    expected = train(reference, "cnn")
    plan = tiering_plan(model, str(tmp_path / "nvme"), {"conv": GiB}, trigger="time", min_tensor=16 * KiB)
    for e in plan.activations.schedule:
        e.prefetch_at_s = 0.0
    with Runtime(plan, script=__file__) as runtime:
        losses = train(model, "cnn")
    assert_close(torch.tensor(losses), torch.tensor(expected))
    assert runtime.find(ActivationTiering).ledger.report().queued == {"conv": (32 + 16) * KiB * STEPS}


def test_tensors_under_the_threshold_stay(tmp_path):
    tiering = run_both("cnn", small_cnn, tmp_path / "nvme", GiB, min_tensor=1 << 20)
    assert tiering.ledger.report().evictions == 0


def test_a_layer_the_model_lacks_is_a_stale_plan(tmp_path):
    model = tiny_gpt()
    plan = tiering_plan(model, str(tmp_path), GiB)
    plan.activations.schedule[0].layer = "transformer.h.9"
    with pytest.raises(StopScript) as e, Runtime(plan, script=__file__):
        train(model, "gpt", steps=1)
    assert e.value.error.exit_code == 4 and "transformer.h.9" in e.value.error.message


def test_evaluation_forwards_are_left_alone(tmp_path):
    model = small_cnn()
    with Runtime(tiering_plan(model, str(tmp_path / "nvme"), GiB), script=__file__) as runtime:
        train(model, "cnn", steps=1)
        before = runtime.find(ActivationTiering).ledger.report().evictions
        with torch.no_grad():
            model(batch("cnn", 0)[0])
        assert runtime.find(ActivationTiering).ledger.report().evictions == before


def test_a_graph_dropped_without_backward_leaves_no_file(tmp_path):
    model = tiny_gpt()
    with Runtime(tiering_plan(model, str(tmp_path / "nvme"), GiB), script=__file__) as runtime:
        train(model, "gpt", steps=1)
        tiering = runtime.find(ActivationTiering)
        loss = model(batch("gpt", 1)[0]).sum()
        until(lambda: len(tiering.mover.tier.store) > 0)
        del loss
        # a record still queued for the writer is freed on its thread, after the store may already be empty
        until(lambda: tiering.mover.writer.idle() and len(tiering.mover.tier.store) == 0)
        assert tiering.ledger.now[0] == tiering.ledger.now[2] == 0


def test_an_exception_in_the_script_leaves_no_file(tmp_path):
    model = tiny_gpt()
    nvme = tmp_path / "nvme"
    with pytest.raises(KeyError), Runtime(tiering_plan(model, str(nvme), GiB), script=__file__) as runtime:
        train(model, "gpt", steps=2)
        loss = model(batch("gpt", 2)[0]).sum()  # evicted activations in flight
        until(lambda: len(runtime.find(ActivationTiering).mover.tier.store) > 0)
        raise KeyError(loss.item())
    assert not nvme.exists()



@pytest.mark.parametrize("below", [False, True], ids=["pinned", "pinned+nvme"])
@pytest.mark.parametrize("evict", ["full", "partial"])
def test_gpu_tier_on_the_stand_in(stand_in, below, evict, tmp_path):
    """GPU memory tiered to pinned host memory, through the stand-in's strict streams: training equals plain; every
    device buffer of the steps (fetched activations, partial evictions' kept tails) is allocated on the compute stream
    by the thread running the model, side streams only copy, no buffer is freed while a copy still uses it, and
    without a store below no eviction makes the host wait for its download."""
    from tests.standin import COMPUTE, PREFETCH

    ref_model, model = tiny_gpt(), tiny_gpt()
    ref = train(ref_model, "gpt", steps=4)
    plan = tiering_plan(model, str(tmp_path / "nvme"), GiB if evict == "full" else 3000, min_tensor=1024)
    plan.activations.fast, plan.activations.slow = "gpu", "dram"
    plan.activations.slow_path = str(tmp_path / "nvme") if below else None
    with Runtime(plan, script=__file__) as runtime:
        # each forward's evictions written before its backward calls the rest off: on a loaded machine the writer
        # thread may otherwise not run within a forward of milliseconds, in any of the steps
        written = lambda *_: until(runtime.find(ActivationTiering).mover.writer.idle)  # noqa: E731
        hook = model.lm_head.register_forward_hook(written)
        out = train(model, "gpt", steps=4)
        hook.remove()
        tier = runtime.find(ActivationTiering).mover.tier
        assert below or tier.held_bytes == 0  # every download was done when the last backward returned
    assert_close(torch.tensor(out), torch.tensor(ref))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_close(p, q)
    assert runtime.find(ActivationTiering).ledger.report().evictions > 1
    # no host wait per eviction: the writer issues each download and goes on (with a store below it waits for each,
    # on its thread, to write the file); close may wait once for what is still running
    waits = stand_in.synchronized
    assert (sum(waits.values()) if not below else waits[threading.current_thread().name]) <= 1
    assert stand_in.allocations and {a.stream for a in stand_in.allocations} == {COMPUTE}
    assert {a.thread for a in stand_in.allocations} == {threading.current_thread().name}
    used = {s for a in stand_in.allocations for s in a.used_by}
    assert used == ({PREFETCH} if evict == "full" else {COMPUTE, PREFETCH})  # kept tails: written on compute
    assert not stand_in.violations
    assert not (tmp_path / "nvme").exists()


def test_a_backward_returning_drops_the_evicted_storages_whose_downloads_are_done(stand_in, tmp_path):
    """A step's end, where the optimizer may allocate next: the storages the GPU tier kept for their downloads go
    once a backward returns, with no eviction or fetch since the downloads were done."""
    model = tiny_gpt()
    plan = tiering_plan(model, str(tmp_path), GiB)
    plan.activations.fast, plan.activations.slow, plan.activations.slow_path = "gpu", "dram", None
    with Runtime(plan, script=__file__) as runtime:
        train(model, "gpt", steps=1)
        tiering = runtime.find(ActivationTiering)
        loss = model(batch("gpt", 1)[0]).sum()
        until(tiering.mover.writer.idle)
        held = tiering.mover.tier.held_bytes
        assert held > 0  # the stand-in runs no download until something waits for it
        ready = stand_in.event("test")
        stand_in.record_compute(ready)
        # a download of the test's own, queued after the tier's: waiting for it runs them all
        stand_in.synchronize(stand_in.download(torch.empty(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8),
                                               ready))
        assert tiering.mover.tier.held_bytes == held
        torch.autograd.backward(torch.ones(1, requires_grad=True).sum())  # any backward: the step's end
        assert tiering.mover.tier.held_bytes == 0
        loss.backward()


@pytest.mark.gpu
@pytest.mark.parametrize("below", [False, True], ids=["pinned", "pinned+nvme"])
def test_gpu_training_equals_plain_pytorch(below, tmp_path):
    def make():
        return tiny_gpt().cuda()

    def train_cuda(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            x, y = (t.cuda() for t in batch("gpt", step))
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    ref_model, model = make(), make()
    ref = train_cuda(ref_model)
    plan = tiering_plan(model, str(tmp_path / "nvme"), GiB)
    plan.activations.fast, plan.activations.slow = "gpu", "dram"
    plan.activations.slow_path = str(tmp_path / "nvme") if below else None
    with Runtime(plan, script=__file__) as runtime:
        out = train_cuda(model)
    assert_close(torch.tensor(out), torch.tensor(ref))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_close(p, q)
    assert runtime.find(ActivationTiering).ledger.report().evictions > 0
    assert not (tmp_path / "nvme").exists()
