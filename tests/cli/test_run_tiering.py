"""`hetero run` with an `activations` schedule: the summary it prints, and an NVMe directory left empty after a normal
end, an exception in the script and Ctrl-C."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero import files
from hetero.cli.main import main
from tests.cli.test_run import net
from tests.profile import scripts
from tests.run.test_tiering import tiering_plan

TRAIN = """
import os, signal, time
torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(int(sys.argv[1])):
    loss = F.cross_entropy(model(torch.randn(64, 16)), torch.randint(4, (64,)))
    if step == 2 and sys.argv[2] == "raise":
        raise ValueError("bad batch")
    if step == 2 and sys.argv[2] == "sigint":
        time.sleep(0.5)  # evicted activations are in files now
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    loss.backward()
    opt.step(); opt.zero_grad()
print("done", step + 1)
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files.save(tiering_plan(net(), str(tmp_path / "nvme"), 1 << 20), "plan.yaml")
    return tmp_path


def no_files(workdir: Path) -> bool:
    return not (workdir / "nvme").exists() or os.listdir(workdir / "nvme") == []


def test_prints_the_saved_bytes_with_and_without_tiering(workdir, capfd):
    assert main(["run", scripts.write(workdir, TRAIN), "5", "plain"]) == 0
    out, err = capfd.readouterr()
    assert "done 5" in out
    assert "hetero: dram saved activations: average " in err and " with tiering" in err
    assert " evictions to nvme0 (" in err and "late prefetch" in err
    assert no_files(workdir)


def test_an_exception_in_the_script_leaves_no_file(workdir, capfd):
    assert main(["run", scripts.write(workdir, TRAIN), "5", "raise"]) == 1
    assert "ValueError: bad batch" in capfd.readouterr().err
    assert no_files(workdir)


def test_ctrl_c_exits_130_and_leaves_no_file(workdir):
    script = scripts.write(workdir, TRAIN)
    result = subprocess.run([sys.executable, "-m", "hetero", "run", script, "50", "sigint"], cwd=workdir,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert result.returncode == 130, result.stderr
    assert result.stderr.rstrip().endswith("error: interrupted")
    assert no_files(workdir)
