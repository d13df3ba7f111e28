"""Where work files go (issue 33): every directory above the base is checked as ssh checks a key's path (item 3);
parents made for two bases under one new directory leave nothing behind (item 9); a full disk's hint names what
the user can change: the plan's key for `hetero run`, --nvme for `hetero profile` (item 10)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from hetero.cli.main import main
from hetero.run.devices import workdir
from hetero.run.devices.nvme import NvmeStore
from hetero.run.devices.places import PlanPathError
from hetero.schema import files
from tests.cli.test_run import TRAIN, net
from tests.profile import scripts
from tests.run.plans import optimizer_plan


def test_a_base_inside_a_directory_others_may_rename_in_is_refused(tmp_path):
    parent = tmp_path / "open"
    base = parent / "mine"
    base.mkdir(parents=True, mode=0o755)
    os.chmod(parent, 0o777)  # not sticky: anyone may rename `mine` away and put a directory of theirs there
    with pytest.raises(PlanPathError) as e:
        workdir.create(str(base), "states", "optimizer.nvme.path")
    assert e.value.exit_code == 3 and f"inside {parent}" in e.value.message and "not sticky" in e.value.message
    assert os.listdir(base) == []
    with pytest.raises(PlanPathError, match=f"inside {parent}"):  # also where the base is yet to be made
        workdir.create(str(base / "new"), "states", "optimizer.nvme.path")
    assert os.listdir(base) == []
    os.chmod(parent, 0o1777)  # sticky, as /tmp: only the owner may rename `mine`
    workdir.create(str(base), "states", "optimizer.nvme.path").remove()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_base_inside_another_users_directory_is_refused(tmp_path):
    parent = tmp_path / "theirs"
    (parent / "mine").mkdir(parents=True)
    os.chown(parent, 65534, 65534)
    with pytest.raises(PlanPathError, match="belongs to another user"):
        workdir.create(str(parent / "mine"), "activations", "activations.slow_path")


def test_check_and_run_refuse_such_a_plan_at_its_line_before_anything_runs(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "open" / "mine").mkdir(parents=True)
    os.chmod(tmp_path / "open", 0o777)
    files.save(optimizer_plan(net(), nvme=("head.weight",), nvme_path=str(tmp_path / "open" / "mine")), "plan.yaml")
    line = files.line_of("plan.yaml", "optimizer.nvme.path")
    script = scripts.write(tmp_path, "print('STARTED')\n" + TRAIN)
    assert main(["check", "--skip-profile-check", "plan.yaml"]) == 3
    assert main(["run", "--skip-profile-check", script]) == 3
    out, err = capfd.readouterr()
    said = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(said) == 2 and said[0] == said[1] and said[0].startswith(f"error: plan.yaml:{line}: ")
    assert "STARTED" not in out


@pytest.mark.parametrize("first", ["states", "activations"])
def test_parents_made_for_two_bases_under_one_new_directory_are_all_removed(tmp_path, first):
    new = tmp_path / "new"
    states = NvmeStore.private(str(new / "states"), "states", "optimizer.nvme.path", workers=1)
    acts = NvmeStore.private(str(new / "acts"), "activations", "activations.slow_path", workers=1)
    states.write("k", np.arange(10, dtype=np.uint8))
    acts.write("k", np.arange(10, dtype=np.uint8))
    for store in (states, acts) if first == "states" else (acts, states):
        store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("field, named", [("optimizer.nvme.path", "set optimizer.nvme.path in the plan"),
                                          ("activations.slow_path", "set activations.slow_path in the plan"),
                                          ("--nvme", "point --nvme elsewhere")])
def test_a_full_disk_names_what_the_user_can_change(tmp_path, monkeypatch, field, named):
    store = NvmeStore.private(str(tmp_path), "states", field, workers=1)

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        monkeypatch.setattr(os, "pwritev", full)
        with pytest.raises(Exception, match="no space left") as e:
            store.write("k", np.ones(4096, dtype=np.uint8))
    finally:
        monkeypatch.undo()
        store.close()
    assert named in e.value.hint
    assert field == "--nvme" or "--nvme" not in e.value.hint  # `hetero run` has no such option
