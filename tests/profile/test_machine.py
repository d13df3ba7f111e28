"""Machine measurements that say how host worker threads share the CPU with compute."""

import time

import pytest
import torch

from hetero.profile import machine
from hetero.profile.schema import Tier


def test_background_slowdown_is_measured_quickly_and_within_bounds():
    start = time.perf_counter()
    slowdown = machine.background_slowdown()
    assert time.perf_counter() - start < 1.5
    assert 1.0 <= slowdown < 20, slowdown  # a streaming thread never speeds compute up


def test_disk_tier_measures_how_much_its_workers_slow_compute(tmp_path):
    tier = machine.measure_nvme(str(tmp_path), slowdown=2.0)
    assert 0 <= tier.read_cpu <= 1 and 0 <= tier.write_cpu <= 1, (tier.read_cpu, tier.write_cpu)
    assert machine.measure_nvme(str(tmp_path)).read_cpu is None  # no slowdown measured (a GPU): no shares


def test_a_worker_that_only_waits_does_not_slow_compute():
    assert machine.slowdown_beside(lambda: time.sleep(0.001)) < 1.3


def test_with_a_gpu_the_slowdown_is_left_null_and_said_why(monkeypatch):
    monkeypatch.setattr(machine, "copy_bandwidth", lambda: 1e10)
    monkeypatch.setattr(machine, "adam_rate", lambda: 1e9)
    monkeypatch.setattr(machine, "background_slowdown", lambda: pytest.fail("measured beside a GPU"))
    assert machine.measure_cpu(gpu=True).background_slowdown is None
    dram = Tier(name="dram", kind="dram", capacity_bytes=2**30, read=[], write=[])
    nvme = Tier(name="nvme0", kind="nvme", capacity_bytes=2**30, path="/tmp", read_cpu=0.1, write_cpu=0.1)
    reasons = machine.unmeasured(torch.device("cuda"), [], [dram, nvme])
    assert reasons["machine.cpu.background_slowdown"] == machine.ON_GPU
    assert not any(key.startswith("machine.tiers.") for key in reasons)  # no curves (HBM-like) or measured


def test_memory_tiers_count_as_busy_and_say_so():
    copy = machine.host_copy_curve(sizes=(4096,))
    dram = Tier(name="dram", kind="dram", capacity_bytes=2**30, read=copy, write=copy)
    reasons = machine.unmeasured(torch.device("cpu"), [], [dram])
    assert reasons["machine.tiers.dram.read_cpu"] == reasons["machine.tiers.dram.write_cpu"] == machine.MEMORY_COPY_CPU
    assert "machine.cpu.background_slowdown" not in reasons
