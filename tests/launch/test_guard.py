"""hetero.launch.guard: a profile the memory limit kills, said in one line with the floor or the phase."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetero.errors import FAILURE, USAGE
from hetero.launch import guard
from hetero.profile import phases
from tests.bench.test_smoke import cgroup_unavailable

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
KILLED = 137


def reached(*lines: tuple[str, int, int]) -> guard.Reached:
    read, write = os.pipe()
    sink = guard.Phases(write)
    for line in lines:
        sink.reached(*line)
    os.close(write)
    try:
        return guard.read(read)
    finally:
        os.close(read)


def test_the_pipe_carries_each_phase_once_and_every_report_of_what_training_holds():
    got = reached((phases.RECOMPUTED, 8, 8), (phases.MOVED, 100, 100), (phases.WARMUP, 1, 2), (phases.WARMUP, 2, 2),
                  (phases.RECOMPUTED, 5, 8), (phases.MEASURED, 1, 2))
    assert got == guard.Reached(phase=phases.MEASURED, recomputed=(5, 8), moved=True)
    assert not got.least
    assert reached() == guard.Reached(phase=guard.FIRST_STEP)  # killed before the first block


def test_killed_in_training_holding_the_least_is_the_floor():
    for state in (reached(), reached((phases.RECOMPUTED, 8, 8)), reached((phases.RECOMPUTED, 8, 8),
                                                                         (phases.MOVED, 9, 9), (phases.WARMUP, 1, 1))):
        ended = guard.verdict(KILLED, 0, 1, state, 545 * MiB, "train.py")
        assert ended.exit_code == USAGE and "545MiB" in ended.message and ended.hint


def test_killed_with_blocks_run_as_written_or_after_training_names_where():
    for state in (reached((phases.RECOMPUTED, 8, 8), (phases.RECOMPUTED, 3, 8)),
                  reached((phases.MEASURED, 2, 2), ("disk beside training", 1, 4))):
        ended = guard.verdict(KILLED, 0, 1, state, 545 * MiB, "train.py")
        assert ended.exit_code == FAILURE and ended.message and ended.hint


def test_any_other_end_is_passed_on():
    assert guard.verdict(0, 0, 0, reached(), 1 << 30, "t.py") == guard.Ended(0)
    assert guard.verdict(3, 0, 0, reached(), 1 << 30, "t.py") == guard.Ended(3)
    assert guard.verdict(KILLED, 1, 1, reached(), 1 << 30, "t.py") == guard.Ended(KILLED)  # not the limit's killer
    assert guard.verdict(143, None, None, reached(), 1 << 30, "t.py") == guard.Ended(143)


def test_the_waiter_passes_on_a_signal_a_process_sent_it_and_returns_the_childs_status():
    child = os.fork()
    if child == 0:  # sleeps until a signal ends it (SIGINT's default: the exit status says so)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        time.sleep(60)
        os._exit(0)
    # blocked in every thread of this process first, as in the single-threaded waiter: only `wait` takes it
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        sender = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))  # as `kill -INT <hetero>` does
        sender.start()
        status = guard.wait(child)
        sender.join()
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before | {signal.SIGINT}  # as `wait` found it
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGINT


SCRIPT = """
import torch
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
for step in range(8):
    hog = torch.ones(96 << 20) if step == 0 else None  # 384 MiB held through the first step's backward
    loss = model(torch.ones(4, 8)).sum() + (hog.sum() * 0 if hog is not None else 0)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
@pytest.mark.skipif(cgroup_unavailable() is not None, reason="needs memory cgroups (root)")
def test_a_profile_the_limit_kills_in_its_first_step_says_the_floor_and_leaves_nothing(tmp_path):
    (tmp_path / "hog.py").write_text(SCRIPT)
    work = tmp_path / "tmp"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(work), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(REPO / "bench/cgroup.py"), "--limit", "320MiB", "--", sys.executable,
                           "-m", "hetero", "profile", "--warmup", "1", "--steps", "1", "-o",
                           str(tmp_path / "p.yaml"), str(tmp_path / "hog.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith(("error:", "hint:"))]
    assert done.returncode == USAGE, done.stderr
    assert [line.split(":")[0] for line in errors] == ["error", "hint"] and "320MiB" in errors[0]
    ran = [x for x in done.stderr.splitlines() if x.startswith("bench/cgroup.py: exit ")]
    assert len(ran) == 1 and "killed" in ran[0]  # bench/cgroup.py: the kernel's killer ended the child
    assert not (tmp_path / "p.yaml").exists()
    assert not [p for p in work.iterdir() if not p.name.startswith("torchinductor_")]
