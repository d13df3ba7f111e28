from __future__ import annotations

import threading
import time
from itertools import pairwise

import pytest
import torch

from hetero.errors import HeteroError
from hetero.kernels.adam import AdamKernel, Hyperparameters, adam_reference
from hetero.run.devices import axdimm
from hetero.run.devices.axdimm import Allocation, ArbiterError, AxdimmDevice, EmulatedAxdimm, Mode
from tests.figures import figures

HP = Hyperparameters(lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True)


@pytest.fixture
def device():
    with EmulatedAxdimm(channel_capacity_bytes=1 << 16, channels=2) as d:
        yield d


def test_it_says_it_is_emulated(device):
    assert device.backend == "emulated" and "emulated" in repr(device)
    assert type(device).__name__.startswith("Emulated")
    assert device.channels == 2 and device.channel_capacity_bytes == 1 << 16
    assert isinstance(device, AxdimmDevice)  # the emulation implements the driver interface
    assert device.mode(0) is Mode.NORMAL


def test_channels_are_pinned_only_when_a_gpu_copies_into_them(monkeypatch):
    pinning = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine, where pinning starts CUDA
    monkeypatch.setattr(axdimm, "pinned_host",
                        lambda nbytes: pinning.append(nbytes) or torch.empty(nbytes, dtype=torch.uint8))
    with EmulatedAxdimm(channel_capacity_bytes=1 << 16, channels=2) as cpu_model:
        assert not cpu_model.pinned and pinning == []
    with EmulatedAxdimm(channel_capacity_bytes=1 << 16, channels=2, pinned=True):
        assert pinning == [1 << 16, 1 << 16]


def test_malloc_free_and_capacity(device):
    parts = [device.malloc(1 << 14, channel=1) for _ in range(4)]
    spans = sorted((a.offset, a.offset + a.nbytes) for a in parts)
    assert all(end <= nxt for (_, end), (nxt, _) in pairwise(spans))  # no overlap
    with pytest.raises(HeteroError) as e:
        device.malloc(1, channel=1)
    # the channel, the bytes asked for, those free of its capacity, the largest free block
    assert figures(e.value.message) == ["1", "1", "0", "65536", "0"] and e.value.hint is not None
    device.malloc(1 << 16, channel=0)  # the other channel is independent
    for a in parts:
        device.free(a)
    whole = device.malloc(1 << 16, channel=1)  # freed blocks coalesce back into one
    with pytest.raises(ValueError, match="region"):
        device.free(whole.region(0, 64))
    device.free(whole)
    with pytest.raises(ValueError, match="freed twice"):
        device.free(whole)
    with pytest.raises(ValueError, match="no AXDIMM channel 2"):
        device.malloc(8, channel=2)


def test_memcpy_round_trip_both_directions_and_between_channels(device):
    data = torch.randn(1000)
    a = device.malloc(data.nbytes, channel=0)
    b = device.malloc(data.nbytes, channel=1)
    device.memcpy(a, data, data.nbytes)
    device.memcpy(b, a, data.nbytes)
    out = torch.zeros(1000)
    device.memcpy(out, b, data.nbytes)
    assert torch.equal(out, data)
    part = torch.zeros(10)
    device.memcpy(part, a.region(40, 40), 40)  # elements 10..19, through a region
    assert torch.equal(part, data[10:20])
    assert torch.equal(device.view(b), data)
    with pytest.raises(ValueError, match="do not fit"):
        device.memcpy(a, torch.zeros(2000), 8000)


def test_the_arbiter_modes_are_exclusive(device):
    a = device.malloc(64, channel=0)
    other = device.malloc(64, channel=1)
    buffers = [device.malloc(64, channel=0) for _ in range(4)]
    with pytest.raises(ArbiterError, match="channel 0 .*normal"):
        device.run_adam_async(*buffers, hyperparameters=HP, step=1, channel=0)
    device.set_arbiter(0, "acceleration")
    for attempt in (lambda: device.memcpy(a, torch.zeros(16), 64), lambda: device.memcpy(torch.zeros(16), a, 64),
                    lambda: device.view(a), lambda: device.free(a)):
        with pytest.raises(ArbiterError, match="channel 0 .*acceleration"):
            attempt()
    device.memcpy(other, torch.ones(16), 64)  # channel 1 stays the host's meanwhile
    with pytest.raises(ValueError, match="'turbo'"):
        device.set_arbiter(0, "turbo")
    device.set_arbiter(0, Mode.NORMAL)
    assert torch.equal(device.view(a), torch.zeros(16))


@pytest.mark.parametrize("serialize", [True, False])
def test_async_adam_on_two_channels_equals_the_reference(serialize):
    sizes = [1000, 777]
    gen = torch.Generator().manual_seed(0)
    starts = [torch.randn(n, generator=gen) for n in sizes]
    expected = [(s.clone(), torch.zeros_like(s), torch.zeros_like(s)) for s in starts]
    with EmulatedAxdimm(channel_capacity_bytes=1 << 16, channels=2, serialize_compute=serialize) as dev:
        bufs = []
        for c, start in enumerate(starts):
            p, m, v, g = (dev.malloc(start.nbytes, channel=c) for _ in range(4))
            dev.memcpy(p, start, start.nbytes)
            for zero in (m, v):
                dev.memcpy(zero, torch.zeros_like(start), start.nbytes)
            bufs.append((p, m, v, g))
        for step in range(1, 6):
            grads = [torch.randn(n, generator=gen) for n in sizes]
            for c, (grad, (_, _, _, g)) in enumerate(zip(grads, bufs)):
                dev.memcpy(g, grad, grad.nbytes)
                dev.set_arbiter(c, "acceleration")
            handles = [dev.run_adam_async(p, m, v, g, hyperparameters=HP, step=step, channel=c)
                       for c, (p, m, v, g) in enumerate(bufs)]
            for c in range(2):
                dev.set_arbiter(c, "normal")  # waits for the channel's kernel
            assert all(h.done() for h in handles)
            for grad, (param, exp_avg, exp_avg_sq) in zip(grads, expected):
                adam_reference(param, grad, exp_avg, exp_avg_sq, hyperparameters=HP, step=step)
        for (p, m, v, _), (param, exp_avg, exp_avg_sq) in zip(bufs, expected):
            torch.testing.assert_close(dev.view(p), param)
            torch.testing.assert_close(dev.view(m), exp_avg)
            torch.testing.assert_close(dev.view(v), exp_avg_sq)


def test_adam_on_regions_of_a_flat_channel_buffer(device):
    flat = {k: device.malloc(4 * 300, channel=1) for k in ("p", "m", "v", "g")}
    for k, a in flat.items():
        device.memcpy(a, torch.full((300,), 0.5 if k in ("p", "g") else 0.0), a.nbytes)
    device.set_arbiter(1, "acceleration")
    middle = [flat[k].region(400, 400) for k in ("p", "m", "v", "g")]  # elements 100..199
    device.run_adam_async(*middle, hyperparameters=HP, step=1, channel=1).wait()
    device.set_arbiter(1, "normal")
    param = device.view(flat["p"])
    expected = torch.full((100,), 0.5)
    adam_reference(expected, torch.full((100,), 0.5), torch.zeros(100), torch.zeros(100), hyperparameters=HP, step=1)
    torch.testing.assert_close(param[100:200], expected)
    assert torch.all(param[:100] == 0.5) and torch.all(param[200:] == 0.5)


def test_wait_done_and_switching_back_waits_for_the_kernel(device, monkeypatch):
    release, original = threading.Event(), AdamKernel.__call__

    def held(self, *args, **kwargs):
        assert release.wait(10)
        original(self, *args, **kwargs)

    monkeypatch.setattr(axdimm.AdamKernel, "__call__", held)
    bufs = [device.malloc(64, channel=0) for _ in range(4)]
    device.set_arbiter(0, "acceleration")
    handle = device.run_adam_async(*bufs, hyperparameters=HP, step=1, channel=0)
    switcher = threading.Thread(target=device.set_arbiter, args=(0, "normal"))
    switcher.start()
    time.sleep(0.05)
    assert not handle.done() and switcher.is_alive() and device.mode(0) is Mode.ACCELERATION
    release.set()
    handle.wait(10)
    switcher.join(10)
    assert handle.done() and device.mode(0) is Mode.NORMAL


def test_kernel_errors_surface_at_wait_and_bad_buffers_at_launch(device):
    bufs = [device.malloc(64, channel=0) for _ in range(4)]
    elsewhere = device.malloc(64, channel=1)
    device.set_arbiter(0, "acceleration")
    with pytest.raises(HeteroError, match="step 0"):
        device.run_adam_async(*bufs, hyperparameters=HP, step=0, channel=0).wait()
    with pytest.raises(ValueError, match="64-byte .*channel 0"):
        device.run_adam_async(*bufs[:3], elsewhere, hyperparameters=HP, step=1, channel=0)
    with pytest.raises(ValueError, match="not allocated"):
        device.run_adam_async(*bufs[:3], Allocation(0, 4096, 64), hyperparameters=HP, step=1, channel=0)
    device.set_arbiter(0, "normal")
    device.close()
    device.close()  # idempotent
    with pytest.raises(ValueError, match="has 0 open"):
        device.malloc(8, channel=0)
