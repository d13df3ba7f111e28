"""DHA views of pinned host memory (CUDA, `gpu` marker) and the CPU stand-in device the shadow-model tests drive."""

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hetero.kernels.dha import carve, map_host, offsets, pinned_host, same_memory
from tests.standin import StandInDevice

MiB = 2**20


# -- the stand-in: the same contract on the CPU ---------------------------------------------------------------------


def test_stand_in_alias_shares_bytes_through_its_own_storage():
    dev = StandInDevice()
    host = dev.pinned(64)
    alias = dev.alias(host)
    assert same_memory(alias, host)
    assert StorageWeakRef(alias.untyped_storage()) != StorageWeakRef(host.untyped_storage())  # two storages
    carve(host, 0, torch.empty(4)).copy_(torch.arange(4.0))
    assert torch.equal(carve(alias, 0, torch.empty(4)), torch.arange(4.0))
    carve(alias, 16, torch.empty(2, dtype=torch.bfloat16)).fill_(3)
    assert torch.equal(carve(host, 16, torch.empty(2, dtype=torch.bfloat16)), torch.full((2,), 3.0).bfloat16())


def test_stand_in_alias_keeps_the_host_memory_alive():
    dev = StandInDevice()
    host = dev.pinned(16)
    host.view(torch.float32).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    alias = dev.alias(host).view(torch.float32)
    del host
    gc.collect()
    junk = [torch.full((4,), -7.0) for _ in range(100)]  # would reuse freed memory
    assert torch.equal(alias, torch.tensor([1.0, 2.0, 3.0, 4.0])) and junk


def test_stand_in_copies_run_only_when_waited_for_and_poison_until_then():
    dev = StandInDevice()
    src, dst = torch.arange(4.0), torch.zeros(4)
    first, second = dev.event("first"), dev.event("second")
    dev.copy(dst.view(torch.uint8), src.view(torch.uint8))
    dev.record_copy(first)
    other = torch.zeros(4)
    dev.copy(other.view(torch.uint8), (src + 10).view(torch.uint8))
    dev.record_copy(second)
    assert dst.isnan().all() and other.isnan().all()  # issued, not run: reading now reads garbage
    dev.compute_waits(first)
    assert torch.equal(dst, src) and other.isnan().all()  # in order, and no further than waited for
    dev.synchronize(second)
    assert torch.equal(other, src + 10)
    assert dev.log == [("record_copy", "first"), ("record_copy", "second"), ("compute_waits", "first"),
                       ("synchronize", "second")]


def test_offsets_align_every_tensor():
    where, total = offsets([4, 1000, 0, 256])
    assert where == [0, 256, 1280, 1280] and total == 1536


# -- CUDA ----------------------------------------------------------------------------------------------------------


def test_map_host_refuses_pageable_memory():
    with pytest.raises(ValueError, match="pinned"):
        map_host(torch.empty(16, dtype=torch.uint8), torch.device("cuda", 0))


@pytest.mark.gpu
def test_view_is_zero_copy_both_ways():
    device = torch.device("cuda", torch.cuda.current_device())
    host = pinned_host(MiB)
    assert host.is_pinned()
    allocated = torch.cuda.memory_allocated(device)
    view = map_host(host, device)
    assert torch.cuda.memory_allocated(device) == allocated  # no GPU memory behind the view
    assert view.is_cuda and view.device == device
    h, v = host.view(torch.float32), view.view(torch.float32)
    h.copy_(torch.randn(h.numel()))
    original = h.clone()
    assert torch.equal(v.cpu(), original)  # the GPU reads what the host wrote
    torch.mul(v, 2, out=v)  # a kernel writes through the view
    torch.cuda.synchronize()
    assert torch.equal(h, original * 2)  # the host sees it without a copy back
    assert view.untyped_storage().nbytes() == MiB
    gpu = torch.empty_like(v)
    gpu.copy_(v)
    assert torch.equal(gpu.cpu(), h)


@pytest.mark.gpu
def test_view_keeps_pinned_memory_alive_and_registered():
    device = torch.device("cuda", torch.cuda.current_device())
    host = pinned_host(4 * MiB)
    host.view(torch.float32).copy_(torch.arange(MiB, dtype=torch.float32))
    view = map_host(host[MiB:], device).view(torch.float32)  # an interior slice maps too
    del host
    gc.collect()
    junk = [pinned_host(4 * MiB) for _ in range(4)]
    assert torch.equal(view[:4].cpu(), torch.arange(MiB // 4, MiB // 4 + 4, dtype=torch.float32)) and junk
    assert float(view.double().sum()) == float(torch.arange(MiB // 4, MiB, dtype=torch.float64).sum())


@pytest.mark.gpu
def test_host_view_finds_the_host_bytes_behind_a_device_view():
    """What the optimizer's copy_back and host gradients rely on: a device tensor inside a DHA view leads to the host
    tensor over the same bytes (found by address, no private torch attribute); anything else to None."""
    from hetero.kernels.dha import CudaDevice

    dev = CudaDevice()
    host = dev.pinned(4096)
    alias = dev.alias(host)
    part = alias[256:512].view(torch.float32)
    back = dev.host_view(part)
    assert not back.is_cuda and back.data_ptr() == host.data_ptr() + 256 and back.shape == (64,)
    assert dev.host_view(alias[4000:].view(torch.float32)) is not None
    assert dev.host_view(torch.zeros(4, device=dev.device)) is None and dev.host_view(torch.zeros(4)) is None
