"""Private work directories: unpredictable names, hostile directories refused, dead runs' files swept."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from hetero.errors import INVALID_FILE
from hetero.run.devices import workdir
from hetero.run.devices.nvme import NvmeStore
from hetero.run.devices.places import PlanPathError


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_each_run_gets_a_new_private_directory_with_an_unpredictable_name(tmp_path):
    a, b = workdir.create(str(tmp_path), "activations", "f"), workdir.create(str(tmp_path), "activations", "f")
    try:
        assert a.path != b.path and a.path.parent == tmp_path
        assert a.path.name.startswith(f"hetero-activations-{os.getpid()}-{workdir.host()}-") and len(a.path.name) > 35
        assert mode(a.path) == 0o700 and os.lstat(a.path).st_uid == os.getuid()
    finally:
        a.remove(), b.remove()
    assert os.listdir(tmp_path) == []


def test_a_directory_pre_created_under_the_old_predictable_name_is_never_used(tmp_path):
    trap = tmp_path / f"hetero-states-{os.getpid()}"
    trap.mkdir(mode=0o777)
    os.chmod(trap, 0o777)
    work = workdir.create(str(tmp_path), "states", "f")
    try:
        assert work.path != trap and trap.exists()  # neither used nor swept (not 0700)
    finally:
        work.remove()


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's directory needs root")
def test_a_base_owned_by_another_user_is_refused(tmp_path):
    base = tmp_path / "theirs"
    base.mkdir()
    os.chown(base, 65534, 65534)
    with pytest.raises(PlanPathError) as e:
        workdir.create(str(base), "states", "optimizer.nvme.path")
    assert e.value.exit_code == INVALID_FILE and "belongs to another user" in e.value.message
    assert e.value.message.startswith("optimizer.nvme.path: ") and os.listdir(base) == []


def test_a_base_others_may_write_in_is_refused_unless_sticky(tmp_path):
    base = tmp_path / "open"
    base.mkdir()
    os.chmod(base, 0o777)
    with pytest.raises(PlanPathError, match="not sticky"):
        workdir.create(str(base), "activations", "f")
    os.chmod(base, 0o1777)  # as /tmp: others cannot rename what is ours
    workdir.create(str(base), "activations", "f").remove()
    os.chmod(base, 0o770)  # writable by the user's own group (umask 002)
    workdir.create(str(base), "activations", "f").remove()
    if os.getuid() == 0:  # root can give the directory to another group
        os.chown(base, 0, 65534)
        with pytest.raises(PlanPathError, match="not sticky"):
            workdir.create(str(base), "activations", "f")


def test_home_is_expanded_and_parents_made_for_the_run_are_removed_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    work = workdir.create("~/a/b", "activations", "f")
    assert work.path.parent == tmp_path / "a" / "b" and mode(tmp_path / "a") == 0o700
    (work.path / "x.bin").write_bytes(b"x")
    work.remove()
    assert os.listdir(tmp_path) == []  # no ./~, no empty a/b


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_path_is_refused(path):
    with pytest.raises(PlanPathError, match="f: empty path"):
        workdir.create(path, "activations", "f")


def test_a_file_as_base_is_refused_and_leaves_nothing(tmp_path):
    (tmp_path / "file").write_text("")
    for base in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(PlanPathError) as e:
            workdir.create(str(base), "activations", "f")
        assert str(tmp_path / "file") in e.value.message and "~/hetero-tmp" in e.value.hint
    assert os.listdir(tmp_path) == ["file"]


def test_sweep_removes_only_this_users_private_directories_of_dead_processes(tmp_path):
    dead, live, here = dead_pid(), os.getppid(), workdir.host()
    gone = tmp_path / f"hetero-activations-{dead}-{here}-abc"
    elsewhere = tmp_path / f"hetero-states-{dead}-{'0' * 8 if here != '0' * 8 else '1' * 8}-abc"  # another machine
    running = tmp_path / f"hetero-states-{live}-{here}-abc"
    shared = tmp_path / f"hetero-states-{dead}-{here}-open"
    other = tmp_path / f"not-hetero-{dead}-{here}-x"
    for d in (gone, elsewhere, running, shared, other):
        d.mkdir(mode=0o700)
        (d / "hetero-1-2.bin").write_bytes(b"x" * 10)
    os.chmod(shared, 0o755)
    link = tmp_path / f"hetero-states-{dead}-{here}-link"
    link.symlink_to(other)
    assert workdir.sweep(tmp_path) == [gone]
    kept = (elsewhere, running, shared, other, link)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in kept)
    assert (other / "hetero-1-2.bin").exists()


def test_a_new_store_sweeps_its_base_and_removes_its_own_directory_on_close(tmp_path):
    leftover = tmp_path / f"hetero-activations-{dead_pid()}-{workdir.host()}-xyz"
    leftover.mkdir(mode=0o700)
    (leftover / "a.bin").write_bytes(b"x")
    store = NvmeStore.private(str(tmp_path / "new"), "activations", "activations.slow_path", workers=1)
    try:
        store.write("k", np.arange(10, dtype=np.uint8))
        assert store.directory.parent == tmp_path / "new"
    finally:
        store.close()
    assert leftover.exists() and not (tmp_path / "new").exists()  # only the store's own base is swept
    NvmeStore.private(str(tmp_path), "activations", "f", workers=1).close()
    assert os.listdir(tmp_path) == []


def test_a_store_that_cannot_start_is_a_plan_path_error_and_leaves_nothing(tmp_path, monkeypatch):
    from hetero.run.devices import direct_io

    def full(probe):
        raise direct_io.no_space(probe.parent, 4096)

    monkeypatch.setattr(direct_io, "direct_io_works", full)
    with pytest.raises(PlanPathError) as e:
        NvmeStore.private(str(tmp_path / "d"), "states", "optimizer.nvme.path")
    assert e.value.exit_code == INVALID_FILE and "no space left" in e.value.message
    assert os.listdir(tmp_path) == []


def test_a_base_made_meanwhile_by_a_run_beside_is_used_and_left_to_it(tmp_path, monkeypatch):
    base = tmp_path / "shared"
    real_mkdir = type(base).mkdir

    def raced(self, *args, **kwargs):  # the other run creates the directory between our check and our mkdir
        real_mkdir(self, *args, **kwargs)
        raise FileExistsError(17, "File exists", str(self))

    monkeypatch.setattr(type(base), "mkdir", raced)
    work = workdir.create(str(base), "states", "f")
    monkeypatch.undo()
    assert work.made == [] and work.path.parent == base
    work.remove()
    assert base.is_dir()  # the other run's
