"""Data parallel through torchrun: the launch command, routed training, failing workers, bad plans, and profiling
the links between ranks. Each spawning test starts torchrun with 2 gloo workers on loopback (~10 s here)."""

import math
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from hetero.cli.main import main
from hetero.errors import USAGE, HeteroError
from hetero.launch import launcher
from hetero.launch.launcher import ALLOW_STALE_ENV, PLAN_ENV, Torchrun, build
from hetero.launch.torchrun import first_failure
from hetero.plan import fit
from hetero.schema import files
from hetero.schema.profile import Profile
from tests.cli.test_run import net
from tests.machines import this_machine
from tests.profile import scripts
from tests.figures import figures
from tests.run.test_routing import routed_plan, summarized

DDP_TRAIN = """
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    F.cross_entropy(model(torch.randn(8, 16)), torch.randint(4, (8,))).backward()
    opt.step(); opt.zero_grad()
    if rank == 1 and len(sys.argv) > 1:
        FAIL
sys.stdout.write(f"rank {rank} argv {sys.argv[1:]}\\n")  # one write: the ranks share the terminal
dist.destroy_process_group()
"""


def rank_exit(line: str) -> tuple[int, int]:
    """The rank and exit code a `rank R exited with C` line names."""
    rank, code = re.search(r"rank (\d+) exited with (\d+)", line).groups()
    return int(rank), int(code)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files.save(routed_plan(net(), threshold=512, shard=1024, dual_sync=600), "plan.yaml")
    return tmp_path


def test_build_starts_torchrun_with_the_worker_entry_and_the_scripts_own_arguments(tmp_path):
    launch = build("train.py", ["--lr", "3"], tmp_path / "plan.yaml", allow_stale=True, torchrun=Torchrun(2))
    assert launch.command == [sys.executable, "-m", "hetero.launch.torchrun", "--nproc-per-node", "2", "--nnodes", "1",
                              "--max-restarts", "0", "--monitor-interval", "0.1", "--standalone",
                              "-m", "hetero.launch.worker", "train.py", "--lr", "3"]
    assert launch.argv == ["train.py", "--lr", "3"]  # no --local_rank: workers read LOCAL_RANK from the environment
    assert launch.env == {PLAN_ENV: str((tmp_path / "plan.yaml").resolve()), ALLOW_STALE_ENV: "1"}
    assert build("train.py", [], tmp_path / "plan.yaml").command is None  # one process: the script runs in hetero


def test_several_nodes_meet_at_a_rendezvous():
    nodes = Torchrun(4, nnodes="2", rdzv_endpoint="head:29400")
    assert nodes.argv() == ["--nproc-per-node", "4", "--nnodes", "2", "--max-restarts", "0", "--monitor-interval",
                            "0.1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400", "--rdzv-id", "hetero"]
    static = Torchrun(1, nnodes="2", master_addr="10.0.0.1", master_port=29500, node_rank=1).argv()
    assert static[-6:] == ["--master-addr", "10.0.0.1", "--master-port", "29500", "--node-rank", "1"]
    with pytest.raises(HeteroError) as e:
        Torchrun(2, nnodes="2").check()
    assert e.value.exit_code == USAGE and e.value.message.startswith("--nnodes 2")
    assert "--rdzv-endpoint" in e.value.hint  # what to add


def test_the_first_worker_to_fail_gives_the_exit_code(tmp_path):
    (tmp_path / "rank1").write_text("200 3\n")  # failed first
    (tmp_path / "rank0").write_text("300 1\n")  # then its peer lost the connection
    (tmp_path / "rank2").write_text("100 0\n")  # ended well before both
    assert first_failure(tmp_path) == 3


def test_workers_of_a_plan_returning_freed_memory_start_with_mallocs_huge_pages_asked_for(workdir, monkeypatch):
    files.save(replace(files.load("plan.yaml"), allocator=fit.allocator_plan("test")), "plan.yaml")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    started = []
    monkeypatch.setattr(launcher, "run_workers", lambda launch, *a: started.append(launch) or 0)
    assert main(["run", "--skip-profile-check", "--nproc-per-node", "2", scripts.write(workdir, DDP_TRAIN)]) == 0
    assert started[0].env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert started[0].env[PLAN_ENV] == str((workdir / "plan.yaml").resolve())


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ddp_training_runs_with_routed_sync(workdir, capfd, monkeypatch):
    script = scripts.write(workdir, DDP_TRAIN)
    temp = workdir / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # torchrun's own temp directory
    assert main(["run", "--skip-profile-check", "--nproc-per-node", "2", script]) == 0
    assert [p.name for p in temp.iterdir() if p.name.startswith("torchelastic_")] == []  # its logs went with the run
    out, err = capfd.readouterr()
    assert "rank 0 argv []" in out and "rank 1 argv []" in out
    routed = [x.removeprefix("hetero: ") for x in err.splitlines() if x.startswith("hetero: routing: ")]
    assert len(routed) == 2, err  # rank 0 reports for all
    assert summarized(routed[0]) == (["5", "2"], {"priority": ("2KiB", 2), "latency": ("1.02KiB", 3),
                                                  "bandwidth": ("4KiB", 4)})
    assert routed[1].startswith("routing: sync ") and figures(routed[1])[1:] == ["4"]  # no prediction to compare


@pytest.mark.timeout(90)
@pytest.mark.parametrize("failure, code, said", [
    ("sys.exit(3)", 3, None),
    ("raise ValueError('bad batch')", 1, "ValueError: bad batch"),  # the script's own error, on the rank's line
    ("__import__('os')._exit(9)", 9, None),  # leaves no exit file: torchrun's code
])
@pytest.mark.slow
def test_a_failing_worker_stops_every_worker_and_its_exit_code_and_error_pass_through(workdir, capfd, failure, code,
                                                                                      said):
    # Fast by construction, not by a clock: torchrun watches its workers every 0.1 s and restarts none
    # (test_build_starts_torchrun...), so rank 0, blocked in the next all-reduce, is stopped as soon as rank 1 ends.
    script = scripts.write(workdir, DDP_TRAIN.replace("FAIL", failure))
    assert main(["run", "--skip-profile-check", "--nproc-per-node", "2", script, "fail"]) == code
    err = capfd.readouterr().err
    assert "rank 0 argv" not in err
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert rank_exit(errors[0]) == (1, code) and all(rank_exit(x)[0] == 0 for x in errors[1:]), err
    assert errors[0].endswith(f": {said}") if said else errors[0].endswith(str(code)), err
    assert "ChildFailedError" not in err and "torch.distributed.elastic" not in err and "drifted" not in err


def test_a_plan_naming_a_rank_that_does_not_exist_is_refused_before_any_worker_starts(workdir, capfd):
    files.save(routed_plan(net(), bandwidth_peer=2), "plan.yaml")
    assert main(["run", "--skip-profile-check", "--nproc-per-node", "2", scripts.write(workdir, DDP_TRAIN)]) \
        == 4
    error, hint = capfd.readouterr().err.splitlines()
    assert error.startswith("error: ") and "routing.bandwidth_peer" in error and figures(error) == ["2", "2", "0", "1"]
    assert "--nproc-per-node" in hint


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_profile_with_two_workers_measures_the_link_between_them(workdir):
    script = scripts.write(workdir, scripts.LOOP.replace("model = Net()", "import torch.distributed as dist\n"
                                                         "dist.init_process_group('gloo')\n"
                                                         "model = torch.nn.parallel.DistributedDataParallel(Net())"))
    # the machine section from a file: the links between ranks are measured all the same, and the rest is not
    assert main(["profile", "--nproc-per-node", "2", "--steps", "1", "--warmup", "1", "--machine",
                 str(this_machine(workdir)), "--nvme", str(workdir), script]) == 0
    profile = files.load(workdir / "profile.yaml", expect=Profile)
    [peer] = profile.machine.peers
    assert (peer.src, peer.dst, peer.backend) == (0, 1, "gloo")
    assert [p.size_bytes for p in peer.transfer] == [4 * 2**10, 64 * 2**10, 2**20, 16 * 2**20, 64 * 2**20]
    assert all(math.isfinite(p.time_s) and p.time_s > 0 for p in peer.transfer)  # how fast: bench/routing.py
    assert profile.training.steps_measured == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_profile_with_a_failing_worker_says_which_rank_failed_and_passes_its_code(workdir, capfd):
    script = scripts.write(workdir, scripts.LOOP.replace("model = Net()", "import torch.distributed as dist\n"
                                                         "dist.init_process_group('gloo')\n"
                                                         "if dist.get_rank() == 1: sys.exit('no data for rank 1')\n"
                                                         "model = torch.nn.parallel.DistributedDataParallel(Net())"))
    assert main(["profile", "--nproc-per-node", "2", "--steps", "1", "--warmup", "1", script]) == 1
    err = capfd.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error: ")]
    assert rank_exit(errors[0]) == (1, 1) and all(rank_exit(x)[0] == 0 for x in errors[1:]), err
    assert "ChildFailedError" not in err and "torch.distributed.elastic" not in err
    assert not (workdir / "profile.yaml").exists()


def test_one_line_per_failed_rank_first_first_and_a_file_cut_short_is_skipped(tmp_path):
    from hetero.launch.torchrun import failures, report_failures, write_exit

    write_exit(tmp_path, 1, 3, "ValueError: bad\nbatch", at_ns=100)
    write_exit(tmp_path, 0, 143, "terminated by SIGTERM", at_ns=200)
    write_exit(tmp_path, 2, 9, "killed by SIGKILL", at_ns=50, replace=True)
    write_exit(tmp_path, 2, 1, "later news", at_ns=300, replace=False)  # torchrun never overwrites a worker's own
    (tmp_path / "rank3").write_text("12")  # cut short
    lines = report_failures(failures(tmp_path))
    assert [rank_exit(x) for x in lines] == [(2, 9), (1, 3), (0, 143)]  # the first to fail first
    assert [x.split(": ", 1)[1] for x in lines] == ["killed by SIGKILL", "ValueError: bad batch",  # what each wrote,
                                                    "terminated by SIGTERM"]  # on one line
    assert "rank 2" in lines[2].split(": ")[0]  # rank 0 ended after rank 2 failed, and says so


DDP_ADAMW = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=0.001)  # several buckets per step
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches: the average matters
for step in range(12):
    F.cross_entropy(model(torch.randn(8, 16, generator=data)), torch.randint(4, (8,), generator=data)).backward()
    opt.step(); opt.zero_grad()
os.makedirs(sys.argv[1], exist_ok=True)
torch.save({n: p.detach() for n, p in model.module.named_parameters()}, f"{sys.argv[1]}/rank{rank}.pt")
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def ddp_adamw(tmp_path_factory):
    """A plain DDP + AdamW script, its own profile over 2 ranks, and what plain torchrun trains."""
    work = tmp_path_factory.mktemp("ddp")
    script = scripts.write(work, DDP_ADAMW)
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "--log-dir", str(work / "torchrun-logs"), script, str(work / "plain")],
                           cwd=work, capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr
    profiled = subprocess.run([sys.executable, "-m", "hetero", "profile", "--nproc-per-node", "2", "--steps", "2",
                               "--warmup", "1", "--nvme", str(work / "disk"), "--machine", str(this_machine(work)),
                               script, str(work / "profiling")],
                              cwd=work, capture_output=True, text=True)
    assert profiled.returncode == 0, profiled.stderr
    return work, script


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("flags", [["--optimizer-device", "host"], ["--emulate", "axdimm"]], ids=["host", "emulated"])
def test_overlapped_updates_under_ddp_train_every_rank_as_plain_torchrun(ddp_adamw, flags, capfd):
    work, script = ddp_adamw
    plan = work / f"plan-{flags[-1]}.yaml"
    assert main(["plan", "-o", str(plan), "--profile", str(work / "profile.yaml"), *flags]) == 0
    assert files.load(plan).optimizer.overlap_backward  # the planner's own choice for a script that does not clip
    out = work / f"hetero-{flags[-1]}"
    assert main(["run", "--plan", str(plan), "--nproc-per-node", "2", script, str(out)]) == 0
    plain = [torch.load(work / "plain" / f"rank{r}.pt") for r in range(2)]
    ours = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for rank in range(2):
        total, reference = (sum(w.double().sum() for w in run[rank].values()) for run in (ours, plain))
        assert abs(total / reference - 1) < 1e-6, f"rank {rank}"
        for name, w in plain[rank].items():
            torch.testing.assert_close(ours[rank][name], w)
    assert all(torch.equal(ours[0][n], ours[1][n]) for n in ours[0])  # the replicas agree bit for bit
