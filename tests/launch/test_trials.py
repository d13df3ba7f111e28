"""`hetero plan` under a binding DRAM budget runs the plan it chooses in fresh processes before writing it: they
run the script as `hetero run` would, stop themselves at the budget, and what they measured is the plan's record
(`budget.trials`) and its prediction; a script that fails under the plan is said in one line; a `hetero plan` killed
mid-trial takes its processes with it, and the next start sweeps their directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.errors import FAILURE
from hetero.launch import trials
from hetero.plan.policy import MemoryPolicy
from hetero.plan.solve import PlanOptions, plan
from hetero.profile.profiler import ProfileOptions, assemble, measure_script
from hetero.run.devices import workdir
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from tests.conftest import REPO
from tests.faults.test_signals import gone
from tests.profile import scripts
from tests.waits import until

MiB = 2**20
TWO = MemoryPolicy(trial_processes=2)


@pytest.fixture
def profiled(tmp_path, monkeypatch) -> Path:
    """A tiny script's profile on the bundled machine, its arguments recorded."""
    monkeypatch.chdir(tmp_path)
    script = scripts.write(tmp_path, scripts.LOOP)
    run = measure_script(script, ["--steps", "40"], ProfileOptions(steps=2, warmup=1))
    machine = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile).machine
    files.save(assemble(run, machine), tmp_path / "profile.yaml")
    return tmp_path / "profile.yaml"


@pytest.mark.slow
def test_a_trial_measures_each_process_and_a_budget_too_small_stops_them(profiled):
    profile = files.load(profiled, expect=Profile)
    assert profile.model.args == ["--steps", "40"] and profile.model.cwd == str(profiled.parent)
    chosen = plan(profile, PlanOptions(dram_budget_bytes=4096 * MiB))
    command = trials.Command.of(profile)
    measured = trials.measure(chosen, frozenset(), 1, command, 4096 * MiB, TWO)
    assert measured.stopped == 0 and len(measured.peaks_bytes) == 2 and min(measured.peaks_bytes) > 50 * MiB
    assert 0 < measured.mapped_bytes < 200 * MiB and measured.step_s > 0 and measured.step_range_s >= 0
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"hetero-trial-{os.getpid()}-*"))
    small = trials.measure(chosen, frozenset(), 1, command, 40 * MiB, TWO)  # under what torch alone holds
    assert small.stopped == 2 and small.peaks_bytes == [] and small.step_s is None


@pytest.mark.slow
def test_hetero_plan_under_a_budget_runs_the_plan_it_chooses_and_records_what_it_measured(profiled, capfd,
                                                                                          monkeypatch):
    monkeypatch.setattr(trials, "POLICY", TWO)
    assert main(["plan", "--dram-budget", "4GiB"]) == 0
    written = files.load(profiled.parent / "plan.yaml", expect=Plan)
    (measured,) = written.budget.trials
    assert measured.levers == [] and len(measured.peaks_bytes) == 2
    assert written.predicted.iteration_s == measured.step_s
    assert written.predicted.peak_bytes["dram"] == TWO.held_bytes(measured)
    said = [x for x in capfd.readouterr().err.splitlines() if x.startswith("hetero plan: measuring")]
    assert len(said) == 1 and "plain" in said[0]  # what it runs, said as it starts
    assert main(["plan"]) == 0  # no budget: nothing run
    assert files.load(profiled.parent / "plan.yaml", expect=Plan).budget.trials == []


@pytest.mark.slow
def test_a_script_that_fails_under_the_plan_is_said_in_one_line(profiled):
    profile = files.load(profiled, expect=Profile)
    profile.model.args = ["--steps", "not-a-number"]
    with pytest.raises(Exception) as e:
        trials.plan(profile, PlanOptions(dram_budget_bytes=4096 * MiB), lambda line: None, TWO)
    assert e.value.exit_code == FAILURE and "\n" not in e.value.message and "invalid int value" in e.value.message


def test_an_older_profile_without_arguments_is_planned_as_predicted_and_says_so(profiled):
    profile = files.load(profiled, expect=Profile)
    profile.model.args = None
    said = []
    out = trials.plan(profile, PlanOptions(dram_budget_bytes=4096 * MiB), said.append, TWO)
    assert out.budget.trials == [] and len(said) == 1


# The trial step on its own, in a process we can kill: its first trial process runs a script that says its pid, then
# would train for a minute.
PLANNING = ("import sys; from hetero.launch import trials; from hetero.plan.policy import MemoryPolicy; "
            "from hetero.plan.solve import PlanOptions, plan; from hetero.schema import files; "
            "from hetero.schema.profile import Profile; p = files.load(sys.argv[1], expect=Profile); "
            "trials.measure(plan(p, PlanOptions(dram_budget_bytes=4 << 30)), frozenset(), 1, trials.Command.of(p), "
            "4 << 30, MemoryPolicy(trial_processes=1))")
SLEEPER = "import os, sys, time\nopen(sys.argv[0] + '.pid', 'w').write(str(os.getpid()))\ntime.sleep(60)\n"


@pytest.mark.timeout(120)
def test_a_killed_hetero_plan_takes_its_trial_with_it_and_the_next_start_sweeps_its_directory(profiled, tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir(mode=0o700)
    sleeper = tmp_path / "train.py"
    profile = files.load(profiled, expect=Profile)
    files.save(replace(profile, model=replace(profile.model, script=str(sleeper))), profiled)
    sleeper.write_text(SLEEPER)
    planning = subprocess.Popen([sys.executable, "-c", PLANNING, str(profiled)],
                                env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(temp)})
    try:
        pid_file = Path(f"{sleeper}.pid")
        until(lambda: pid_file.exists() and pid_file.read_text())
        child = int(pid_file.read_text())
        (left,) = temp.iterdir()
        assert left.name.startswith(f"hetero-trial-{planning.pid}-{workdir.host()}-")
    finally:
        planning.send_signal(signal.SIGKILL)  # as a memory cgroup kills: nothing runs after it
        planning.wait()
    until(lambda: gone(child))  # the parent-death signal ends it, not its minute of training
    line = workdir.sweep_earlier([str(temp)])
    assert line is not None and f"pid {planning.pid}" in line and str(temp) in line
    assert os.listdir(temp) == []



GROWING_THEN_READING = """
import mmap, sys
torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
held = []
for step in range(8):
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(8, 16)), torch.randint(4, (8,))).backward()
    opt.step()
    held.append(torch.ones(1 << 20))  # the peak rises every step: a trial process runs the script to its end
with open(sys.argv[0] + ".data", "rb") as f:
    sys.kept = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # mapped beyond the script, as code it ran is
print("read after training", sum(sys.kept[i] for i in range(0, len(sys.kept), 4096)))
"""


@pytest.mark.slow
def test_file_pages_are_counted_in_the_steps_not_after_the_script_trains(tmp_path, monkeypatch):
    """A process that runs the script to its end (its peak never settles) counts the file pages its steps used, not
    those the script reads after its last step."""
    monkeypatch.chdir(tmp_path)
    script = scripts.write(tmp_path, GROWING_THEN_READING)
    Path(script + ".data").write_bytes(os.urandom(96 * MiB))
    run = measure_script(script, [], ProfileOptions(steps=2, warmup=1))
    machine = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile).machine
    profile = assemble(run, machine)
    chosen = plan(profile, PlanOptions(dram_budget_bytes=4096 * MiB))
    measured = trials.measure(chosen, frozenset(), 1, trials.Command.of(profile), 4096 * MiB, TWO)
    assert measured.stopped == 0 and len(measured.peaks_bytes) == 2 and measured.step_s > 0
    assert 0 < measured.mapped_bytes < 64 * MiB
    assert measured.system_s >= 0 and measured.mmap_threshold_bytes is None  # plain training: malloc's defaults


def test_a_trial_process_keeps_the_least_file_pages_any_step_used(monkeypatch):
    """A page another process touches counts as referenced in every process that maps it: each step after the
    warm-up is a window of its own (cleared at its start, read at its end), and the least step is the script's."""
    from hetero.run import process_memory

    readings, cleared = iter([50 * MiB, 9 * MiB, 80 * MiB]), []
    monkeypatch.setattr(process_memory, "charged_beside_bytes", lambda: next(readings))
    monkeypatch.setattr(process_memory, "clear_referenced", lambda: cleared.append(True))
    monkeypatch.setattr(process_memory, "dram_peak_bytes", lambda: 64 * MiB * (1 + len(cleared)))  # still rising
    steps = trials.Steps(warmup=1, policy=MemoryPolicy(max_steps=99))
    for _ in range(4):
        steps.ended()
    assert steps.beside_bytes == 9 * MiB and len(cleared) == 4  # cleared after the warm-up and after every reading
    assert steps.system_s(2) >= 0 and steps.step_s(2) > 0
