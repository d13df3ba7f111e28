"""A sweep never deletes a live run's directory, whatever PID namespace the run lives in (issue 33, item 1): every
work directory is locked (flock) by its owner from before it has a name the sweep matches, and the sweep takes that
lock, without waiting, before it deletes anything. A killed run's directory is swept by the next start, which says
so in one line (item 4)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.run.devices import workdir
from hetero.schema import files
from tests.cli.test_run import net
from tests.cli.test_run_tiering import TRAIN
from tests.faults.test_signals import REPO, left, start, wait_evicted
from tests.profile import scripts
from tests.run.test_tiering import tiering_plan

# A run's work directory, held as a run holds it, until its stdin closes.
OWNER = ("import sys; from hetero.run.devices import workdir\n"
         "work = workdir.create(sys.argv[1], 'states', 'optimizer.nvme.path')\n"
         "print(work.path, flush=True); sys.stdin.read(); work.remove()")
SWEEP = ("import sys, pathlib; from hetero.run.devices import workdir\n"
         "print(len(workdir.sweep(pathlib.Path(sys.argv[1]))))")


def owner(base: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(base)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    path = Path(proc.stdout.readline().strip())
    (path / "hetero-1-2-0.bin").write_bytes(b"state" * 100)  # what the run keeps there
    return proc, path


def unshare_works() -> bool:
    if os.getuid() != 0 or shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not unshare_works(), reason="needs root and unshare --pid (a new PID namespace)")
def test_a_sweep_in_another_pid_namespace_keeps_a_live_runs_directory(tmp_path):
    proc, path = owner(tmp_path)
    try:
        # In a new PID namespace with its own /proc, the owner's pid names no process: kill(pid, 0) says "gone".
        swept = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", SWEEP,
                                str(tmp_path)], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
        assert swept.returncode == 0, swept.stderr
        assert swept.stdout.strip() == "0" and (path / "hetero-1-2-0.bin").exists()
    finally:
        proc.communicate("")
    assert proc.returncode == 0 and os.listdir(tmp_path) == []


def test_an_owner_whose_pid_the_sweep_cannot_see_keeps_its_directory_until_it_ends(tmp_path, monkeypatch):
    """The same without root: a live owner whose pid this process takes for a dead one (as in another namespace)."""
    proc, path = owner(tmp_path)
    monkeypatch.setattr(workdir, "alive", lambda pid: False)
    try:
        assert workdir.sweep(tmp_path) == [] and (path / "hetero-1-2-0.bin").exists()
    finally:
        proc.stdin.close()  # the owner removes its directory and ends
        proc.wait()
    # Killed instead, its lock goes with it: the next sweep removes what it left.
    proc, path = owner(tmp_path)
    proc.kill()
    proc.wait()
    assert workdir.sweep(tmp_path) == [path] and os.listdir(tmp_path) == []


@pytest.fixture
def tiered(tmp_path, monkeypatch):
    """A plan evicting every layer's activations to tmp_path/nvme, in the current directory."""
    monkeypatch.chdir(tmp_path)
    files.save(tiering_plan(net(), str(tmp_path / "nvme"), 1 << 20), "plan.yaml")
    return tmp_path


@pytest.mark.timeout(120)
def test_the_next_start_sweeps_a_killed_run_and_says_so_in_one_line(tiered, capfd):
    script = scripts.write(tiered, TRAIN)
    proc = start(tiered, "run", "--skip-profile-check", script, "50", "wait")
    wait_evicted(tiered)
    proc.kill()  # what a memory cgroup does to a run over its limit
    proc.communicate(timeout=60)
    assert left(tiered)
    assert main(["run", "--skip-profile-check", script, "2", "plain"]) == 0
    said = [x for x in capfd.readouterr().err.splitlines() if f"pid {proc.pid}" in x]
    assert len(said) == 1 and str(tiered / "nvme") in said[0], said
    assert left(tiered) == []
