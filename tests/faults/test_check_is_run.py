"""`hetero check` runs every check `hetero run` makes before the script starts (issue 33, items 5-8): the two agree,
with the same exit code, on every file below; a plan whose profile cannot be read is refused unless the check is
skipped by name; an entry or option hetero cannot carry out is an error or a warning naming it, never silence; a
FIFO is refused at once. Issue 54, item 6: a profile that is a FIFO is not a regular file (exit 3), not a missing one;
a work directory on a kernel pseudo file system (/proc, /sys) is refused by both before the script starts."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

import pytest

from hetero.cli.main import main
from hetero.errors import INVALID_FILE, FileProblems
from hetero.harness.capture import fingerprint
from hetero.schema import files
from hetero.schema.plan import ActivationPlan, Plan, StatePlacement
from hetero.schema.profile import Profile
from hetero.schema.sources import profile_of
from tests.cli.test_run import TRAIN, net
from tests.profile import scripts
from tests.run.plans import optimizer_plan

REPO = Path(__file__).resolve().parents[2]
ORDER = ["body.0", "body.2", "norm", "head"]  # Net's layers in forward order


def net_profile(where: Path) -> Profile:
    """The test Net's profile on the bundled CPU machine (its disk tier in `where`): the layers as `hetero profile`
    lists them, with the bundled timings (measuring them takes tens of seconds and is not what is tested)."""
    bundled = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)
    model, like = net(), bundled.layers[0]
    layers = []
    for name in ORDER:
        module = model.get_submodule(name)
        own = dict(module.named_parameters(recurse=False))
        layers.append(dataclasses.replace(like, name=name, type=type(module).__name__,
                                          num_params=sum(p.numel() for p in own.values()),
                                          params={k: p.numel() * 4 for k, p in own.items()}))
    tiers = [dataclasses.replace(t, path=str(where)) if t.path else t for t in bundled.machine.tiers]
    return dataclasses.replace(
        bundled, layers=layers, machine=dataclasses.replace(bundled.machine, tiers=tiers),
        model=dataclasses.replace(bundled.model, fingerprint=fingerprint(model), script="train.py",
                                  num_params=sum(p.numel() for p in model.parameters())))


@pytest.fixture
def planned(tmp_path, monkeypatch):
    """profile.yaml, plan.yaml (every Adam state on the emulated AXDIMM) and train.py, in the current directory."""
    monkeypatch.chdir(tmp_path)
    files.save(net_profile(tmp_path), "profile.yaml")
    assert main(["plan", "--emulate", "axdimm", "-o", "plan.yaml"]) == 0
    scripts.write(tmp_path, TRAIN)
    return tmp_path


def both(*flags: str) -> tuple[int, int]:
    """The exit codes of `hetero check plan.yaml` and `hetero run train.py` under it."""
    return main(["check", *flags, "plan.yaml"]), main(["run", *flags, "train.py", "2"])


def edit(change) -> None:
    files.save(change(files.load("plan.yaml", expect=Plan)), "plan.yaml")


def test_the_plan_as_made_passes_both(planned, capfd):
    assert both() == (0, 0)
    assert "warning" not in capfd.readouterr().err


def test_a_missing_states_line_is_refused_by_both(planned, capfd):
    lines = Path("plan.yaml").read_text().splitlines(keepends=True)
    Path("plan.yaml").write_text("".join(x for x in lines if "{param: norm.bias," not in x))
    assert both() == (3, 3)
    said = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(said) == 2 and said[0] == said[1], said  # the same error from both
    assert ": optimizer.states: " in said[0] and "norm.bias" in said[0]


def test_an_extra_parameter_passes_both_with_a_warning_naming_it(planned, capfd):
    edit(lambda p: dataclasses.replace(p, optimizer=dataclasses.replace(
        p.optimizer, states=[*p.optimizer.states, StatePlacement(param="tail.weight", tier="axdimm", channel=0)])))
    assert both() == (0, 0)
    err = capfd.readouterr().err
    said = [x.removeprefix("hetero: ") for x in err.splitlines()]  # run says it as hetero, beside the script's lines
    said = [x for x in said if re.match(r"warning: plan.yaml:\d+: optimizer.states\[\d+\].param: ", x)]
    assert len(said) == 2 and said[0] == said[1] and "'tail.weight'" in said[0], err  # the same warning from both


@pytest.mark.parametrize("section", ["optimizer", "activations"])
def test_a_gpu_entry_on_a_profile_without_a_gpu_is_refused_by_both(planned, capfd, section):
    def on_gpu(plan: Plan) -> Plan:
        if section == "optimizer":  # run would leave the script's own optimizer in place, saying nothing
            return dataclasses.replace(plan, optimizer=dataclasses.replace(plan.optimizer, device="gpu",
                                                                           backend=None, channels=None))
        acts = ActivationPlan(fast="gpu", slow="dram", stay_time_s=0.0, min_tensor_bytes=0, schedule=[])
        return dataclasses.replace(plan, activations=acts, omitted={k: v for k, v in plan.omitted.items()
                                                                      if k != "activations"})
    edit(on_gpu)
    assert both() == (3, 3)
    said = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(said) == 2 and said[0] == said[1], said  # the same error from both, at the field
    assert f": {section}.{'device' if section == 'optimizer' else 'fast'}: " in said[0] and "GPU" in said[0]


@pytest.mark.parametrize("damage", ["a layer line deleted", "a name holding U+FEFF"])
def test_a_damaged_profile_is_refused_by_check_plan_and_run(planned, capfd, damage):
    text = Path("profile.yaml").read_text()
    if damage == "a layer line deleted":
        text = "".join(x for x in text.splitlines(keepends=True) if "name: norm," not in x)
    else:
        text = "".join(x.replace("params: {weight:", "params: {\ufeffweight:") if "name: norm," in x else x
                       for x in text.splitlines(keepends=True))
    assert text != Path("profile.yaml").read_text()
    Path("profile.yaml").write_text(text)
    assert main(["check", "profile.yaml"]) == 3
    assert main(["plan", "-o", "replanned.yaml"]) == 3  # re-planning from it cannot help: it says so
    assert both() == (3, 3)
    err = capfd.readouterr().err
    assert "re-profile" in err and "Traceback" not in err


def test_a_plan_whose_profile_is_missing_is_refused_unless_the_check_is_skipped_by_name(planned, capfd):
    os.unlink("profile.yaml")
    assert both() == (4, 4)
    assert capfd.readouterr().err.count("--skip-profile-check") == 2  # each names the flag that skips it
    assert both("--skip-profile-check") == (0, 0)
    assert capfd.readouterr().err.count("profile.yaml not found") == 2  # said, as a warning


def test_a_plan_whose_profile_is_unreadable_is_refused_unless_the_check_is_skipped(planned):
    Path("profile.yaml").write_text("apiVersion: hetero/v1\nkind: Profile\nmodel: {}\n")
    assert both() == (3, 3)
    assert both("--skip-profile-check") == (0, 0)


def test_a_forced_optimizer_option_the_planner_cannot_honour_is_named(planned, capfd):
    profile = files.load("profile.yaml", expect=Profile)
    files.save(dataclasses.replace(profile, training=dataclasses.replace(profile.training, optimizer="other")),
               "sgd.profile.yaml")
    for option in (["--optimizer-device", "host"], ["--emulate", "axdimm"]):
        assert main(["plan", "--profile", "sgd.profile.yaml", "-o", "sgd.yaml", *option]) == 0
        err = capfd.readouterr().err
        said = [x for x in err.splitlines() if x.startswith(f"hetero: warning: {' '.join(option)} ")]
        assert len(said) == 1 and "Adam" in said[0], err  # the flag, and what it needs


@pytest.mark.timeout(60)
def test_a_fifo_is_refused_at_once(planned, capfd):
    os.mkfifo("fifo.yaml")  # nobody ever writes to it: opening it for reading would wait forever
    assert main(["check", "fifo.yaml"]) == 3
    assert main(["run", "--plan", "fifo.yaml", "train.py"]) == 3
    said = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(said) == 2 and said[0] == said[1] and said[0].startswith("error: fifo.yaml: "), said


@pytest.mark.timeout(60)
def test_a_profile_that_is_a_fifo_is_not_a_regular_file_and_never_waited_on(planned, capfd):
    os.unlink("profile.yaml")
    os.mkfifo("profile.yaml")  # nobody ever writes to it: opening it for reading would wait forever
    assert both() == (3, 3)
    said = [x for x in capfd.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(said) == 2 and said[0] == said[1] and "profile.yaml: " in said[0], said
    with pytest.raises(FileProblems) as e:  # `hetero show`, `hetero report`
        profile_of(files.load("plan.yaml", expect=Plan), Path("plan.yaml"), "to show it")
    assert e.value.exit_code == INVALID_FILE
    assert both("--skip-profile-check") == (0, 0)


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's pseudo file systems")
@pytest.mark.parametrize("path", ["/proc", "/sys/kernel", "/proc/hetero-new"])
def test_a_directory_on_a_pseudo_file_system_is_refused_by_both_before_the_script(tmp_path, monkeypatch, capfd, path):
    if not os.path.isdir(path.removesuffix("/hetero-new")):
        pytest.skip(f"no {path} here")
    monkeypatch.chdir(tmp_path)
    files.save(optimizer_plan(net(), nvme=("head.weight",), nvme_path=path), "plan.yaml")
    line = files.line_of("plan.yaml", "optimizer.nvme.path")
    scripts.write(tmp_path, "print('STARTED')\n" + TRAIN)
    assert both("--skip-profile-check") == (3, 3)
    out, err = capfd.readouterr()
    said = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(said) == 2 and said[0] == said[1] and said[0].startswith(f"error: plan.yaml:{line}: ")
    assert err.count("hint: ") == 2 and "STARTED" not in out
