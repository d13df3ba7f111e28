"""The GPU fields of a profile, measured on a CUDA device (skipped without one)."""

import pytest

from hetero.profile.profiler import ProfileOptions, profile_script
from tests.conftest import REPO

pytestmark = pytest.mark.gpu


def test_gpu_profile_of_the_example(tmp_path):
    args = ["--device", "cuda", "--n-layer", "2", "--steps", "50"]
    profile = profile_script(str(REPO / "examples/train_gpt.py"), args,
                             ProfileOptions(steps=3, warmup=2, nvme_dir=str(tmp_path)))
    gpu = profile.machine.gpu
    assert gpu is not None and gpu.name and gpu.memory_bytes > 2**30
    for curve in (gpu.h2d, gpu.d2h):
        times = [p.time_s for p in curve]
        assert times == sorted(times) and times[0] > 0, curve  # bigger copies take longer
        assert curve[-1].size_bytes / curve[-1].time_s > 1e9  # pinned copies run at GB/s
    assert [t.kind for t in profile.machine.tiers] == ["hbm", "dram", "nvme"]
    assert profile.machine.tiers[1].read == gpu.h2d
    for layer in profile.layers:
        assert layer.fp_s > 0 and layer.bp_s > 0 and layer.bp_start_s > layer.fp_end_s > 0, layer
    assert gpu.dha_read_bytes_per_s > 0 and gpu.dha_write_bytes_per_s > 0
    owners = [layer for layer in profile.layers if layer.params_bytes]
    assert all(layer.fp_dha_s and layer.bp_dha_s and layer.bp_grad_host_s for layer in owners), profile.unmeasured
