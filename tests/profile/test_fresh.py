"""Plain training's own peak measured alone after a profile under a memory limit (hetero.profile.fresh): the fresh
process ends itself at `stop_at`, the profile takes the peak where it settled below, keeps its estimate where it
did not, and the launcher stays small (no torch)."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from hetero.plan import fit
from hetero.profile import fresh, returned
from hetero.schema import files
from hetero.schema.profile import Profile
from tests.conftest import REPO
from tests.profile import scripts

MiB = 2**20
PROFILE = REPO / "plans/gpt-tiny-cpu.profile.yaml"


def estimated(tmp_path, peak: int = 100 * MiB) -> str:
    """The bundled profile as a profile under a budget writes it: plain's peak estimated."""
    profile = files.load(PROFILE, expect=Profile)
    profile.memory = replace(profile.memory, dram_peak_bytes=peak, dram_peak_estimated=True, dram_peak_runs_bytes=[],
                             profiled_under="freed memory returned from the start, under the 1GiB memory cgroup")
    path = tmp_path / "profile.yaml"
    files.save(profile, path)
    return str(path)


def test_the_launcher_imports_no_torch():
    code = "import sys, hetero.profile.fresh; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=os.environ | {"PYTHONPATH": str(REPO)})
    assert done.stdout.strip() == "False"


def test_a_fresh_process_that_reaches_stop_at_ends_itself_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    script = scripts.write(tmp_path, scripts.LOOP)
    assert fresh.run(script, ["--steps", "6"], 3, "default", "optimizer", stop_at=40 * MiB) is None  # torch: 150
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("hetero-")] == []


def test_the_median_of_the_runs_alone_counts_a_run_without_a_peak_above_every_other(monkeypatch):
    a, b = fresh.Run(peak_bytes=700 * MiB, step_s=0.1, steps=4), fresh.Run(peak_bytes=690 * MiB, step_s=0.2, steps=4)
    assert fresh.median([a, None, b]) == a and fresh.median([None, b, None]) is None and fresh.median([b]) == b
    assert fresh.median([a, b]) == fresh.Run(peak_bytes=695 * MiB, step_s=pytest.approx(0.15), steps=4)
    assert fresh.median([a, None]) is None
    calls = []
    monkeypatch.setattr(fresh, "run", lambda *args: calls.append(args) or None)
    assert fresh.runs_alone("train.py", [], 3, "optimizer", 1 << 30) == [None, None] and len(calls) == 2
    monkeypatch.setattr(fresh, "run", lambda *args: a)
    assert fresh.runs_alone("train.py", [], 3, "optimizer", 1 << 30) == [a, a]  # two agree: plain fits


def test_the_profile_takes_the_peak_measured_alone_or_keeps_its_estimate(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fresh, "RUNS", 1)  # one fresh process each way: the median is tested above
    script = scripts.write(tmp_path, scripts.LOOP)
    path = estimated(tmp_path)
    argv = [path, str(2 << 30), str(3 << 30), "3", "optimizer", "text", "plain", script, "--steps", "6"]
    assert fresh.main(argv) == 0
    memory = files.load(path, expect=Profile).memory
    assert not memory.dram_peak_estimated and memory.dram_peak_runs_bytes == [memory.dram_peak_bytes]
    assert 50 * MiB < memory.dram_peak_bytes < 2 << 30 and memory.default_step_s > 0
    assert "measured alone" in memory.profiled_under and "measured alone" in capsys.readouterr().out

    path = estimated(tmp_path)
    assert fresh.main([path, str(40 * MiB), str(3 << 30), *argv[3:]]) == 0  # torch alone holds more than 40 MiB
    memory = files.load(path, expect=Profile).memory
    assert memory.dram_peak_estimated and memory.dram_peak_bytes == 100 * MiB and "stays estimated" in \
        memory.profiled_under
    assert "gave no peak settled below" in capsys.readouterr().out


def test_where_plain_fills_the_room_only_the_leaner_plans_run_alone(tmp_path, capsys, monkeypatch):
    plain, leaner = [], []
    monkeypatch.setattr(fresh, "runs_alone", lambda *args: plain.append(args) or [])
    monkeypatch.setattr(fresh, "leaner_alone", lambda *args: leaner.append(args) or None)
    path = estimated(tmp_path)
    assert fresh.main([path, str(2 << 30), str(3 << 30), "3", "optimizer", "text", "leaner", "train.py"]) == 0
    assert plain == [] and len(leaner) == 1
    memory = files.load(path, expect=Profile).memory
    assert memory.dram_peak_estimated and "plain training not run alone" in memory.profiled_under
    assert "not run alone" in capsys.readouterr().out


def test_where_plain_with_memory_returned_passes_the_stop_updates_in_backward_with_it_are_the_reference(
        tmp_path, monkeypatch):
    ran = []
    reference, lean = fresh.Run(peak_bytes=90 * MiB, step_s=1.0, steps=3), fresh.Run(80 * MiB, 0.8, 3)

    def run(script, args, steps, malloc, steps_from, stop_at=None, plan=None):
        ran.append((malloc, plan is not None))
        return None if plan is None else reference if malloc == "returned" else lean
    monkeypatch.setattr(fresh, "run", run)
    monkeypatch.setattr(fresh, "stop_at", lambda room, limit: room)
    found = fresh.leaner_alone(estimated(tmp_path), "train.py", [], 3, "optimizer", 200 * MiB, 3 << 30)
    assert ran == [("returned", False), ("returned", True), ("default", True), ("default", True)]
    assert found.returned == reference and found.reference == "updates in backward"
    assert "the step of updates in backward with freed memory returned" in fresh.alone(
        files.load(estimated(tmp_path), expect=Profile).memory, [], 200 * MiB, found).profiled_under


def test_json_prints_the_profile_as_written(tmp_path, capsys):
    script = scripts.write(tmp_path, scripts.LOOP)
    path = estimated(tmp_path)
    assert fresh.main([path, str(40 * MiB), str(3 << 30), "3", "optimizer", "json", "plain", script, "--steps",
                       "6"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["memory"]["dram_peak_estimated"] is True and "stays estimated" in printed["memory"]["profiled_under"]


def test_alone_is_asked_for_under_a_limit_plain_where_its_estimate_leaves_room(tmp_path, monkeypatch):
    profile = files.load(estimated(tmp_path, peak=500 * MiB), expect=Profile)
    argv = lambda p: returned.alone_argv(p, 1 << 30, 2, "out.yaml", False, "train.py", ["--x"])  # noqa: E731
    monkeypatch.setattr(returned.process_memory, "memory_limit_bytes", lambda: None)
    assert argv(profile) is None  # --dram-budget alone: no limit to keep the fresh process under
    monkeypatch.setattr(returned.process_memory, "memory_limit_bytes", lambda: 1 << 30)
    room = returned.room_of(1 << 30)
    assert argv(profile) == [sys.executable, "-m", "hetero.profile.fresh", "out.yaml", str(1 << 30), str(1 << 30),
                             str(2 + returned.TIMED_STEPS), "optimizer", "text", "plain", "train.py", "--x"]
    profile.memory = replace(profile.memory, dram_peak_bytes=int(room / (1 + fit.DEFAULTS_SPREAD)) + 1)
    assert argv(profile)[-3:] == ["leaner", "train.py", "--x"]  # the estimate and malloc's spread fill the room
    monkeypatch.setattr(returned.alone, "to_measure", lambda p: [])
    assert argv(profile) is None  # and no leaner plan to measure
    profile.memory = replace(profile.memory, dram_peak_bytes=500 * MiB, dram_peak_estimated=False)
    assert argv(profile) is None  # measured already


def test_leaner_plans_alone_are_taken_where_plain_cannot_be_planned(tmp_path):
    memory = files.load(estimated(tmp_path), expect=Profile).memory
    returned_run, run = fresh.Run(peak_bytes=90 * MiB, step_s=1.0, steps=3), fresh.Run(80 * MiB, 1.2, 3)
    leaner = fresh.Leaner(tried=[fresh.Tried(frozenset({"in_backward"}), [None, None]),
                                 fresh.Tried(frozenset({"recompute", "in_backward"}),
                                             [run, fresh.Run(70 * MiB, 1.1, 3)])],
                          returned=returned_run, stop=200 * MiB)
    taken = fresh.alone(memory, [None, None], 200 * MiB, leaner)
    assert taken.dram_peak_estimated and taken.returned_step_s == 1.0
    assert [(r.levers, r.peak_bytes, r.step_s) for r in taken.measured_alone] == \
        [(["in_backward", "recompute"], 75 * MiB, pytest.approx(1.15))]  # the one that gave no peak is said only
    assert "updates in backward: no peak settled" in taken.profiled_under
    # plain settled under the room, but too near it for malloc's spread: both are kept
    near = fresh.Run(peak_bytes=195 * MiB, step_s=0.9, steps=3)
    assert not fresh.fits(near, 200 * MiB) and fresh.fits(fresh.Run(160 * MiB, 0.9, 3), 200 * MiB)
    taken = fresh.alone(memory, [near, near], 200 * MiB, leaner)
    assert not taken.dram_peak_estimated and taken.dram_peak_bytes == 195 * MiB
    assert [r.peak_bytes for r in taken.measured_alone] == [75 * MiB]
    assert fresh.alone(memory, [None, None], 200 * MiB).measured_alone == []
    nothing = fresh.Leaner(tried=leaner.tried[:1], returned=returned_run, stop=200 * MiB)
    taken = fresh.alone(memory, [None, None], 200 * MiB, nothing)
    assert taken.measured_alone == [] and "updates in backward: no peak settled" in taken.profiled_under
