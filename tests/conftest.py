from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CUDA_REPORTED = REPO / "tests" / "cuda_reported"  # its sitecustomize.py reports one CUDA device


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; skip them, with the reason, where there is none."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def machine_cache(tmp_path_factory):
    """`hetero profile` remembers the last machine it measured on this host in the user's cache directory: the tests
    keep theirs in a directory of the session's (each pytest worker measures the machine once, and a user's cache is
    never touched)."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(autouse=True)
def terminal_width_unset(monkeypatch):
    """Tables are as wide as `COLUMNS` says where it is set (hetero.cli.usage.console): a shell that exports it (the
    GPU image's did) must not change what the tests render. A test that wants a width sets it."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(autouse=True)
def cpu_tests_leave_cuda_alone(request):
    """A test not marked `gpu` runs on the CPU wherever CUDA exists, and never starts CUDA: a context per pytest
    process costs GPU memory and seconds, and a CPU test that reaches the GPU checks what it does not name."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    import torch

    before = torch.cuda.is_initialized()
    yield
    if not before and torch.cuda.is_initialized():
        pytest.fail("this CPU test started CUDA: keep it on the CPU (--device cpu, cuda_hidden) or mark it `gpu`")


@pytest.fixture(autouse=True)
def global_hooks_removed():
    """A test leaves no global module hook behind: one left installed (an `UnderPressure` never closed) runs on
    every later test's model in the same pytest process, and fails whichever test counts its work."""
    from torch.nn.modules import module

    kinds = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks")
    before = {k: len(getattr(module, k, {})) for k in kinds}
    yield
    left = {k: n - before[k] for k in kinds if (n := len(getattr(module, k, {}))) > before[k]}
    if left:
        pytest.fail(f"this test left global module hooks installed: {left}; close what installed them")


@pytest.fixture
def cuda_hidden(monkeypatch):
    """torch.cuda.is_available() is False for this test, for what torch itself would start CUDA for where it exists
    (torch.compile saves the CUDA RNG state; a GPU's name is asked of the GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@dataclass(frozen=True)
class CudaReported:
    real: bool  # this machine has CUDA of its own
    log: Path  # where a process that ended with CUDA initialized writes its command line


@contextlib.contextmanager
def cuda_reported_in(log: Path) -> Iterator[CudaReported]:
    """As on a GPU machine: this process and every one it starts (PYTHONPATH carries tests/cuda_reported/) are told
    one CUDA device exists. Where there is none, whatever then starts CUDA raises; where there is one, each process
    that started it is logged: either fails the test, which is to stay on the CPU."""
    import torch

    real = torch.cuda.is_available()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "device_count", lambda: 1)
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(CUDA_REPORTED), os.environ.get("PYTHONPATH")])))
        patch.setenv("HETERO_CUDA_LOG", str(log))
        yield CudaReported(real=real, log=log)
    started = log.read_text().splitlines() if log.exists() else []
    assert not started, f"these processes of a CPU test started CUDA: {started}"


@pytest.fixture
def cuda_reported(tmp_path_factory) -> Iterator[CudaReported]:
    """`cuda_reported_in` for one test: the example-script tests run so, and pass on the CPU."""
    with cuda_reported_in(tmp_path_factory.mktemp("cuda") / "started.log") as reported:
        yield reported


SMALL_GPT = [str(REPO / "examples/train_gpt.py"), "--device", "cpu", "--n-layer", "2", "--n-embd", "64", "--vocab",
             "256", "--seq-len", "32", "--steps", "50"]


@pytest.fixture(scope="session")
def profiled(tmp_path_factory) -> tuple[int, Path, Path]:
    """`hetero profile` of a small GPT, the machine measured, once a session: its exit code, its folder (profile.yaml,
    summary.txt: what it printed) and its disk tier's directory. tests/cli/test_profile.py checks it; the benches'
    smoke runs (tests/bench) give it to `--machine` rather than measure this machine once per bench."""
    import io

    from hetero.cli.main import main

    out = tmp_path_factory.mktemp("profiled")
    nvme = out / "disk"
    printed = io.StringIO()
    with cuda_reported_in(out / "cuda.log"), contextlib.redirect_stdout(printed):  # as on a GPU machine: the
        code = main(["profile", "--steps", "2", "--warmup", "1", "--nvme", str(nvme), "-o",  # example stays on
                     str(out / "profile.yaml"), *SMALL_GPT])  # the CPU it was given
    (out / "summary.txt").write_text(printed.getvalue())
    return code, out, nvme


@pytest.fixture
def bundled_machine(monkeypatch):
    """`hetero profile` takes the machine from the bundled CPU profile instead of measuring this one (tens of
    seconds, and nothing a test of the script's side looks at)."""
    from hetero.profile import machine
    from hetero.schema import files

    bundled = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml").machine
    monkeypatch.setattr(machine, "measure", lambda *args, **kwargs: bundled)


@pytest.fixture
def repo() -> Path:
    return REPO
