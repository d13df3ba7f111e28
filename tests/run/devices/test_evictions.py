"""Records moving between host memory and files: exact bytes back, evictions called off by an early prefetch, and an
error (never a wrong buffer) when the bytes cannot be read back."""

from __future__ import annotations

import threading

import pytest
import torch

from hetero.errors import FAILURE, HeteroError
from hetero.run.devices.evictions import BACK, EVICTED, RESIDENT, WRITING, Mover, Record, Worker
from hetero.run.devices.residency import Ledger
from hetero.run.devices.slow_tier import NvmeTier


class GatedTier(NvmeTier):
    """The real NVMe tier, whose writes start only when the test opens the gate (a disk that is busy)."""

    def __init__(self, directory):
        super().__init__("nvme0", directory)
        self.gate, self.writing = threading.Event(), threading.Event()

    def evict(self, key, data, evict_bytes, ready):
        self.writing.set()
        self.gate.wait()
        return super().evict(key, data, evict_bytes, ready)


@pytest.fixture
def mover(tmp_path):
    m = Mover(NvmeTier("nvme0", str(tmp_path / "nvme")), Ledger("dram", "nvme0"))
    yield m
    m.close()
    assert not (tmp_path / "nvme").exists()


def evicted(mover: Mover, tensor: torch.Tensor, nbytes: int) -> Record:
    r = Record(mover, tensor.untyped_storage(), movable=True)
    mover.evict([(r, nbytes)], "layer")
    _drain(mover.writer)
    return r


def _drain(worker: Worker) -> None:
    while not worker.idle():
        threading.Event().wait(0.001)


@pytest.mark.parametrize("part", [1.0, 0.3])
def test_evict_then_fetch_gives_back_the_exact_bytes(mover, part):
    x = torch.randn(1000)
    expect = x.clone()
    nbytes = int(x.nbytes * part)
    r = evicted(mover, x, nbytes)
    del x
    assert r.state == EVICTED and r.data is None and r.alias.expired()  # the memory was really given back
    assert mover.ledger.now == [4000 - nbytes, nbytes, 4000]
    data = mover.data(r)
    assert r.state == BACK and mover.ledger.late == 1  # asked before any prefetch: fetched inline, late
    assert torch.equal(data.view(torch.float32), expect)
    _drain(mover.writer)
    assert mover.ledger.now == [4000, 0, 4000] and len(mover.tier.store) == 0


def test_a_prefetch_before_the_write_starts_calls_the_eviction_off(tmp_path):
    tier = GatedTier(str(tmp_path / "nvme"))
    m = Mover(tier, Ledger("dram", "nvme0"))
    try:
        first, second = torch.randn(256), torch.randn(256)
        r1, r2 = (Record(m, t.untyped_storage(), movable=True) for t in (first, second))
        m.evict([(r1, 1024), (r2, 1024)], "layer")
        tier.writing.wait()  # r1's write has started, r2 is queued
        assert r1.state == WRITING and r1.data is not None
        m.recall(r1)
        m.recall(r2)
        tier.gate.set()
        _drain(m.writer)
        assert r1.state == r2.state == RESIDENT and m.ledger.evictions == 0
        assert len(tier.store) == 0  # r1's finished write was deleted: its data never left memory
        assert torch.equal(m.data(r1).view(torch.float32), first) and m.ledger.late == 0
    finally:
        tier.gate.set()
        m.close()


def test_a_lost_file_raises_instead_of_returning_a_buffer(mover):
    r = evicted(mover, torch.randn(1000), 4000)
    mover.tier.delete(r.key)
    with pytest.raises(HeteroError) as e:
        mover.data(r)
    assert e.value.exit_code == FAILURE and mover.tier.name in e.value.message and e.value.hint is not None


def test_a_record_freed_while_evicted_deletes_its_file(mover):
    r = evicted(mover, torch.randn(1000), 4000)
    assert len(mover.tier.store) == 1
    del r
    _drain(mover.writer)
    assert len(mover.tier.store) == 0 and mover.ledger.now == [0, 0, 0]
