"""The seam between the planner and the plan's sections: every section is in the table, and what a table entry
contributes reaches the plan without a line elsewhere."""

import dataclasses

import pytest

from hetero.plan import choices, footprint, pins, sections, solve
from hetero.plan.section import ns
from hetero.plan.sections import TABLE, plain_of
from hetero.plan.sections.recompute import Recompute
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from tests.plan.synthetic import OFFLOAD, gpu_profile

NOT_SECTIONS = {"source", "budget", "predicted", "omitted"}  # what every plan has, whatever it moves
MiB = 1 << 20


@pytest.fixture
def cpu(repo) -> Profile:
    return files.load(repo / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)


def test_every_section_of_the_plan_file_has_one_table_entry():
    names = [s.name for s in TABLE]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(Plan) if f.name not in NOT_SECTIONS)
    assert len(set(names)) == len(names)


def test_plain_training_keeps_only_what_plain_training_has():
    p = solve.plan(gpu_profile(4, peers=1), solve.PlanOptions(**OFFLOAD))
    bare = plain_of(p)
    assert bare.routing == p.routing and p.routing is not None
    assert p.layers and p.optimizer is not None and bare.layers == []
    assert all(getattr(bare, s.name) is None for s in TABLE if s.name not in ("layers", "routing"))


def test_a_table_entry_alone_reaches_the_prediction_and_the_account(cpu, monkeypatch):
    """What a section adds through the seam (time, host memory) is in the plan's prediction, with nothing else
    changed: the orchestrator and the account read the table, not a list of mechanisms."""
    before = solve.plan(cpu, solve.PlanOptions())
    entry = "a test's runtime buffers"

    class Extra(Recompute):
        def cost_s(self, profile, plan):
            return 0.25

        def host_bytes(self, profile, plan, peak):
            return {entry: 3 * MiB}

    table = tuple(Extra() if isinstance(s, Recompute) else s for s in TABLE)
    for module in (sections, solve, choices, footprint, pins):
        monkeypatch.setattr(module, "TABLE", table)
    after = solve.plan(cpu, solve.PlanOptions())
    assert after.predicted.iteration_s == ns(before.predicted.iteration_s + 0.25)
    host = choices.host_tier(cpu)
    assert after.predicted.dram[entry] == 3 * MiB
    assert after.predicted.peak_bytes[host] == before.predicted.peak_bytes[host] + 3 * MiB
    assert after.layers == before.layers and after.optimizer == before.optimizer


def test_sections_left_out_say_why_in_the_tables_order(cpu):
    p = solve.plan(cpu, solve.PlanOptions(optimizer_device="none"))
    order = [s.name for s in TABLE]
    assert list(p.omitted) == sorted(p.omitted, key=order.index)
    assert {"optimizer", "routing", "layers"} <= set(p.omitted)
