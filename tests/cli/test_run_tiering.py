"""`hetero run` with an `activations` schedule: the summary it prints, the schedule `hetero plan --tier-activations`
wrote carried out, and an NVMe directory left empty after a normal end, an exception in the script and Ctrl-C."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.harness.script import run_script
from hetero.run.runtime import Runtime
from hetero.run.tiering import ACTIVATIONS, ActivationTiering
from hetero.schema import files
from tests.cli.test_run import net
from tests.profile import scripts
from tests.run.test_tiering import tiering_plan
from tests.scripts import harness

TRAIN = """
import os, signal, time
torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(int(sys.argv[1])):
    loss = F.cross_entropy(model(torch.randn(64, 16)), torch.randint(4, (64,)))
    if step == 2 and sys.argv[2] == "raise":
        raise ValueError("bad batch")
    if step == 2 and sys.argv[2] == "wait":
        print("READY", flush=True)  # mid-step: this step's evictions are queued or written
        time.sleep(120)
    if step == 2 and sys.argv[2] == "sigint":
        time.sleep(0.5)  # evicted activations are in files now
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    if sys.argv[2] == "plain":
        time.sleep(0.2)  # the writer writes this step's evictions before backward starts and calls off the rest
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
    assert main(["run", "--skip-profile-check", scripts.write(workdir, TRAIN), "5", "plain"]) == 0
    out, err = capfd.readouterr()
    assert "done 5" in out
    saved = next(x for x in err.splitlines() if x.startswith(f"hetero: dram {ACTIVATIONS}: "))
    assert len(re.findall(r"[0-9.]+[KMG]?i?B\b", saved)) == 4  # average and peak, without tiering and with it
    evictions = re.search(r"(\d+) evictions to nvme0", err)
    assert evictions and int(evictions[1]) > 0 and "late prefetch" in err
    assert no_files(workdir)


def test_an_exception_in_the_script_leaves_no_file(workdir, capfd):
    assert main(["run", "--skip-profile-check", scripts.write(workdir, TRAIN), "5", "raise"]) == 1
    assert "ValueError: bad batch" in capfd.readouterr().err
    assert no_files(workdir)


@pytest.mark.slow
def test_ctrl_c_exits_130_and_leaves_no_file(workdir):
    script = scripts.write(workdir, TRAIN)
    result = subprocess.run([sys.executable, "-m", "hetero", "run", "--skip-profile-check", script, "50", "sigint"],
                            cwd=workdir,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert result.returncode == 130, result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("error: ")
    assert no_files(workdir)


@pytest.mark.parametrize("section, key", [("activations", "slow_path"), ("optimizer", "path")])
def test_a_plan_directory_that_cannot_be_used_is_exit_3_at_its_line(tmp_path, monkeypatch, capfd, section, key):
    from tests.cli.test_run import TRAIN as OPTIMIZER_TRAIN
    from tests.run.plans import optimizer_plan

    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "sub")
    plan = (tiering_plan(net(), bad, 1 << 20) if section == "activations"
            else optimizer_plan(net(), nvme=("head.weight",), nvme_path=bad))
    files.save(plan, "plan.yaml")
    line = next(i for i, text in enumerate(Path("plan.yaml").read_text().splitlines(), 1) if f"{key}: {bad}" in text)
    script = scripts.write(tmp_path, TRAIN if section == "activations" else OPTIMIZER_TRAIN)
    assert main(["run", "--skip-profile-check", script, "3", "plain"]) == 3
    err = [x for x in capfd.readouterr().err.splitlines() if not x.startswith("hetero: warning")]
    assert err[0].startswith(f"error: plan.yaml:{line}: ") and "not a directory" in err[0].lower(), err
    assert err[1].startswith("hint: ") and "--nvme" not in err[1]  # a plan's path is fixed in the plan
    assert sorted(os.listdir(tmp_path)) == ["file", "plan.yaml", "train.py"]


@pytest.mark.parametrize("path", ['""', '"  "'])
def test_an_empty_directory_in_a_plan_is_refused_by_check(tmp_path, capfd, path):
    plan = tmp_path / "plan.yaml"
    files.save(tiering_plan(net(), "x", 1 << 20), plan)
    plan.write_text(plan.read_text().replace("slow_path: x", f"slow_path: {path}"))
    assert main(["check", str(plan)]) == 3
    assert "activations.slow_path: " in capfd.readouterr().err


@pytest.mark.parametrize("args", [(), ("fp32", "workers=0"), ("scaled", "workers=0")],
                         ids=["bf16-workers", "fp32", "model-is-a-layer"])
@pytest.mark.slow
def test_a_conv_script_evicts_every_byte_its_plan_schedules(tmp_path, monkeypatch, capfd, args):
    """Two Conv2d, each followed by a functional ReLU and max-pool, a DataLoader, AdamW under OneCycleLR: the large
    storages of conv1's step (its ReLU's output and the pool's indices) are saved after conv1's forward ended, by
    the model's forward (a layer itself where it has a parameter of its own)."""
    monkeypatch.chdir(tmp_path)
    profile = harness.profile("conv_onecycle", tmp_path, args=args)
    plan = harness.plan(profile, "--tier-activations")
    scheduled = {e.layer: e.evict_bytes for e in plan.activations.schedule if e.evict_bytes}
    assert scheduled, plan.activations.schedule  # a machine much faster than this one may leave no idle time
    reference = harness.plain("conv_onecycle", tmp_path / "plain.pt", args)
    code, result = harness.run("conv_onecycle", tmp_path / "plan.yaml", tmp_path / "planned.pt", args=args)
    assert code == 0, capfd.readouterr().err
    harness.assert_trains_as_plain(result, reference)
    assert " evictions to nvme0 (" in capfd.readouterr().err
    with Runtime(plan, script=harness.script("conv_onecycle")) as runtime:  # what `hetero run` does, ledger in hand
        assert run_script(harness.script("conv_onecycle"), [str(tmp_path / "again.pt"), harness.STEPS, *args]) \
            .exit_code == 0
    queued = runtime.find(ActivationTiering).ledger.report().queued
    assert queued == {layer: nbytes * int(harness.STEPS) for layer, nbytes in scheduled.items()}


def test_an_lstm_saved_whole_at_each_epochs_end_trains_as_plain_under_tiering(tmp_path, monkeypatch, capfd):
    """pytorch/examples' word language model: `torch.save(model)` of a model with an nn.LSTM (whose class pickles
    its own way) while tiering's hooks are on it; the saved model and a deep copy carry none of them."""
    monkeypatch.chdir(tmp_path)
    profile = harness.profile("lstm_save", tmp_path)
    reference = harness.plain("lstm_save", tmp_path / "plain.pt")
    code, result = harness.run("lstm_save", harness.forced(profile, optimizer=None), tmp_path / "forced.pt")
    err = capfd.readouterr().err
    assert code == 0, err
    harness.assert_trains_as_plain(result, reference)
    assert result["hooks"] == 0 and " evictions to nvme0 (" in err
