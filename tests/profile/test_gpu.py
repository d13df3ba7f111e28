"""The GPU fields of a profile, measured on a CUDA device (skipped without one)."""

import math

import pytest

from hetero.profile.machine import GPU_SIZES
from hetero.profile.profiler import ProfileOptions, profile_script
from tests.conftest import REPO

pytestmark = pytest.mark.gpu


def test_gpu_profile_of_the_example(tmp_path):
    args = ["--device", "cuda", "--n-layer", "2", "--steps", "50"]
    profile = profile_script(str(REPO / "examples/train_gpt.py"), args,
                             ProfileOptions(steps=3, warmup=2, nvme_dir=str(tmp_path)))
    gpu = profile.machine.gpu
    assert gpu is not None and gpu.name and gpu.memory_bytes > 2**30
    for curve in (gpu.h2d, gpu.d2h):  # how fast the link is: bench/ and docs/gpu-results.md
        assert [p.size_bytes for p in curve] == list(GPU_SIZES)
        assert all(math.isfinite(p.time_s) and p.time_s > 0 for p in curve), curve
    assert [t.kind for t in profile.machine.tiers] == ["hbm", "dram", "nvme"]
    assert profile.machine.tiers[1].read == gpu.h2d
    for layer in profile.layers:
        assert layer.fp_s > 0 and layer.bp_s > 0 and layer.bp_start_s > layer.fp_end_s > 0, layer
    assert gpu.dha_read_bytes_per_s > 0 and gpu.dha_write_bytes_per_s > 0
    owners = [layer for layer in profile.layers if layer.params_bytes]
    assert all(layer.fp_dha_s and layer.bp_dha_s and layer.bp_grad_host_s for layer in owners), profile.unmeasured
