"""The plan's GPU budget kept at run time: the model's GPU capped at `budget.gpu_memory` from bind to close, and an
overrun ended with one line naming the plan entry, the predicted and the measured peak (on the stand-in, whose
`limit` makes an allocation beyond it raise CUDA's out-of-memory error; on a GPU under the `gpu` marker)."""

from __future__ import annotations

import pytest
import torch

from hetero.errors import STALE_PLAN
from hetero.run.gpu_budget import GpuBudget
from hetero.run.runtime import Runtime
from hetero.units import SIZE
from tests.figures import figures
from tests.run.test_tiering import GiB, tiering_plan, tiny_gpt, train

MiB = 1 << 20


def gpu_tiering_plan(model, tmp_path, budget: int, predicted: int = 3 * MiB):
    plan = tiering_plan(model, str(tmp_path / "nvme"), GiB, min_tensor=1024)
    plan.activations.fast, plan.activations.slow, plan.activations.slow_path = "gpu", "dram", None
    plan.budget.gpu_memory_bytes = budget
    plan.predicted.peak_bytes = {"gpu": predicted}
    return plan


def test_the_models_gpu_is_capped_from_bind_to_close(stand_in, tmp_path):
    model = tiny_gpt()
    with Runtime(gpu_tiering_plan(model, tmp_path, 64 * MiB), script=__file__) as runtime:
        assert any(isinstance(m, GpuBudget) for m in runtime.mechanisms)
        train(model, "gpt", steps=2)
        assert stand_in.limit_bytes == 64 * MiB and 0 < stand_in.peak_reserved() < 64 * MiB
    assert stand_in.limit_bytes is None


def test_an_overrun_ends_with_one_line_naming_the_budget_and_both_peaks(stand_in, tmp_path):
    model = tiny_gpt()
    runtime = Runtime(gpu_tiering_plan(model, tmp_path, 20_000), script=__file__)
    with runtime:
        with pytest.raises(torch.cuda.OutOfMemoryError) as oom:
            train(model, "gpt", steps=2)  # the first prefetch buffers cross 20 kB
        error = runtime.explain(oom.value)
        assert runtime.explain(ValueError("bad batch")) is None
    assert error.exit_code == STALE_PLAN and "\n" not in error.message
    # the plan's field and budget, its predicted peak, the peak measured
    assert "budget.gpu_memory" in error.message
    assert figures(error.message)[:3] == ["19.5KiB", "3MiB", SIZE.format_short(stand_in.peak_reserved())]


def test_a_plan_without_a_gpu_budget_sets_no_limit(stand_in, tmp_path):
    model = tiny_gpt()
    plan = gpu_tiering_plan(model, tmp_path, 0)
    plan.budget.gpu_memory_bytes = None
    with Runtime(plan, script=__file__) as runtime:
        assert not any(isinstance(m, GpuBudget) for m in runtime.mechanisms)
        train(model, "gpt", steps=1)
    assert stand_in.limit_bytes is None


@pytest.mark.gpu
def test_the_cap_is_cudas_own(tmp_path):
    model = tiny_gpt().cuda()
    # the cap bounds what the process reserves from the GPU, not what it hands out of its cache: memory cached by
    # earlier tests would serve the allocation below without reserving more (seen on the H100, 2026-11-26)
    torch.cuda.empty_cache()
    budget = torch.cuda.memory_reserved() + 256 * MiB
    plan = gpu_tiering_plan(model, tmp_path, budget)
    with Runtime(plan, script=__file__) as runtime:
        model(torch.zeros(1, 16, dtype=torch.long, device="cuda")).sum().backward()  # bound: the cap is set
        with pytest.raises(torch.cuda.OutOfMemoryError) as oom:
            torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        error = runtime.explain(oom.value)
    assert error is not None and "budget.gpu_memory" in error.message
    torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")  # closed: the whole device again
