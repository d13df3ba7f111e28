"""`make gpu-check` (bench/gpu_all.py) on a machine without a GPU, or whose Python has no torch: it refuses to run
or write, in one line (and its hint); its pieces' command lines are accepted by the benchmarks they call; the
runner records success, failure and time-outs with their output; and the results file keeps what it had around the
section it replaces."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_all", REPO / "bench" / "gpu_all.py")
gpu_all = sys.modules["gpu_all"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(gpu_all)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_nothing_runs_and_nothing_is_written(tmp_path, capsys):
    out = tmp_path / "gpu-results.md"
    assert gpu_all.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == gpu_all.NO_CUDA and err.count("\n") == 1
    assert not out.exists()


def test_without_torch_it_refuses_in_one_line_with_a_hint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "gpu-results.md"
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError, as where none is installed
    assert gpu_all.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [x.split(": ")[0] for x in err] == ["error", "hint"] and not out.exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_with_a_python_without_torch_refuses_without_a_traceback():
    # -S: no site-packages, so this very Python has no torch (were it to have one, the check itself would run)
    if subprocess.run([sys.executable, "-S", "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("torch is importable without site-packages")
    done = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={sys.executable} -S"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    said = [x for x in done.stderr.splitlines() if not x.startswith("make")]
    assert done.returncode == 2 and [x.split(": ")[0] for x in said] == ["error", "hint"], done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_every_piece_fits_a_device_call_and_its_benchmarks_accept_their_arguments(tmp_path):
    pieces = gpu_all.pieces(sys.executable, tmp_path)
    assert [p.name for p in pieces] == ["tests", "suite", "fits", "heldout", "offload"]
    assert sum(p.limit_s for p in pieces) <= gpu_all.TOTAL_S == 510  # 8.5 minutes on one H100
    for piece in pieces:
        for command in piece.commands:
            if command[1].startswith("bench/"):
                assert (REPO / command[1]).exists()
                cut = command.index("--") if "--" in command else len(command)
                done = subprocess.run([*command[:cut], "--help"], cwd=REPO, capture_output=True, text=True,
                                      timeout=120)
                assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


def test_the_runner_records_each_outcome_with_its_output():
    python = sys.executable
    ok = gpu_all.run_piece(gpu_all.Piece("ok", "ok", ((python, "-c", "print('| a | b |')"),
                                                      (python, "-c", "print('second')"))))
    assert ok.status == "ok" and "| a | b |" in ok.output and "second" in ok.output and "$ python -c" in ok.output
    failed = gpu_all.run_piece(gpu_all.Piece("bad", "bad", ((python, "-c", "import sys; print('why'); sys.exit(3)"),
                                                            (python, "-c", "print('never')"))))
    assert failed.status == "failed (exit 3)" and "why" in failed.output and "never" not in failed.output
    slow = gpu_all.run_piece(gpu_all.Piece("slow", "slow", ((python, "-c", "import time; time.sleep(30)"),),
                                           limit_s=1))
    assert slow.status == "timed out after 1 s"


def test_the_results_file_keeps_its_text_and_replaces_the_last_section(tmp_path, cuda_hidden):
    path = tmp_path / "gpu-results.md"
    head = "# GPU results\n\nHow to run it.\n"  # the user's, above the generated section
    path.write_text(head)
    env = gpu_all.environment()  # asking a GPU its name starts CUDA: this test stays on the CPU
    assert env["device"] == "none (no CUDA device)"
    assert env["torch"] == torch.__version__ and set(env) == {"device", "driver", "torch", "CUDA (torch's)", "date"}
    piece = gpu_all.Piece("ok", "A table", ((sys.executable, "-c", "print(1)"),))
    first = gpu_all.Outcome(piece, "ok", 1.0, "first ```table```")
    gpu_all.write(path, gpu_all.section(env, [first]))
    gpu_all.write(path, gpu_all.section(env, [gpu_all.Outcome(piece, "ok", 2.0, "second")]))
    text = path.read_text()
    assert text.startswith(head)
    assert text.count(gpu_all.BEGIN) == 1 and "second" in text and "first" not in text
    assert f"| torch | {torch.__version__} |" in text and "### A table" in text and "`ok`: ok, 2 s" in text


def test_failing_tests_are_named_from_the_summary_and_from_each_outcome_as_it_ends():
    output = ("[gw3] [ 12%] FAILED tests/a.py::test_b\n[gw1] [ 13%] PASSED tests/a.py::test_c\n"
              "FAILED tests/a.py::test_b - AssertionError\nERROR tests/c.py::test_d[1] - OSError\n")
    assert gpu_all.failing(output) == ["tests/a.py::test_b", "tests/c.py::test_d[1]"]
