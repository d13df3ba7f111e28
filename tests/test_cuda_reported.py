"""The CUDA-reported patch (tests/cuda_reported/, conftest's `cuda_reported`) that the example-script tests run under:
it reaches every process they start, and it bites, so that those tests passing means they stayed on the CPU."""

import subprocess
import sys

from tests.conftest import REPO

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab", "64", "--seq-len", "8", "--batch-size", "2",
        "--steps", "1"]


def test_every_process_started_is_told_of_one_cuda_device(cuda_reported):
    grandchild = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}], check=True)"
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "1"]


def test_the_example_follows_what_it_is_told_unless_given_the_cpu(cuda_reported):
    example = [sys.executable, str(REPO / "examples/train_gpt.py"), *TINY]
    on_cpu = subprocess.run([*example, "--device", "cpu"], capture_output=True, text=True)
    assert on_cpu.returncode == 0 and "parameters on cpu" in on_cpu.stdout, on_cpu.stderr
    if not cuda_reported.real:  # where there is a GPU, the default would start CUDA: only the CPU run is made there
        default = subprocess.run(example, capture_output=True, text=True)
        assert default.returncode != 0 and "CUDA" in default.stderr.splitlines()[-1], default.stderr  # torch's error
