"""Which tier is host memory and which the NVMe tier: the planner's and the runtime's one answer."""

from dataclasses import replace

from hetero.schema.plan import ActivationPlan, NvmeOverflow, OptimizerPlan, Predicted
from hetero.schema.profile import Tier
from hetero.schema.tiers import host_tier, plan_tiers
from tests.run.plans import optimizer_plan
from tests.run.test_nvme_states import model


def test_host_memory_is_the_first_dram_tier_else_the_first_tier():
    nvme, dram = Tier(name="nvme0", kind="nvme", capacity_bytes=1), Tier(name="ddr", kind="dram", capacity_bytes=1)
    assert host_tier([nvme, dram]) is dram
    assert host_tier([nvme]) is nvme


def activations(fast: str, slow: str, slow_path: str | None) -> ActivationPlan:
    return ActivationPlan(fast=fast, slow=slow, slow_path=slow_path, stay_time_s=0.0, min_tensor_bytes=0, schedule=[])


def test_a_plan_names_its_tiers_for_the_roles_mechanisms_report_under():
    plan = optimizer_plan(model(), device="host", nvme=("0.weight",), nvme_path="/mnt/a")
    plan.predicted = Predicted(iteration_s=1.0, peak_bytes={"gpu": 1, "ddr": 2, "nvme1": 3})
    assert plan_tiers(plan) == {"host": "ddr", "nvme": "nvme1", "gpu": "gpu"}
    # the activations' tiers name host memory and, on the optimizer's own directory, the NVMe tier
    plan.activations = activations("host0", "disk", "/mnt/a")
    assert plan_tiers(plan) == {"host": "host0", "nvme": "disk", "gpu": "gpu"}
    # a plan that names the optimizer's NVMe tier is taken at its word
    opt: OptimizerPlan = plan.optimizer
    plan.optimizer = replace(opt, nvme=NvmeOverflow(path="/mnt/b", size_bytes=0, tier="nvme1"))
    assert plan_tiers(plan)["nvme"] == "nvme1"
