"""Where work files go (issue 33): every directory above the base is checked as ssh checks a key's path (item 3);
parents made for two bases under one new directory leave nothing behind (item 9); a full disk's hint names what
the user can change: the plan's key for `hetero run`, --nvme for `hetero profile` (item 10). Issue 54, item 6: a
link on the way to the base, the base itself included, must be ours or root's; a directory writable by a group is
accepted only where that group is the user's alone."""

from __future__ import annotations

import errno
import grp
import os
import pwd
import subprocess
import sys

import numpy as np
import pytest

from hetero.cli.main import main
from hetero.run.devices import places, workdir
from hetero.run.devices.nvme import NvmeStore
from hetero.run.devices.places import PlanPathError
from hetero.schema import files
from tests.cli.test_run import TRAIN, net
from tests.conftest import REPO
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


@pytest.mark.parametrize("field", ["optimizer.nvme.path", "activations.slow_path", "--nvme"])
def test_a_full_disk_names_what_the_user_can_change(tmp_path, monkeypatch, field):
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
    assert field in e.value.hint  # the plan's field, or the option, that moves the directory
    assert field == "--nvme" or "--nvme" not in e.value.hint  # `hetero run` has no such option


ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user or group needs root")


@ROOT_ONLY
@pytest.mark.parametrize("where", ["the base", "above the base", "a link to the link"])
def test_a_link_of_another_user_on_the_way_to_the_base_is_refused(tmp_path, where):
    sticky, mine = tmp_path / "sticky", tmp_path / "mine"
    sticky.mkdir(mode=0o1777)
    os.chmod(sticky, 0o1777)  # as /tmp: only a link's owner may replace it, and that owner is someone else
    (mine / "sub").mkdir(parents=True)
    link = sticky / "x"
    link.symlink_to(mine)
    base = {"the base": link, "above the base": link / "sub"}.get(where, sticky / "y")
    if where == "a link to the link":
        base.symlink_to(link)  # ours, but it leads through theirs
    os.lchown(link, 1234, 1234)
    for attempt in (lambda: places.inspect(str(base), "optimizer.nvme.path"),
                    lambda: workdir.create(str(base), "states", "optimizer.nvme.path")):
        with pytest.raises(PlanPathError) as e:
            attempt()
        assert e.value.exit_code == 3 and str(link) in e.value.message and "1234" in e.value.message
    assert os.listdir(mine) == ["sub"] and os.listdir(mine / "sub") == []
    os.lchown(link, 0, 0)  # root's (or ours): accepted
    places.inspect(str(base), "optimizer.nvme.path")
    workdir.create(str(base), "states", "optimizer.nvme.path").remove()


def _create_as(base, gid: int) -> int:
    """The exit code of a process whose only group is `gid` making a work directory in `base` (0: made, 3:
    refused): how a user whose primary group is `gid` (umask 002) would run."""
    code = ("import sys\nfrom hetero.run.devices import places, workdir\ntry:\n"
            "    workdir.create(sys.argv[1], 'states', 'f').remove()\n"
            "except places.PlanPathError as e:\n    sys.exit(e.exit_code)\n")
    done = subprocess.run([sys.executable, "-c", code, str(base)], cwd=REPO, group=gid, extra_groups=[],
                          capture_output=True, text=True, timeout=60)
    return done.returncode


def _unused_gid() -> int:
    taken = {g.gr_gid for g in grp.getgrall()} | {p.pw_gid for p in pwd.getpwall()}
    return next(gid for gid in range(54321, 60000) if gid not in taken)


@ROOT_ONLY
def test_a_directory_writable_by_a_group_is_accepted_only_where_the_group_is_the_users_alone(tmp_path):
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o770)
    alone = _unused_gid()  # nobody else has it: this process's own
    os.chown(base, 0, alone)
    assert _create_as(base, alone) == 0
    # another user's primary group, which this process has too: that user could rename our directory away
    theirs = next((p.pw_gid for p in pwd.getpwall() if p.pw_uid != os.getuid() and p.pw_gid != os.getgid()), None)
    if theirs is None:
        pytest.skip("no other user with a primary group of their own")
    os.chown(base, 0, theirs)
    assert _create_as(base, theirs) == 3
    assert os.listdir(base) == []
    os.chmod(base, 0o700)  # the same, a level up
    os.chown(tmp_path, 0, theirs)
    os.chmod(tmp_path, 0o775)
    assert _create_as(base, theirs) == 3


@ROOT_ONLY
def test_a_group_with_another_listed_member_is_not_the_users_alone(tmp_path):
    me = pwd.getpwuid(os.getuid()).pw_name
    shared = next((g.gr_gid for g in grp.getgrall() if set(g.gr_mem) - {me}), None)
    if shared is None:
        pytest.skip("no group here lists a member")
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o770)
    os.chown(base, 0, shared)
    assert _create_as(base, shared) == 3
