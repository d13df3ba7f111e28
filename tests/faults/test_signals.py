"""Signals: SIGINT, SIGTERM and SIGHUP mid-eviction end a run with 130, 143, 129 and no file left; a SIGKILLed run's
files are swept by the next run; an interrupt landing in a finalizer is not lost; data-parallel workers are stopped
with hetero and die with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetero import interrupts
from hetero.cli.main import main
from hetero.errors import Interrupted
from hetero.run.devices.workdir import host
from hetero.schema import files
from tests.cli.test_run import net
from tests.cli.test_run_ddp import DDP_TRAIN
from tests.cli.test_run_tiering import TRAIN, workdir  # noqa: F401  (workdir: a fixture)
from tests.profile import scripts
from tests.run.test_routing import routed_plan
from tests.waits import until

REPO = Path(__file__).resolve().parents[2]



def start(workdir: Path, *args: str) -> subprocess.Popen:
    """`hetero ARGS` in a process of its own, once the script printed READY (evicted files are on disk then)."""
    proc = subprocess.Popen([sys.executable, "-m", "hetero", *args], cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    for line in proc.stdout:
        if line.startswith("READY"):
            return proc
    proc.wait()
    raise AssertionError(f"the script never got ready: {proc.stderr.read()}")


def wait_evicted(workdir: Path) -> None:
    """Until evicted activations are in files (the writer has run)."""
    until(lambda: any(name.endswith(".bin") for name in left(workdir)))


def left(workdir: Path) -> list[str]:
    nvme = workdir / "nvme"
    return [str(p.relative_to(nvme)) for p in nvme.rglob("*")] if nvme.exists() else []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "SIGTERM"),
                                             (signal.SIGHUP, 129, "SIGHUP")])
@pytest.mark.slow
def test_a_signal_mid_eviction_cleans_up_and_exits_with_its_code(workdir, sig, code, said):
    proc = start(workdir, "run", "--skip-profile-check", scripts.write(workdir, TRAIN), "50", "wait")
    wait_evicted(workdir)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    last = err.rstrip().splitlines()[-1]  # one error line, last, naming the signal
    assert last.startswith("error: ") and said in last and "Traceback" not in err
    assert left(workdir) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_runs_files_are_swept_by_the_next_run(workdir):
    script = scripts.write(workdir, TRAIN)
    proc = start(workdir, "run", "--skip-profile-check", script, "50", "wait")
    wait_evicted(workdir)
    proc.kill()
    proc.communicate(timeout=60)
    (stale,) = (workdir / "nvme").iterdir()
    assert stale.name.startswith(f"hetero-activations-{proc.pid}-{host()}-") and any(stale.iterdir())
    assert main(["run", "--skip-profile-check", script, "4", "plain"]) == 0
    assert left(workdir) == []


def test_an_interrupt_in_a_finalizer_is_delivered_after_it_not_lost():
    class Record:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the finalizer
            self.after = sum(range(1000))  # Python would ignore an exception raised at this point

    with interrupts.handled():
        with pytest.raises(Interrupted) as e:
            record = Record()
            del record
            time.sleep(60)  # the signal comes again, outside the finalizer, and ends this at once
    assert e.value.signum == signal.SIGINT and interrupts.exit_code() == 130


def test_a_script_that_swallows_the_interrupt_still_ends_with_130(workdir, capfd):
    script = scripts.write(workdir, """
import os, signal, time
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)
except BaseException:
    pass
print("carried on")
""")
    assert main(["run", "--skip-profile-check", script]) == 130
    out, err = capfd.readouterr()
    assert "carried on" in out and err.rstrip().splitlines()[-1].startswith("error: ")


# Each worker says its pid in one write (the ranks share stdout), then waits; rank 0 says when both have.
DDP_WAIT = DDP_TRAIN.replace("dist.init_process_group(\"gloo\")", "dist.init_process_group(\"gloo\")\nimport os, time\n"
                             "os.write(1, f'PID {os.getpid()}\\n'.encode())\ndist.barrier()\n"
                             "if dist.get_rank() == 0: os.write(1, b'READY\\n')\ntime.sleep(120)")


def pids(out: str) -> list[int]:
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith("PID ")]


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def start_ddp(workdir: Path) -> tuple[subprocess.Popen, list[int]]:
    files.save(routed_plan(net(), threshold=512, shard=1024, dual_sync=600), "plan.yaml")
    script = scripts.write(workdir, DDP_WAIT)
    proc = subprocess.Popen([sys.executable, "-m", "hetero", "run", "--skip-profile-check", "--nproc-per-node", "2",
                             script],
                            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("READY"):
            break
    workers = pids("".join(seen))
    assert len(workers) == 2, seen
    return proc, workers


def wait_gone(workers: list[int], why: str) -> None:
    """Until every worker has ended: within a minute (they would sleep two), else fail naming those alive."""
    alive = lambda: [pid for pid in workers if not gone(pid)]
    until(lambda: not alive(), within=60, what=lambda: f"workers {alive()} of {workers} still run {why}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_to_hetero_stops_torchrun_and_every_worker(workdir):
    proc, workers = start_ddp(workdir)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    last = err.rstrip().splitlines()[-1]
    assert last.startswith("error: ") and "SIGTERM" in last
    wait_gone(workers, "after hetero ended on SIGTERM")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_die_with_a_killed_hetero(workdir):
    proc, workers = start_ddp(workdir)
    proc.kill()
    proc.wait(timeout=60)  # hetero itself; the workers hold its stdout open while they live
    try:
        wait_gone(workers, "after hetero was killed")
    except AssertionError:
        for pid in (pid for pid in workers if not gone(pid)):  # the survivors go now, not in two minutes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
    finally:
        proc.communicate(timeout=60)


def test_a_second_signal_lets_the_cleanup_finish_and_a_third_forces_the_exit():
    cleaned = []
    with interrupts.handled():
        with pytest.raises(Interrupted) as third:
            try:
                signal.raise_signal(signal.SIGTERM)
                time.sleep(60)
            except Interrupted:
                signal.raise_signal(signal.SIGINT)  # impatient: absorbed, the cleanup goes on
                cleaned.append(True)
                signal.raise_signal(signal.SIGINT)  # a cleanup that hangs can still be stopped
                time.sleep(60)
    assert cleaned == [True] and third.value.signum == signal.SIGINT
    assert interrupts.exit_code() == 143  # the first signal decides the exit code
