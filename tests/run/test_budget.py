"""The runtime keeps what the plan decided about host memory: malloc's thresholds set (and restored) by the plan's
`allocator` section, training unchanged by them, one warning when the process nears the plan's DRAM budget, and one
at once when it passes it, naming the entry of the plan's account most to blame."""

from __future__ import annotations

import io
import time
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from hetero.plan import fit
from hetero.run import allocator, process_memory
from hetero.run.budget_watch import Blame, BudgetWatch, blame, warning_line
from hetero.run.runtime import Runtime, mechanisms
from hetero.schema.plan import AllocatorPlan, Predicted
from hetero.units import SIZE
from tests.figures import figures
from tests.run.plans import optimizer_plan
from tests.run.test_nvme_states import model, train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_returned_memory_and_states_on_nvme_train_as_plain(tmp_path, monkeypatch):
    calls = []
    real = allocator.set_thresholds
    monkeypatch.setattr(allocator, "set_thresholds", lambda m, t: calls.append((m, t)) or real(m, t))
    reference = model()
    expected, _ = train(reference)
    net = model()
    names = tuple(n for n, _ in net.named_parameters())
    plan = optimizer_plan(net, device="host", overlap=False, nvme=names, nvme_path=str(tmp_path))
    plan = replace(plan, allocator=fit.allocator_plan("test"))
    with Runtime(plan, script=__file__):
        assert calls == [(AllocatorPlan.RETURNING, AllocatorPlan.RETURNING)]  # before the script runs
        losses, _ = train(net)
    assert calls[-1] == (allocator.RESTORED_MMAP_BYTES, allocator.RESTORED_TRIM_BYTES)
    assert_close(torch.tensor(losses), torch.tensor(expected))
    for p, q in zip(net.parameters(), reference.parameters()):
        assert_close(p, q)


def test_from_bytes_keeps_mallocs_defaults_below_it_and_returns_memory_from_it_on(monkeypatch):
    calls = []
    real = allocator.set_thresholds
    monkeypatch.setattr(allocator, "set_thresholds", lambda m, t: calls.append((m, t)) or real(m, t))
    far = allocator.ReturnFreedMemory(fit.allocator_plan("test", from_bytes=1 << 50), interval_s=0.001)
    far.install(None, None)
    time.sleep(0.02)
    far.close()
    assert calls == [] and far.returned_at is None and "kept its defaults" in far.summary()[0]
    near = allocator.ReturnFreedMemory(fit.allocator_plan("test", from_bytes=1), interval_s=0.001)
    near.install(None, None)
    deadline = time.monotonic() + 60  # not a timing assertion: the watch's first look, however late it comes
    while near.returned_at is None and time.monotonic() < deadline:
        time.sleep(0.001)
    near.close()
    assert near.returned_at > 0 and calls[0] == (AllocatorPlan.RETURNING, AllocatorPlan.RETURNING)
    assert calls[-1] == (allocator.RESTORED_MMAP_BYTES, allocator.RESTORED_TRIM_BYTES)


def test_no_allocator_section_leaves_malloc_alone(monkeypatch):
    monkeypatch.setattr(allocator, "set_thresholds", lambda *a: pytest.fail("malloc touched"))
    with Runtime(optimizer_plan(model(), device="host"), script=__file__):
        pass


def test_the_watch_warns_once_near_the_budget_naming_the_largest_contributors():
    plan = optimizer_plan(model(), device="host")
    now = process_memory.dram_peak_bytes()
    plan.predicted = Predicted(iteration_s=1.0, peak_bytes={}, dram={"plain training": 3 << 30, "staging": 1 << 20,
                                                                       "hetero optimizer": 1 << 30})
    out = io.StringIO()
    far = BudgetWatch(replace(plan.budget, dram_budget_bytes=4 * now), plan.predicted, out=out)
    far.check()
    assert far.warned is None and out.getvalue() == ""
    near = BudgetWatch(replace(plan.budget, dram_budget_bytes=int(now / 0.97)), plan.predicted, out=out)
    near.check()
    near.check()
    lines = out.getvalue().splitlines()
    assert lines == [f"hetero: warning: {near.warned}"] and near.over is None  # said once, near and not over
    named = near.warned.split("; ")[-1]  # the plan's largest entries, largest first, with their sizes
    assert figures(named) == ["3GiB", "1GiB", "1MiB"]
    assert named.index("plain training") < named.index("hetero optimizer") < named.index("staging")


def test_a_budget_in_the_plan_starts_the_watch_and_none_does_not():
    plan = optimizer_plan(model(), device="host")
    assert not any(isinstance(m, BudgetWatch) for m in mechanisms(plan))
    budgeted = replace(plan, budget=replace(plan.budget, dram_budget_bytes=1 << 40))
    assert any(isinstance(m, BudgetWatch) for m in mechanisms(budgeted))
    assert "over the plan's" in warning_line(2 << 30, 1 << 30, {})


def test_passing_the_budget_is_said_at_once_with_the_peak_and_the_entry_most_to_blame():
    plan = optimizer_plan(model(), device="host")
    now = process_memory.dram_peak_bytes()
    plan.predicted = Predicted(iteration_s=1.0, peak_bytes={}, dram={"plain training": now // 2},
                               dram_saved={"gradients freed in backward": 1 << 20})
    out = io.StringIO()
    watch = BudgetWatch(replace(plan.budget, dram_budget_bytes=now // 2), plan.predicted, out=out)
    watch.check()
    watch.check()
    lines = out.getvalue().splitlines()
    assert lines == [f"hetero: warning: {watch.over}"] and watch.warned is None  # said once, at once
    assert "plain training" in watch.over.split("; ")[-1]  # the entry most to blame: the plan's only one
    assert figures(watch.summary()[0])[0] == SIZE.format_short(now // 2) and "not kept" in watch.summary()[0]
    kept = BudgetWatch(replace(plan.budget, dram_budget_bytes=4 * now), plan.predicted, out=out)
    kept.check()
    assert kept.over is None and figures(kept.summary()[0])[0] == SIZE.format_short(4 * now)
    assert "kept" in kept.summary()[0] and "not kept" not in kept.summary()[0]


def test_the_entry_most_to_blame_is_the_one_measured_furthest_over_its_prediction():
    MiB = 1 << 20
    account = {"plain training": 800 * MiB, "hetero optimizer": 100 * MiB, "nvme state staging": 20 * MiB,
               "script's adam states": -200 * MiB}
    # the mechanisms hold their predicted bytes: the base took the excess
    assert blame(760 * MiB, account, {"hetero optimizer": 100 * MiB}) == \
        Blame("plain training", 800 * MiB, 840 * MiB)
    # the optimizer holds 90 MiB more than planned: it is to blame, the base is as predicted
    assert blame(810 * MiB, account, {"hetero optimizer": 190 * MiB, "nvme state staging": 20 * MiB}) == \
        Blame("hetero optimizer", 100 * MiB, 190 * MiB)
    assert blame(1, {}, {}) is None


def test_below_the_switch_a_backward_that_grew_the_heaps_returns_their_free_memory_and_after_it_the_holes(
        monkeypatch):
    trims, MiB = [], 1 << 20
    monkeypatch.setattr(allocator, "trim", lambda: trims.append(1) or True)
    x = torch.ones(4, requires_grad=True)
    # resident as each backward ends; the watch never looks (an hour's interval)
    held = iter([100 * MiB, 105 * MiB, 116 * MiB, 95 * MiB, 127 * MiB])
    monkeypatch.setattr(process_memory, "resident_bytes", lambda: next(held))
    below = allocator.ReturnFreedMemory(fit.allocator_plan("test", from_bytes=640 * MiB), interval_s=3600)
    below.install(None, None)
    for _ in range(5):  # a 64th of 640 MiB (10) above the most any backward ended with: 100 trimmed, 105 kept,
        (x * 2).sum().backward()  # 116 trimmed, 95 kept, 127 trimmed
    below.close()
    assert below.trims == 3 and below.returned_at is None
    (x * 2).sum().backward()  # closed: nothing listens
    assert len(trims) == 3
    monkeypatch.setattr(process_memory, "resident_bytes", lambda: 1 << 30)
    near = allocator.ReturnFreedMemory(fit.allocator_plan("test", from_bytes=1), interval_s=0.001)
    near.install(None, None)
    deadline = time.monotonic() + 60  # not a timing assertion: the watch's first looks, however late they come
    while near.trims < 2 and time.monotonic() < deadline:  # the switch, then the holes it left, every interval
        time.sleep(0.001)
    assert near.applied and near.trims >= 2
    (x * 2).sum().backward()  # the first backward after the switch ends the holes' trimming
    near.close()
    after = len(trims)
    (x * 2).sum().backward()
    assert len(trims) == after  # from then on large blocks are mapped on their own: nothing left to trim
