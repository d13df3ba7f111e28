"""The slow tiers behind activation tiering, the workers that drive them, and the ledger that counts their bytes."""

from __future__ import annotations

import os
import tempfile
import threading
import time
import weakref
from collections import Counter

import pytest
import torch

from hetero.errors import HeteroError
from hetero.kernels.dha import pinned_host
from hetero.run.devices.evictions import EVICTED, Mover, Record, Worker
from hetero.run.devices.host_pool import HostPool, PinnedTier, size_class
from hetero.run.devices.residency import Ledger
from hetero.run.devices.slow_tier import NvmeTier, open_tier
from hetero.run.devices.workdir import LOCK, host
from hetero.schema.plan import ActivationPlan
from tests.standin import StandInDevice
from tests.waits import until


def plan(**kw) -> ActivationPlan:
    return ActivationPlan(**{"fast": "dram", "slow": "nvme0", "stay_time_s": 1e-3, "min_tensor_bytes": 1,
                             "schedule": [], **kw})


def test_the_plans_directory_holds_the_files_of_this_process_only(tmp_path):
    tier, note = open_tier(plan(slow_path=str(tmp_path)))
    try:
        assert note is None and os.path.dirname(tier.directory) == str(tmp_path)
        assert os.path.basename(tier.directory).startswith(f"hetero-activations-{os.getpid()}-{host()}-")
        data = torch.arange(100, dtype=torch.uint8)
        rest = tier.split(data, 60)
        tier.evict("k", data, 60, tier.ready())
        (name,) = [n for n in os.listdir(tier.directory) if n != LOCK]  # beside the lock the run holds
        assert os.stat(os.path.join(tier.directory, name)).st_mode & 0o777 == 0o600
        out, marker = tier.fetch("k", 100, rest)
        assert torch.equal(out, torch.arange(100, dtype=torch.uint8)) and tier.wait(marker, out)
    finally:
        tier.close()
    assert os.listdir(tmp_path) == []


def test_without_a_directory_the_temp_dir_is_used_and_said():
    tier, note = open_tier(plan())
    try:
        assert tier.directory.startswith(tempfile.gettempdir()) and isinstance(tier, NvmeTier)
        assert "nvme0" in note and tempfile.gettempdir() in note  # the tier, and where its files went instead
    finally:
        tier.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without CUDA")
def test_a_gpu_plan_on_a_machine_without_cuda_is_stale():
    with pytest.raises(HeteroError) as e:
        open_tier(plan(fast="gpu", slow="dram"))
    assert e.value.exit_code == 4 and "no CUDA device" in e.value.message


def test_a_worker_serves_in_order_and_drops_what_is_queued_when_closed():
    served, gate, serving = [], threading.Event(), threading.Event()

    def serve(job):
        serving.set()
        gate.wait()
        served.append(job)

    worker = Worker("test", serve, lambda e: None)
    for job in range(5):
        worker.put(job)
    assert not worker.idle()
    gate.set()
    while not worker.idle():
        time.sleep(0.001)
    assert served == [0, 1, 2, 3, 4]
    gate.clear()
    serving.clear()
    worker.put(5)
    assert serving.wait(10)  # 5 is being served before close: it finishes; 6, still queued, is dropped
    worker.put(6)
    threading.Timer(0.05, gate.set).start()
    worker.close()
    assert served == [0, 1, 2, 3, 4, 5]


def test_a_failing_job_is_reported_and_the_worker_goes_on():
    errors, served = [], []
    worker = Worker("test", lambda job: served.append(1 / job), errors.append)
    for job in (0, 2):
        worker.put(job)
    while not worker.idle():
        time.sleep(0.001)
    worker.close()
    assert len(errors) == 1 and isinstance(errors[0], ZeroDivisionError) and served == [0.5]


def test_the_ledger_integrates_bytes_over_time():
    ledger = Ledger("dram", "nvme0")
    ledger.change(fast=100, saved=100)
    time.sleep(0.05)
    ledger.change(fast=-60, slow=60)
    time.sleep(0.05)
    ledger.change(fast=-40, slow=-60, saved=-100)
    r = ledger.report()
    assert r.peak_fast == r.peak_saved == 100 and r.peak_slow == 60
    assert r.avg_saved == pytest.approx(100, rel=0.05) and r.avg_fast == pytest.approx(70, rel=0.2)
    assert [tier for _, tier, _ in ledger.events] == ["dram", "saved", "dram", "nvme0", "dram", "nvme0", "saved"]


def test_buffers_round_up_to_64kib():
    assert [size_class(n) for n in (1, 64 << 10, (64 << 10) + 1, 5 << 20)] == [64 << 10, 64 << 10, 128 << 10, 5 << 20]


def test_a_buffer_is_reused_only_once_nothing_views_it():
    pool = HostPool()
    a = pool.take(100_000)
    where = a.data_ptr()
    assert a.numel() == 100_000 and a.untyped_storage().nbytes() == 128 << 10
    view = torch.empty(0, dtype=torch.float32).set_(a.untyped_storage(), 4, (10,), (1,))  # what autograd got
    del a
    assert pool.idle_bytes == 0  # the view is alive: handing the memory out again would change its values
    del view
    assert pool.idle_bytes == 128 << 10  # back by itself, with no private torch use count
    b = pool.take(120_000)
    assert b.data_ptr() == where and pool.allocated_bytes == 128 << 10 and pool.idle_bytes == 0


def test_pinned_buffers_are_allocated_at_their_class_size():
    """Not by torch's pinned allocator, which would hold 256 KiB for this 192 KiB class (a power of two)."""
    device = StandInDevice()
    pool = HostPool(pinned=True, allocate_pinned=device.pinned)
    a = pool.take(150_000)
    assert a.numel() == 150_000 and device.pinned_sizes == [3 * (64 << 10)] == [pool.allocated_bytes]
    assert device.is_host(a)


@pytest.mark.gpu
def test_pinned_pool_bypasses_torchs_rounding_allocator():
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    pool = HostPool(pinned=True, allocate_pinned=pinned_host)
    a = pool.take(150_000)
    assert a.is_pinned() and pool.allocated_bytes == a.untyped_storage().nbytes() == 3 * (64 << 10)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before


@pytest.mark.gpu
def test_pinned_pool_reuses_a_buffer_once_its_copy_is_done():
    pool = HostPool(pinned=True, allocate_pinned=pinned_host, synchronize=torch.cuda.Event.synchronize)
    a = pool.take(1000)
    assert a.is_pinned() and a.numel() == 1000
    event = torch.cuda.Event()
    event.record()
    pool.give(a, event)
    b = pool.take(2000)
    assert b.data_ptr() == a.data_ptr() and pool.allocated_bytes == 64 << 10


def round_trip(tier: PinnedTier, data: torch.Tensor, evict_bytes: int) -> torch.Tensor:
    """What tiering does with one storage: split and queue on the model's thread, write, land, fetch, wait."""
    rest = tier.split(data, evict_bytes)
    tier.evict("k", data, evict_bytes, tier.ready())
    landing = tier.landings([data.numel()])[0]
    out, arrived = tier.fetch("k", data.numel(), rest, landing)
    del rest, landing
    tier.wait(arrived, out)
    tier.delete("k")
    return out


@pytest.mark.parametrize("below", [False, True], ids=["pinned", "pinned+nvme"])
def test_pinned_tier_round_trip_on_the_stand_in(below, tmp_path):
    """Partial eviction and back through the stand-in's strict streams: exact bytes; every device buffer made on
    the compute stream by this (the model's) thread, side streams only copying."""
    from hetero.run.devices.nvme import NvmeStore
    from tests.standin import COMPUTE, D2H, PREFETCH

    device = StandInDevice()
    tier = PinnedTier("dram", device, NvmeStore(tmp_path / "nvme") if below else None)
    try:
        data = device.buffer(1 << 16)
        data.copy_(torch.randint(0, 255, (1 << 16,), dtype=torch.uint8))
        expect = data.clone()
        out = round_trip(tier, data, 40_000)
        assert torch.equal(out, expect)
        assert {a.stream for a in device.allocations} == {COMPUTE}
        assert {a.thread for a in device.allocations} == {threading.current_thread().name}
        assert {s for a in device.allocations for s in a.used_by} <= {COMPUTE, D2H, PREFETCH}
        assert not device.violations
    finally:
        tier.close()
    assert not (tmp_path / "nvme").exists()


def test_a_fetched_buffer_whose_record_goes_unwaited_waits_for_its_upload(tmp_path):
    """A graph dropped after its prefetch was issued: the buffer may go only once the upload into it is done,
    or the compute stream could get its memory while the upload still writes there."""
    device = StandInDevice()
    tier = PinnedTier("dram", device)
    try:
        data = torch.ones(1 << 12, dtype=torch.uint8)
        tier.evict("k", data, data.numel(), tier.ready())
        out, arrived = tier.fetch("k", data.numel(), None, tier.landings([data.numel()])[0])
        tier.release(out, arrived)
        del out
        assert not device.violations
        out, arrived = tier.fetch("k", data.numel(), None, tier.landings([data.numel()])[0])
        del out  # freed with its upload still queued: what the release above prevents
        assert device.violations
    finally:
        tier.close()


def evicted_to_pinned(device: StandInDevice, count: int) -> tuple[Mover, list[Record], list[torch.Tensor]]:
    """`count` device buffers of 4 KiB evicted whole to pinned memory, the writer done with them, and their bytes:
    the records are the only owners of the buffers when they are queued."""
    m = Mover(PinnedTier("dram", device), Ledger("gpu", "dram"))
    expect = [torch.randint(0, 255, (4096,), dtype=torch.uint8) for _ in range(count)]
    records = []
    for want in expect:
        data = device.buffer(want.numel())
        data.copy_(want)
        records.append(Record(m, data.untyped_storage(), movable=True))
    m.evict([(r, r.nbytes) for r in records], "layer")
    until(m.writer.idle)
    return m, records, expect


def test_pinned_evictions_wait_for_no_download_on_the_host():
    """Storages evicted to pinned memory and fetched back: no thread waits on the host for a download (the tier keeps
    each storage until a query finds its download done), no storage is freed while its download still reads it, and
    each is freed once its download is seen done."""
    device, count = StandInDevice(), 8
    m, records, expect = evicted_to_pinned(device, count)
    try:
        assert all(r.state == EVICTED and r.data is None for r in records) and m.ledger.evictions == count
        assert m.tier.held_bytes == count * 4096  # the stand-in runs no download until something waits for it
        m.prefetch([weakref.ref(r) for r in reversed(records)])
        until(m.reader.idle)
        for r, want in zip(records, expect):
            assert torch.equal(m.data(r), want)  # the uploads waited for the downloads on the device
        m.tier.reclaim()
        assert m.tier.held_bytes == 0 and all(r.alias.expired() for r in records)
        assert not device.violations
    finally:
        m.close()
    assert device.synchronized == Counter()


def test_close_waits_once_for_the_downloads_still_running():
    device, count = StandInDevice(), 8
    m, records, _ = evicted_to_pinned(device, count)
    m.close()
    assert device.synchronized == Counter({threading.current_thread().name: 1})
    assert m.tier.held_bytes == 0 and all(r.alias.expired() for r in records) and not device.violations


@pytest.mark.gpu
@pytest.mark.parametrize("below", [False, True], ids=["pinned", "pinned+nvme"])
def test_cuda_pinned_tier_round_trip(below, tmp_path):
    """On the GPU: exact bytes, and the fetched buffer's memory goes back to the compute stream's pool (a buffer
    allocated on a side stream would leave it in that stream's pool, and the compute stream would reserve more)."""
    from hetero.kernels.dha import CudaDevice
    from hetero.run.devices.nvme import NvmeStore

    store = NvmeStore(tmp_path / "nvme") if below else None
    device = CudaDevice()
    tier = PinnedTier("dram", device, store)
    try:
        data = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")
        expect = data.clone()
        out = round_trip(tier, data, 600_000)
        torch.cuda.synchronize()
        assert torch.equal(out, expect)
        del out
        reserved = torch.cuda.memory_reserved()
        again = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # on the compute stream
        assert torch.cuda.memory_reserved() == reserved and again.numel()  # the fetched buffer's block, reused
    finally:
        tier.close()
    assert not (tmp_path / "nvme").exists()
