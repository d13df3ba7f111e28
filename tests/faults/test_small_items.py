"""The smaller items of issue 33: a data-parallel failure prints one traceback, the first failed rank's, before the
one line per rank (item 11); `hetero plan` flushes the plan to disk before renaming it into place, and the rename
after (item 12)."""

from __future__ import annotations

import os
import stat

import pytest

from hetero.cli.main import main
from hetero.schema import files
from tests.cli.test_run import net
from tests.cli.test_run_ddp import DDP_TRAIN, rank_exit
from tests.profile import scripts
from tests.run.test_routing import routed_plan

REPO_PLANS = os.path.join(os.path.dirname(__file__), "..", "..", "plans")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_rank_prints_its_traceback_once_before_the_line_per_rank(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    files.save(routed_plan(net(), threshold=512, shard=1024, dual_sync=600), "plan.yaml")  # rank 0 syncs through
    script = scripts.write(tmp_path, DDP_TRAIN.replace("FAIL", "raise ValueError('bad batch')"))  # hetero's hook
    assert main(["run", "--skip-profile-check", "--nproc-per-node", "2", script, "fail"]) == 1
    err = capfd.readouterr().err
    assert err.count("Traceback") == 1, err
    traceback, _, summary = err.partition("ValueError: bad batch\n")
    assert f'File "{script}"' in traceback and "hetero/run" not in traceback
    first = summary.splitlines()[0]
    assert rank_exit(first) == (1, 1) and first.endswith(": ValueError: bad batch"), err


def test_hetero_plan_flushes_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync dir" if stat.S_ISDIR(st.st_mode) else "fsync file", st.st_ino))
        fsync(fd)

    def recorded_replace(src, dst):
        events.append(("rename", os.stat(src).st_ino))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--profile", os.path.join(REPO_PLANS, "gpt-tiny-cpu.profile.yaml"), "-o", str(out)]) == 0
    written, directory = os.stat(out).st_ino, os.stat(tmp_path).st_ino
    assert events == [("fsync file", written), ("rename", written), ("fsync dir", directory)]
