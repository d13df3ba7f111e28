"""Machine measurements that say how host worker threads share the CPU with compute."""

import inspect
import math
import time

import pytest
import torch

from hetero.profile import machine, timing, updates
from hetero.profile.tier_steps import DiskBeside
from hetero.schema.profile import Cpu, CurvePoint, Tier

KiB, MiB, GiB = 2**10, 2**20, 2**30


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_background_slowdown_is_bounded_work_and_within_bounds(monkeypatch):
    asked = []
    real = machine.beside_compute
    monkeypatch.setattr(machine, "beside_compute", lambda works, **kw: asked.append((works, kw)) or real(works, **kw))
    slowdown = machine.background_slowdown()
    assert math.isfinite(slowdown) and slowdown >= 1.0, slowdown  # a streaming thread never speeds compute up
    # Quick by construction, not by a clock (CI shares its machine): one streaming worker, and GEMM loops sized to
    # target_s, timed `pairs` times alone and beside it.
    (works, kw), = asked
    defaults = inspect.signature(timing.beside_compute).parameters
    target, pairs = kw.get("target_s", defaults["target_s"].default), kw.get("pairs", defaults["pairs"].default)
    assert len(works) == 1 and 2 * pairs * target <= 1.0


def test_disk_tier_measures_how_much_its_workers_slow_compute(tmp_path):
    tier = machine.measure_nvme(str(tmp_path), slowdown=2.0)
    assert 0 <= tier.read_cpu <= 1 and tier.read_cpu == tier.write_cpu  # one worker makes whole trips
    assert list(tmp_path.iterdir()) == []  # the store's and the slow tier's probe files are gone
    assert [p.size_bytes for p in tier.read_beside_compute] == list(machine.BESIDE_SIZES)
    assert all(p.time_s > 0 for p in tier.read_beside_compute + tier.write_beside_compute)
    alone = machine.measure_nvme(str(tmp_path))  # no slowdown measured (a GPU computes): not measured beside it
    assert alone.read_cpu is None and alone.write_beside_compute == []


def test_emulated_channels_are_measured_beside_compute_only_when_the_cpu_computes():
    beside = machine.measure_axdimm(channels=2, sizes=(4096, 2**18), slowdown=2.0)
    assert 0 <= beside.cpu <= 1 and beside.adam_beside_compute_params_per_s > 0
    assert beside.launch_beside_compute_s >= 0
    alone = machine.measure_axdimm(channels=2, sizes=(4096, 2**18))
    assert alone.cpu is None and alone.adam_beside_compute_params_per_s is None and alone.adam_params_per_s > 0


def test_host_adam_is_timed_on_its_driver_as_the_runtime_runs_it_and_beside_compute_when_the_cpu_computes():
    beside = updates.host_adam(slowdown=2.0)
    assert positive(beside.rate) and beside.launch_s >= 0 and 0 <= beside.cpu <= 1 and positive(beside.beside_rate)
    alone = updates.host_adam()
    assert alone.cpu is None and alone.beside_rate is None and alone.beside_launch_s is None


def test_the_workers_calls_are_timed_beside_compute():
    # how much a waiting worker slows compute is load's business (bench/beside.py measures it); that each call is
    # timed whole, and that the slowdown never reads below 1, is the mechanism's
    beside = timing.beside_compute([lambda: time.sleep(0.001)], target_s=0.01, pairs=2)
    assert math.isfinite(beside.compute) and beside.compute >= 1
    assert math.isfinite(beside.work_s) and beside.work_s >= 0.001  # every call sleeps 1 ms


def test_the_workers_run_while_compute_runs_and_stop_after():
    # How much they slow compute depends on what else the (shared) machine runs; that they overlap does not.
    done = []
    a = torch.ones(256, 256)

    def job():
        before = len(done)
        while len(done) < before + 3:  # compute goes on until the workers have finished calls meanwhile
            a @ a
        return len(done)

    seen, calls = timing._while_working([lambda: done.append(a @ a) for _ in range(2)], job)
    assert seen >= 3 and len(calls) >= 3 and all(s <= e for s, e in calls)
    after = len(done)
    time.sleep(0.05)
    assert len(done) <= after + 2  # stopped: at most the call each worker was in


def test_with_a_gpu_the_slowdown_is_left_null_and_said_why(monkeypatch):
    monkeypatch.setattr(machine, "copy_bandwidth", lambda nbytes: 1e10)
    monkeypatch.setattr(machine, "host_adam", lambda slowdown, sizes: updates.Updates(launch_s=1e-4, rate=1e9))
    monkeypatch.setattr(machine, "host_adam_beyond_cache", lambda params, launch_s: 5e8)
    monkeypatch.setattr(machine, "background_slowdown", lambda: pytest.fail("measured beside a GPU"))
    cpu = machine.measure_cpu(gpu=True)
    assert cpu.background_slowdown is None and cpu.adam_cpu is None and cpu.adam_beside_compute_params_per_s is None
    dram = Tier(name="dram", kind="dram", capacity_bytes=2**30, read=[], write=[])
    nvme = Tier(name="nvme0", kind="nvme", capacity_bytes=2**30, path="/tmp")
    reasons = machine.unmeasured(torch.device("cuda"), [], [dram, nvme])
    for field in ("cpu.background_slowdown", "cpu.adam_cpu", "cpu.adam_beside_compute", "axdimm.cpu", "axdimm.adam_beside_compute", "tiers.nvme0.read_cpu",
                  "tiers.nvme0.write_beside_compute"):
        assert reasons[f"machine.{field}"] == machine.ON_GPU
    assert not any(key.startswith("machine.tiers.dram") for key in reasons)  # no curves: HBM-like


def test_memory_tiers_count_as_busy_and_say_so():
    copy = machine.host_copy_curve(sizes=(4096,))
    dram = Tier(name="dram", kind="dram", capacity_bytes=2**30, read=copy, write=copy)
    reasons = machine.unmeasured(torch.device("cpu"), [], [dram])
    assert reasons["machine.tiers.dram.read_cpu"] == reasons["machine.tiers.dram.write_cpu"] == machine.MEMORY_COPY_CPU
    assert reasons["machine.tiers.dram.read_beside_compute"] == machine.MEMORY_BESIDE
    assert "machine.cpu.background_slowdown" not in reasons


def test_a_disk_timed_beside_training_keeps_its_curves_and_its_workers_measured_cost(tmp_path):
    timed = DiskBeside(read=[CurvePoint(size_bytes=2**20, time_s=0.004)],
                       write=[CurvePoint(size_bytes=2**20, time_s=0.002)], stretch=0.3)
    tier = machine.measure_nvme(str(tmp_path), slowdown=1.6, disk_beside=timed)
    assert tier.read_beside_compute == timed.read and tier.write_beside_compute == timed.write
    assert tier.read_cpu == tier.write_cpu == 0.5  # 0.3 s lost per busy second, of a streaming worker's 0.6
    assert list(tmp_path.iterdir()) == []


def sys_cache(root, cpu: int, index: int, level: int, kind: str, size: str, shared: str) -> None:
    """One cache of one core as /sys/devices/system/cpu reports it, under `root`."""
    entry = root / f"cpu{cpu}" / "cache" / f"index{index}"
    entry.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (entry / name).write_text(f"{value}\n")


def test_the_last_level_cache_is_the_cores_own_summed_over_distinct_caches(tmp_path):
    for cpu in range(3):  # cores 0 and 1 share a 32 MiB L3, core 2 has its own 16 MiB one
        sys_cache(tmp_path, cpu, 0, 1, "Data", "32K", str(cpu))
        sys_cache(tmp_path, cpu, 1, 1, "Instruction", "32K", str(cpu))
        sys_cache(tmp_path, cpu, 2, 2, "Unified", "1024K", str(cpu))
        sys_cache(tmp_path, cpu, 3, 3, "Unified", "32768K" if cpu < 2 else "16M", "0-1" if cpu < 2 else "2")
    assert machine.last_level_cache_bytes({0, 1}, tmp_path) == 32 * MiB  # shared: counted once
    assert machine.last_level_cache_bytes({0, 2}, tmp_path) == 48 * MiB
    assert machine.last_level_cache_bytes({7}, tmp_path) is None  # nothing reported for that core
    assert machine.last_level_cache_bytes(root=tmp_path / "gone") is None


def test_host_adam_beyond_the_caches_is_timed_on_states_four_times_the_cache_within_a_bound():
    assert machine.beyond_cache_params(32 * MiB, machine.BEYOND_BYTES) * 16 == 128 * MiB
    assert machine.beyond_cache_params(GiB, machine.BEYOND_BYTES) * 16 == machine.BEYOND_BYTES
    assert machine.beyond_cache_params(None, 64 * MiB) * 16 == 64 * MiB  # no cache reported: the bound
    assert machine.beyond_cache_params(32 * MiB, 4 * MiB) * 16 == 4 * MiB  # under a budget: what it leaves


def test_the_cpu_records_its_cache_and_host_adam_beyond_it_with_a_calls_fixed_cost(monkeypatch):
    timed = []
    real = machine.host_adam_beyond_cache
    monkeypatch.setattr(machine, "last_level_cache_bytes", lambda: 64 * KiB)  # small: a cheap update beyond it
    monkeypatch.setattr(machine, "host_adam_beyond_cache",
                        lambda params, launch_s: timed.append((params, launch_s)) or real(params, launch_s))
    cpu = machine.measure_cpu(gpu=True, copy_bytes=MiB, largest=4 * MiB, beyond_bytes=4 * MiB)
    assert timed == [(4 * 64 * KiB // 16, pytest.approx(cpu.adam_launch_s, rel=1e-3))]  # 4x the cache of states
    assert cpu.last_level_cache_bytes == 64 * KiB and positive(cpu.adam_beyond_cache_params_per_s)
    assert cpu.adam_launch_s > 0 and positive(cpu.adam_params_per_s)


def test_a_cache_the_system_does_not_report_is_said_and_an_older_records_is_not():
    cpu = Cpu(model="m", cores=2, dram_bandwidth_bytes_per_s=1e10, adam_params_per_s=1e9,
              adam_beyond_cache_params_per_s=5e8)
    reasons = machine.unmeasured(torch.device("cpu"), [], [], cpu)
    assert reasons["machine.cpu.last_level_cache"] == machine.NO_CACHE
    older = Cpu(model="m", cores=2, dram_bandwidth_bytes_per_s=1e10, adam_params_per_s=1e9)
    assert "machine.cpu.last_level_cache" not in machine.unmeasured(torch.device("cpu"), [], [], older)


def test_host_adam_beyond_the_caches_is_a_rate_of_its_own_update():
    assert positive(updates.host_adam_beyond_cache(2**16, launch_s=0.0))
