"""Every bench/ script runs, at a tiny size, so that none rots unseen (issue 32): each exits as documented and prints
the lines its readers look for. Nothing here is timed; the figures the benches print are not checked, only that they
are there. Scripts that need CUDA are checked for their refusal where there is none, and for what they do without it."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.machines import this_machine

NUMBER = r"[-+0-9.e]+"
# tests/bench/tiny-gpt.plan.yaml: `hetero plan --emulate axdimm` of tests/bench/tiny-gpt.profile.yaml, the profile
# of examples/train_gpt.py with these arguments (and --steps 12)
TINY_PROFILE = "tests/bench/tiny-gpt.profile.yaml"
TINY_PLAN = "tests/bench/tiny-gpt.plan.yaml"
TINY_PLAN_GPT = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--vocab", "64", "--batch-size", "2",
                 "--seq-len", "16"]
TINY_GPT = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab", "64", "--batch-size", "1",
            "--seq-len", "16"]


@dataclass(frozen=True)
class Smoke:
    script: str
    args: tuple[str, ...]
    expect: tuple[str, ...]  # regular expressions, each found in stdout + stderr
    code: int = 0
    cuda: bool = False  # run as written only with CUDA; without it `code` is the refusal's exit code
    cgroup: bool = False  # needs memory cgroups (root): without them it exits 2 with bench/cgroup.py's reason
    files: tuple[str, ...] = ()  # paths the run must leave in its folder ({tmp})


SMOKES = [
    Smoke("adam.py", ("--sizes", "10K", "--repeats", "1", "--bandwidth-size", "1M"),
          (rf"-> Adam bound {NUMBER} M params/s", rf"hetero AdamKernel +{NUMBER} +{NUMBER} +{NUMBER}%",
           rf"torch AdamW fused +{NUMBER} +1\.00")),
    Smoke("plan.py", ("--layers", "20", "--repeats", "1"),
          (rf"plan\(\) on 20 layers: best {NUMBER} s", rf"`hetero plan` on 20 layers .*best {NUMBER} s")),
    Smoke("heldout_lm.py", ("--device", "cpu", "--tied", "--width", "32", "--blocks", "1", "--heads", "2", "--vocab",
                            "64", "--batch", "1", "--context", "16", "--steps", "3", "--eval-batches", "1",
                            "--weight-sum"),
          (rf"step +3 +loss {NUMBER}", rf"eval loss {NUMBER}", rf"final loss {NUMBER}", rf"weight sum {NUMBER}",
           rf"steady {NUMBER} ms/step")),
    Smoke("checksum.py", ("{tmp}", "--rounds", "1", "--params", "2000000"),
          (rf"read +checksums on *: wall +{NUMBER} ms", rf"write checksums off: wall +{NUMBER} ms",
           rf"zlib.crc32 alone, one thread: .* = {NUMBER} GB/s")),
    Smoke("beside.py", ("--dir", "{tmp}", "--disk-mib", "1", "--update-params", "1024"),
          (rf"disk read 1MiB +│ +{NUMBER} │ +{NUMBER} │ +{NUMBER}x", r"disk write 1MiB",
           rf"AXDIMM update 1024 params +│ +{NUMBER}")),
    Smoke("allocator.py", ("examples/train_gpt.py", *TINY_GPT, "--steps", "3"),
          (r"allocator: peak RSS by phase \(MB\): start \d+", r"allocator: heap at each forward end",
           rf"allocator: per step after the second: CPU {NUMBER} ms")),
    Smoke("routing.py", ("--nproc", "2", "--steps", "1"),
          (r"2 processes, gloo, [0-9.]+ MiB of gradients",
           *(rf"{name} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}"
             for name in ("DDP", "hetero planned", "hetero split")))),
    Smoke("recorder.py", ("--plan", TINY_PLAN, "--steps", "3", "--rounds", "1", "--keep", "{tmp}", "--",
                          "examples/train_gpt.py", *TINY_PLAN_GPT),
          (rf"round 1: untraced {NUMBER} ms/step, traced {NUMBER}",
           rf"traced/untraced {NUMBER}x \(the recorder's own estimate: {NUMBER}% of step time in its hooks\)"),
          files=("run.json", "run.yaml")),
    Smoke("lanes.py", ("{recorded}/run.json", TINY_PLAN),  # the trace bench/recorder.py kept
          (r"busy ms per step", rf"compute +│ +fp +│ +{NUMBER} +│ +{NUMBER}",
           rf"axdimm ch0 +│ +adam +│ +{NUMBER} +│ +{NUMBER}")),
    Smoke("gpu_all.py", (), (r"gpu-check: no CUDA device here", ), code=2, cuda=True),
    Smoke("gpu_offload.py", ("--steps", "2"), (r"bench/gpu_offload.py needs a CUDA GPU", ), code=2, cuda=True),
    # These plan from the checked-in profile of their script (`--profile`) rather than profile it first.
    Smoke("step.py", (*TINY_PLAN_GPT, "--steps", "1", "--rounds", "1", "--profile", TINY_PROFILE),
          (rf"torch fused +{NUMBER} +{NUMBER} +1\.00x", rf"axdimm overlap +{NUMBER}", rf"host overlap +{NUMBER}")),
    Smoke("tiering.py", ("--steps", "1", "--warmup", "1", "--rounds", "1", "--min-tensor", "1KiB", "--profile",
                         TINY_PROFILE, "--", "examples/train_gpt.py", *TINY_PLAN_GPT, "--steps", "3"),
          (r"^plan: \d+ of \d+ layers evict", rf"^none +{NUMBER}s", rf"^hetero +{NUMBER}s", rf"^naive +{NUMBER}s")),
    Smoke("predict.py", ("--plan", TINY_PLAN, "--rounds", "1", "--steps", "4", "--", "examples/train_gpt.py",
                         *TINY_PLAN_GPT),
          (r"│ 1 +│ +\d+ vs \d+ │ +\d+ vs \d+ │ +\d+ vs \d+ │ +\d+ │ +0 │",
           r"│ median +│ +[-+0-9]+% │ +[-+0-9]+% │")),
    Smoke("gpu_e2e.py", ("--out", "{tmp}/e2e", "--rounds", "1", "--profile", TINY_PROFILE, "--",
                         "examples/train_gpt.py", "--device", "cpu", *TINY_PLAN_GPT, "--steps", "8", "--weight-sum"),
          (r"^plan +ok", rf"plain-0 +{NUMBER} +1\.000x", rf"hetero-0 +{NUMBER}",
           r"check: default plan's weight sum .*: equal"), files=("e2e/outcomes.json", "e2e/plan.yaml")),
    Smoke("memory.py", ("--sizes", "2x32x2x16", "--vocab", "64", "--pairs", "1", "--steps", "4", "--profile",
                        TINY_PROFILE),
          (r"plain +peak [0-9.]+[KMG]iB .* = 1\.00x", r"profile: plain peak .*: measured/profiled [0-9.]+",
           r"plan \(default\) +peak",
           r"measured/predicted [0-9.]+")),
    # This one profiles its script first, with the bundled machine section as this machine's (`hetero profile
    # --machine`; tests/machines.py) rather than measure the machine; it finds each
    # configuration's largest size but times none (`--repeats 0`: three more runs).
    Smoke("cap.py", ("--limits", "512MiB", "--n-embd", "32", "--vocab", "64", "--seq-len", "16", "--steps", "3",
                     "--repeats", "0", "--max-layers", "1", "--machine", "{machine}"),
          (r"hetero: 1 layers peak [0-9.]+[KMG]iB",
           r"final weight sums at 1 layers: plain (\S+); checkpoint \1; hetero \1$"), cgroup=True),
]
SMOKES_BY = {s.script: s for s in SMOKES}
# Over ~5 s each (`make test-fast` leaves them out); lanes.py reads recorder.py's trace, so it runs that first.
SLOW = {"cap.py", "routing.py", "tiering.py", "memory.py", "recorder.py", "lanes.py", "predict.py", "gpu_e2e.py",
        "beside.py"}


def bench(name: str, *args: str, timeout: float = 240, temp: Path | None = None) -> subprocess.CompletedProcess:
    # One intra-op thread unless asked: these sizes gain nothing from a second, and on a shared machine a second one
    # waits at every barrier for a core a neighbour holds (a width-32 step of a held-out LM: 1-2 ms alone, 5 to
    # 265 ms with two threads beside busy neighbours on the 2-core development VM).
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           **({"TMPDIR": str(temp)} if temp is not None else {})}
    return subprocess.run([sys.executable, f"bench/{name}", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cgroup_unavailable() -> str | None:
    """Why bench/cgroup.py cannot make a memory cgroup here (not root, no memory controller); None where it can."""
    spec = importlib.util.spec_from_file_location("bench_cgroup", REPO / "bench" / "cgroup.py")
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module.unavailable()


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Each smoke's run and its folder, by script: bench/lanes.py reads the trace bench/recorder.py kept."""
    return {}


def smoke_run(smoke: Smoke, runs: dict, request) -> tuple[subprocess.CompletedProcess, Path]:
    """`{tmp}` in its arguments: its own folder; `{recorded}`: bench/recorder.py's; `{machine}`: a profile whose
    machine section is this machine's (tests/machines.py)."""
    if smoke.script not in runs:
        tmp = request.getfixturevalue("tmp_path_factory").mktemp(smoke.script.removesuffix(".py"))
        given = " ".join(smoke.args)
        recorded = str(smoke_run(SMOKES_BY["recorder.py"], runs, request)[1]) if "{recorded}" in given else ""
        machine = str(this_machine(tmp)) if "{machine}" in given else ""
        args = (a.replace("{tmp}", str(tmp)).replace("{recorded}", recorded).replace("{machine}", machine)
                for a in smoke.args)
        temp = tmp / "TMPDIR"  # the bench's temp directory: it must leave nothing there
        temp.mkdir()
        runs[smoke.script] = bench(smoke.script, *args, temp=temp), tmp
    return runs[smoke.script]


@pytest.mark.parametrize("smoke", [pytest.param(s, id=s.script, marks=[pytest.mark.slow] if s.script in SLOW else [])
                                   for s in SMOKES])
def test_bench_runs_at_a_tiny_size(smoke: Smoke, runs, request):
    refused = smoke.cuda and not has_cuda()
    if smoke.cuda and not refused:
        pytest.skip("runs a GPU benchmark for minutes; `make gpu-check` runs it")
    done, tmp = smoke_run(smoke, runs, request)
    out = done.stdout + done.stderr
    reason = cgroup_unavailable() if smoke.cgroup else None
    if reason is not None:
        assert (done.returncode, done.stderr) == (2, f"bench/{smoke.script}: {reason}\n"), out[-3000:]
        return
    assert done.returncode == smoke.code, out[-3000:]
    missing = [p for p in smoke.expect if not re.search(p, out, re.MULTILINE)]
    assert missing == [], out[-3000:]
    if refused:
        assert len(done.stdout.strip().splitlines() + done.stderr.strip().splitlines()) == 1, out  # one line
        assert "Traceback" not in out
    assert [f for f in smoke.files if not (tmp / f).exists()] == []
    left = sorted(p.name for p in (tmp / "TMPDIR").iterdir() if not p.name.startswith("torchinductor_"))
    assert left == []  # nothing left behind (torch keeps its compile cache there, as it does in /tmp)


def test_every_bench_script_has_a_smoke_run():
    tested_apart = ["cgroup.py"]  # test_cgroup_keeps_a_command_under_its_limit_or_says_why_not
    assert sorted([*tested_apart, *(s.script for s in SMOKES)]) == sorted(p.name for p in (REPO / "bench").glob("*.py"))


def test_step_refuses_a_profile_of_another_model():
    done = bench("step.py", *TINY_GPT, "--profile", TINY_PROFILE)  # the profile is of TINY_PLAN_GPT's sizes
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr  # one line, naming the profile
    assert done.stderr.startswith("bench/step.py: ") and TINY_PROFILE in done.stderr


def test_gpu_all_lists_its_pieces_without_cuda():
    done = bench("gpu_all.py", "--list")
    assert done.returncode == 0, done.stderr
    pieces = [line.split(" (up to ")[0] for line in done.stdout.splitlines()]
    assert pieces == ["tests", "suite", "fits", "heldout", "offload"]


def test_gpu_offload_sizes_its_model_without_cuda(monkeypatch):
    """What bench/gpu_offload.py computes before it needs the GPU: the model's size and the script's arguments."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the module puts examples/ first
    spec = importlib.util.spec_from_file_location("gpu_offload_bench", REPO / "bench" / "gpu_offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["gpu_offload.py", "--n-embd", "64", "--n-head", "2", "--vocab", "128"])
    a = module.parse()
    one, two = module.params_of(a, 1), module.params_of(a, 2)
    block = two - one
    assert block == 12 * 64 * 64 + 13 * 64  # a GPT block: qkv, proj, 4x MLP weights and biases, two LayerNorms
    assert one > block  # plus the embeddings and the final norm
    assert "--n-embd" in module.script_args(a, 3)


def test_cgroup_keeps_a_command_under_its_limit_or_says_why_not():
    """bench/cgroup.py (which cap.py and memory.py run every process through): as root with a memory controller, a
    command under the limit exits as itself with its peak said, and one over it is killed; otherwise exit 2, one
    line."""
    grow = "b = bytearray({} * 2**20); b[::4096] = b'x' * len(b[::4096])"
    fits = bench("cgroup.py", "--limit", "256MiB", "--", sys.executable, "-c", grow.format(64), timeout=60)
    if fits.returncode == 2:
        assert fits.stderr.startswith("bench/cgroup.py: ") and fits.stderr.count("\n") == 1, fits.stderr
        return
    assert fits.returncode == 0, fits.stderr
    peak = re.search(r"exit 0, peak ([0-9.]+)MiB of 256MiB", fits.stderr)
    assert peak and float(peak.group(1)) >= 64, fits.stderr
    over = bench("cgroup.py", "--limit", "64MiB", "--", sys.executable, "-c", grow.format(256), timeout=60)
    assert over.returncode == 137, over.stderr
    assert re.search(r"exit 137\b.*killed", over.stderr), over.stderr  # the kernel's killer, said


def test_gpu_e2e_says_whether_plain_differs_from_itself_when_the_default_plan_differs(capsys, monkeypatch):
    """A CUDA backward that is not deterministic makes plain's own runs differ: bench/gpu_e2e.py's weight check
    says so, rather than a bare `differ` that reads as hetero's fault."""
    spec = importlib.util.spec_from_file_location("gpu_e2e_bench", REPO / "bench" / "gpu_e2e.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)

    def run(name: str, weights: float):
        return module.Outcome(name, True, 1.0, 10.0, 1.0, weights, 1, 1, None)

    plain, other = run("plain-0", 1.0), run("hetero-0", 2.0)
    for rows, said in (([plain, other], "not known"),  # one plain run: nothing to tell noise by
                       ([plain, other, run("plain-1", 1.0)], "not plain's"),  # plain repeats itself: hetero differs
                       ([plain, other, run("plain-1", 3.0)], "differ too"),  # plain's own runs differ: noise
                       ([plain, run("hetero-0", 1.0)], ": equal")):
        module.checks(rows, {}, 10.0)
        assert said in capsys.readouterr().out
