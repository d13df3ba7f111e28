"""The runtime builds its mechanisms from one table: each factory gets its section and the services it declares,
and the mechanisms run in the order of their phases, not of the table."""

from dataclasses import replace

from hetero.run.budget_watch import BudgetWatch
from hetero.run.ddp_sync import DdpSync
from hetero.run.mechanism import Mechanism, Phase
from hetero.run.optimizer import OptimizerOffload
from hetero.run.runtime import MECHANISMS, Entry, Runtime, mechanisms
from tests.run.plans import optimizer_plan
from tests.run.test_nvme_states import model


class Made(Mechanism):
    def __init__(self, section, **services):
        self.section, self.services = section, services


def test_a_factory_gets_its_section_and_only_the_services_it_declares():
    plan = optimizer_plan(model(), device="host")
    table = (Entry(Phase.WATCH, lambda p: p.budget, Made, needs=("predicted", "earlier")),
             Entry(Phase.OPTIMIZER, lambda p: p.optimizer, Made, needs=("fingerprint",)),
             Entry(Phase.MEMORY, lambda p: p.allocator, Made))  # the plan has none: not built
    first, last = mechanisms(plan, table=table)
    assert (first.section, first.services) == (plan.optimizer, {"fingerprint": plan.source.model_fingerprint})
    assert last.section is plan.budget and set(last.services) == {"predicted", "earlier"}
    assert last.services["earlier"] == [first]  # what was built before it, in phase order


def test_the_plan_s_mechanisms_come_in_phase_order_and_share_one_ddp_hook():
    plan = optimizer_plan(model(), device="host", overlap=True)
    plan = replace(plan, budget=replace(plan.budget, dram_budget_bytes=1 << 40))
    found = mechanisms(plan)
    assert [type(m) for m in found] == [OptimizerOffload, DdpSync, BudgetWatch]
    assert found[0].ddp is found[1] and found[2].others == found[:2]
    assert [e.phase for e in MECHANISMS] == sorted(e.phase for e in MECHANISMS)  # the table reads in run order


def test_a_runtime_finds_its_mechanisms_by_type():
    plan = optimizer_plan(model(), device="host", overlap=False)
    runtime = Runtime(plan, script=__file__)
    assert isinstance(runtime.find(OptimizerOffload), OptimizerOffload)
    assert runtime.find(DdpSync) is None  # no overlapped update, no routing: DDP's hook stays DDP's
