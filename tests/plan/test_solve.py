"""`plan()` end to end: the CPU example, GPU plans, option errors, pinned entries."""

import dataclasses
import subprocess
import sys

import pytest

from hetero.errors import USAGE, HeteroError
from hetero.plan.gradient_offload import grid_bytes
from hetero.plan.sections.layers import NO_GPU
from hetero.plan.solve import ONE_PROCESS, PlanOptions, plan, predict
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from tests.plan.synthetic import OFFLOAD, GiB, gpu_profile

EXAMPLE = "plans/gpt-tiny-cpu.profile.yaml"
HANDWORKED = "tests/plan/fixtures/handworked.profile.yaml"


@pytest.fixture
def cpu(repo) -> Profile:
    return files.load(repo / EXAMPLE, expect=Profile)


@pytest.fixture
def handworked(repo) -> Profile:
    return files.load(repo / HANDWORKED, expect=Profile)


def test_cpu_plan_has_no_gpu_sections_and_says_why(cpu):
    p = plan(cpu, PlanOptions(profile_path=EXAMPLE, emulate=True, tier_activations=True))
    assert p.layers == [] and p.routing is None
    assert p.omitted == {"routing": ONE_PROCESS, "layers": NO_GPU}
    assert (p.optimizer.device, p.optimizer.backend, p.optimizer.channels) == ("axdimm", "emulated", 2)
    assert (p.activations.fast, p.activations.slow) == ("dram", "nvme0")
    nvme = next(t for t in cpu.machine.tiers if t.name == "nvme0")
    assert p.activations.min_tensor_bytes in {x.size_bytes for x in nvme.write_beside_compute}
    assert set(p.predicted.peak_bytes) == {"dram", "nvme0"}
    assert p.budget.grad_grid_bytes is None
    assert p.source.profile_sha256 == files.content_sha256(cpu)
    assert p.source.model_fingerprint == cpu.model.fingerprint
    assert all(e.why for e in p.activations.schedule) and p.optimizer.why and p.activations.why
    assert files.loads(files.dumps(p)) == p


def test_the_example_plan_is_what_hetero_plan_writes(cpu, repo):
    """Regenerate with: hetero plan --profile plans/gpt-tiny-cpu.profile.yaml -o plans/gpt-tiny-cpu.plan.yaml
    --emulate axdimm --tier-activations"""
    fresh = plan(cpu, PlanOptions(profile_path=EXAMPLE, emulate=True, tier_activations=True))
    assert files.load(repo / "plans/gpt-tiny-cpu.plan.yaml", expect=Plan) == fresh


def test_gpu_plan_explains_every_layer_and_keeps_to_the_budget():
    profile = gpu_profile(20, seed=4)
    p = plan(profile, PlanOptions(gpu_memory_bytes=GiB, **OFFLOAD))
    assert [x.name for x in p.layers] == [x.name for x in profile.layers]
    assert all(x.why and "; grad: " in x.why for x in p.layers)
    assert set(p.predicted.peak_bytes) == {"dram", "nvme0", "gpu"}
    assert p.predicted.peak_bytes["gpu"] <= GiB
    assert (p.activations.fast, p.activations.slow) == ("gpu", "dram")
    assert p.budget.grad_grid_bytes == grid_bytes(sum(x.params_bytes for x in profile.layers), 20)
    assert files.loads(files.dumps(p)) == p
    assert predict(profile, p).iteration_s == pytest.approx(p.predicted.iteration_s, abs=1e-9)  # ns in the file


# options -> what the message names (the option as given, the limit it passed), what the hint names (the fix)
@pytest.mark.parametrize("options,named,fix", [
    (PlanOptions(slow_tier="nvme9"), ("--slow-tier nvme9",), "nvme0"),  # the tiers there are
    (PlanOptions(slow_tier="dram"), ("--slow-tier dram",), "nvme0"),
    (PlanOptions(gpu_memory_bytes=GiB), ("--gpu-memory 1GiB",), "--gpu-memory"),
    (PlanOptions(optimizer_device="gpu"), ("--optimizer-device gpu",), "--optimizer-device host"),
    (PlanOptions(reserve=1.5), ("--reserve 1.5",), "0 to 1"),
    (PlanOptions(dram_budget_bytes=64 * GiB), ("--dram-budget 64GiB", "23GiB"), "--dram-budget"),  # the machine's
    (PlanOptions(dram_budget_bytes=2**20), ("1MiB",), "--dram-budget"),  # below the floor
])
def test_option_errors_name_the_value_and_the_fix(handworked, options, named, fix):
    with pytest.raises(HeteroError) as e:
        plan(handworked, options)
    assert e.value.exit_code == USAGE and [x for x in named if x not in e.value.message] == []
    assert fix in e.value.hint


def test_no_axdimm_and_unsupported_optimizers(cpu):
    cpu.machine.axdimm = None
    assert plan(cpu, PlanOptions(optimizer_device="host")).optimizer.device == "host"
    with pytest.raises(HeteroError, match="no AXDIMM"):
        plan(cpu, PlanOptions(optimizer_device="axdimm"))
    cpu.training.optimizer = "other"
    p = plan(cpu, PlanOptions())
    assert p.optimizer is None and "not Adam or AdamW" in p.omitted["optimizer"]


def test_clipping_keeps_updates_after_backward_and_accumulation_is_recorded(cpu):
    cpu.training.edits_grads, cpu.training.grad_accumulation = True, 4
    opt = plan(cpu, PlanOptions(optimizer_device="host")).optimizer
    assert (opt.overlap_backward, opt.micro_batches) == (False, 4)
    assert "changes the gradients" in opt.why


def test_replanning_keeps_pinned_entries():
    profile = gpu_profile(8, seed=6)
    first = plan(profile, PlanOptions(**OFFLOAD))
    layer = first.layers[3]
    flipped = dataclasses.replace(layer, mode="dha" if layer.mode != "dha" else "gfgb", grad="host", pinned=True,
                                  why="mine")
    first.layers[3] = flipped
    evicting = next(e for e in first.activations.schedule if e.evict_bytes)
    pinned = dataclasses.replace(evicting, evict_bytes=evicting.evict_bytes // 2, pinned=True)
    first.activations.schedule[first.activations.schedule.index(evicting)] = pinned
    first.optimizer.pinned = True
    first.optimizer.overlap_backward = False
    again = plan(profile, PlanOptions(previous=first))
    assert again.layers[3] == flipped and again.layers[3].why == "mine"
    assert next(e for e in again.activations.schedule if e.layer == pinned.layer) == pinned
    assert again.optimizer == first.optimizer
    first.layers[0] = dataclasses.replace(first.layers[0], name="gone", pinned=True)
    with pytest.raises(HeteroError) as e:
        plan(profile, PlanOptions(previous=first))
    assert e.value.exit_code == USAGE and e.value.message.endswith(": gone")  # the pinned layer it does not have


def test_planning_never_imports_torch():
    code = ("import sys; sys.path.insert(0, '.'); from tests.plan.synthetic import gpu_profile; "
            "from hetero.plan.solve import PlanOptions, plan; plan(gpu_profile(3), PlanOptions()); "
            "assert 'torch' not in sys.modules and 'hetero.run' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_an_edited_plan_is_simulated_as_written_and_refused_where_untimed():
    profile = gpu_profile(4, seed=9)
    p = plan(profile, PlanOptions(**OFFLOAD))
    p.layers = [dataclasses.replace(x, mode="gfgb", grad="gpu") for x in p.layers]
    all_gpu = predict(profile, p)
    p.layers[0].mode = "dha"
    assert predict(profile, p).iteration_s != all_gpu.iteration_s
    profile.layers[0].fp_dha_s = profile.layers[0].bp_dha_s = None
    profile.machine.gpu.dha_read_bytes_per_s = None
    with pytest.raises(HeteroError) as e:
        predict(profile, p)
    assert e.value.exit_code == USAGE and e.value.message.startswith("layers.layer0: ") and "dha" in e.value.message
