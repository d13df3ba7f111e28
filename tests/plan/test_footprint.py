"""The whole process's host memory in a plan, and the rules that keep a plan from costing memory for nothing."""

from dataclasses import replace

import pytest

from hetero.errors import USAGE, HeteroError
from hetero.plan.choices import host_tier
from hetero.plan.sections import optimizer_bytes
from hetero.plan.solve import PlanOptions, plan
from hetero.schema import files
from hetero.schema.plan import ActivationPlan
from hetero.schema.profile import Memory, Profile
from hetero.units import SIZE
from tests.figures import figures
from tests.plan.synthetic import GiB, gpu_profile

MiB = 2**20
PLAIN_PEAK = 900 * MiB


@pytest.fixture
def cpu(repo) -> Profile:
    profile = files.load(repo / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)
    profile.memory = Memory(dram_peak_bytes=PLAIN_PEAK)
    return profile


def params(profile: Profile) -> int:
    return sum(x.num_params for x in profile.layers)


def test_without_a_gpu_the_default_plan_runs_plain_and_predicts_plains_peak(cpu):
    p = plan(cpu, PlanOptions())
    assert (p.optimizer, p.activations, p.routing, p.layers) == (None, None, None, [])
    assert "save nothing" in p.omitted["optimizer"] and "allocator keeps" in p.omitted["activations"]
    assert p.predicted.peak_bytes["dram"] == PLAIN_PEAK


def test_hosts_adam_without_a_gpu_adds_its_master_copies(cpu):
    p = plan(cpu, PlanOptions(optimizer_device="host"))
    assert p.optimizer.device == "host"
    assert p.predicted.peak_bytes["dram"] == PLAIN_PEAK + 4 * params(cpu)  # m and v move; the fp32 master is new


def test_hosts_adam_in_step_keeps_no_master_copy_of_its_own(cpu):
    """A script that changes its gradients after backward is updated in step(), where the parameters' own bytes
    are the master copies (OptimizerPlan.shares_master): m and v move, nothing is added."""
    cpu.training.edits_grads = True
    p = plan(cpu, PlanOptions(optimizer_device="host"))
    assert (p.optimizer.device, p.optimizer.overlap_backward) == ("host", False)
    assert p.predicted.peak_bytes["dram"] == PLAIN_PEAK
    assert "save nothing" in plan(cpu, PlanOptions()).omitted["optimizer"]


@pytest.mark.parametrize("gpu", [False, True])
def test_a_shared_master_is_4_bytes_a_parameter_less_in_host_memory(cpu, gpu):
    profile = gpu_profile(6, seed=2) if gpu else cpu
    host = host_tier(profile)
    overlapped = plan(profile, PlanOptions(optimizer_device="host")).optimizer
    assert overlapped.overlap_backward and {s.tier for s in overlapped.states} == {"host"}
    in_step = replace(overlapped, overlap_backward=False)
    held = {o.overlap_backward: optimizer_bytes.static_bytes(profile, o, host)[host] for o in (overlapped, in_step)}
    assert held[True] - held[False] == 4 * params(profile)
    if not gpu:  # m and v alone, as the runtime's host homes hold them (tests/run/test_one_master.py)
        assert held[False] == 8 * params(profile)


def test_the_emulated_axdimm_is_opt_in_and_counted_in_host_memory(cpu):
    assert cpu.machine.axdimm.backend == "emulated"
    assert plan(cpu, PlanOptions()).optimizer is None  # never the default
    p = plan(cpu, PlanOptions(emulate=True))
    assert (p.optimizer.device, p.optimizer.backend) == ("axdimm", "emulated")
    added = 8 * params(cpu)  # master, m, v and the gradient buffer on its channels, less the script's m and v
    assert p.predicted.peak_bytes["dram"] == PLAIN_PEAK + added
    assert "host DRAM" in p.optimizer.why
    with pytest.raises(HeteroError) as e:
        plan(cpu, PlanOptions(emulate=True, optimizer_device="host"))
    assert e.value.exit_code == USAGE and "--emulate axdimm" in e.value.message  # and the option it conflicts with
    assert "--optimizer-device" in e.value.message and e.value.hint is not None


def test_evicting_from_host_memory_leaves_the_predicted_process_peak_at_plains(cpu):
    p = plan(cpu, PlanOptions(tier_activations=True))
    assert any(e.evict_bytes for e in p.activations.schedule)
    drop = p.predicted.activations.peak_fast_untiered_bytes - p.predicted.activations.peak_fast_bytes
    store = ActivationPlan.STORE_BYTES  # the slow tier's bounce buffers
    assert drop > store  # they come out of what evictions free; the rest of the drop stays in malloc's heap
    assert p.predicted.dram == {"plain training": PLAIN_PEAK, "activation store buffers": store}
    assert p.predicted.dram_saved == {"evicted activations": store}
    assert p.predicted.peak_bytes["dram"] == PLAIN_PEAK


def test_a_dram_budget_plain_training_fits_keeps_plain_and_one_it_does_not_is_refused(cpu):
    assert plan(cpu, PlanOptions(dram_budget_bytes=2 * GiB)).activations is None
    with pytest.raises(HeteroError) as e:  # evictions do not lower it
        plan(cpu, PlanOptions(dram_budget_bytes=PLAIN_PEAK // 2))
    assert e.value.exit_code == USAGE  # the floor, and the budget that would reach it
    assert "--dram-budget" in e.value.hint and SIZE.parse(figures(e.value.hint)[0]) > PLAIN_PEAK // 2


def test_with_a_gpu_host_memory_gains_what_the_plan_moves_there():
    profile = gpu_profile(12, seed=3)
    profile.memory = Memory(dram_peak_bytes=PLAIN_PEAK)
    p = plan(profile, PlanOptions(optimizer_device="host", tier_activations=True))
    assert p.optimizer.device == "host" and p.activations is not None
    assert p.predicted.peak_bytes["dram"] > PLAIN_PEAK + 16 * params(profile)  # states, plus evicted activations


def test_a_real_axdimm_is_the_default():
    profile = gpu_profile(6, seed=1, axdimm=True)
    tight = PlanOptions(gpu_memory_bytes=plan(profile, PlanOptions()).predicted.peak_bytes["gpu"] // 2)
    assert plan(profile, tight).optimizer.device == "host"  # emulated
    profile.machine.axdimm.backend = "hardware"
    assert plan(profile, tight).optimizer.device == "axdimm"


def test_the_optimizer_can_be_switched_off_without_writing_a_reason(cpu):
    p = plan(cpu, PlanOptions(optimizer_device="none"))
    assert p.optimizer is None and p.omitted["optimizer"].startswith("--optimizer-device none")
    gpu = gpu_profile(6, seed=2)
    assert plan(gpu, PlanOptions(optimizer_device="none")).optimizer is None
