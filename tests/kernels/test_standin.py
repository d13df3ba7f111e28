"""The stand-in's CUDA rules beyond copy ordering: downloads on their own stream after the compute stream's event,
two devices, and parameters that may not change device."""

import pytest
import torch
from torch import nn

from tests.standin import COMPUTE, D2H, StandInDevice, StandInDevices, strict_parameters


def test_a_download_waits_for_a_compute_event_and_poisons_until_synchronized():
    dev = StandInDevice()
    src, dst = torch.arange(4.0), torch.zeros(4)
    with pytest.raises(RuntimeError, match="compute stream"):
        dev.download(dst, src, dev.event("never recorded"))
    ready = dev.event("grad")
    dev.record_compute(ready)
    done = dev.download(dst, src, ready)
    assert dst.isnan().all() and done.stream == D2H
    dev.synchronize(done)
    assert torch.equal(dst, src)
    assert dev.ops == [(D2H, "device to host")] and ("d2h_waits", "grad") in dev.log
    dev.write(dst, src)
    assert dev.ops[-1] == (COMPUTE, "write")


def test_host_views_and_host_memory():
    dev = StandInDevice()
    host = dev.pinned(64)
    alias = dev.alias(host)
    part = alias[16:32].view(torch.float32)
    back = dev.host_view(part)
    assert dev.is_host(back) and not dev.is_host(part) and back.data_ptr() == part.data_ptr()
    assert back.dtype == torch.float32 and back.shape == (4,)
    assert dev.host_view(torch.zeros(4)) is None


def test_two_devices_and_the_model_on_one():
    devices = StandInDevices()
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    devices.set_device(1)
    assert devices.for_model(a) is devices.all[1]  # not moved: the current device, which holds it from now on
    devices.set_device(0)
    assert devices.of(a.weight) is devices.all[1] and devices.of(b.weight) is None
    devices.to(b, 0)
    assert devices.for_model(b) is devices.all[0] and devices.all[0].name == "cuda:0"


def test_strict_parameters_refuse_a_move_between_host_and_device():
    devices = StandInDevices()
    dev = devices.all[0]
    p = nn.Parameter(torch.zeros(4))
    device_view = dev.alias(dev.pinned(16)).view(torch.float32)
    with strict_parameters(devices):
        p.data = device_view  # device to device: allowed
        with pytest.raises(RuntimeError, match="gradient accumulator"):
            p.data = dev.host_view(device_view)
    p.data = dev.host_view(device_view)  # restored afterwards
    assert "data" not in nn.Parameter.__dict__
