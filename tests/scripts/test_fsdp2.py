"""An FSDP2 script (`fully_shard`, gloo, 2 ranks) through `hetero profile`, `hetero plan` and `hetero run
--nproc-per-node 2` (as their torchrun workers run it: tests/scripts/ranks.py), against plain torchrun: what composes
with sharding (activation tiering, a DRAM budget) runs, and the optimizer and the gradient reduction stay the
script's (FSDP2's), with a why. Two torchrun jobs, about 30 s on a quiet machine."""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

from hetero.errors import UNSUPPORTED_SCRIPT
from hetero.schema import files
from hetero.schema.profile import Profile
from tests.scripts import harness
from tests.scripts.harness import assert_trains_as_plain


def _fully_shard() -> bool:
    """torch.distributed.fsdp.fully_shard (FSDP2) is public from torch 2.6; torch 2.4 and 2.5 had it in
    torch.distributed._composable.fsdp, which the script falls back to."""
    if not torch.distributed.is_available() or importlib.util.find_spec("torch.distributed.fsdp") is None:
        return False
    return hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard") or \
        importlib.util.find_spec("torch.distributed._composable.fsdp") is not None


pytestmark = pytest.mark.skipif(not _fully_shard(), reason="FSDP2 (fully_shard) needs torch 2.4 or later")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp2_trains_as_plain_torchrun_under_its_default_plan_and_with_activations_tiered_under_a_budget(tmp_path):
    profile, plain = tmp_path / "profile.yaml", tmp_path / "plain.pt"
    harness.ranks("fsdp2", f"plain={plain}", f"profile={profile}", cwd=tmp_path)
    prof = files.load(profile, expect=Profile)
    assert prof.model.sharded and prof.training.optimizer == "other" and len(prof.machine.peers) == 1
    assert [x.name for x in prof.layers] == ["0", "2", "4"] and all(x.fp_s > 0 for x in prof.layers)
    assert sum(x.saved_bytes for x in prof.layers) > 0  # the unsharded weights FSDP2 saves are not counted
    planned = harness.plan(profile)
    assert planned.optimizer is None and "sharded" in planned.omitted["optimizer"]
    assert planned.routing is None and "FSDP2" in planned.omitted["routing"]
    forced = harness.forced(profile, optimizer=None, budget_bytes=prof.memory.dram_peak_bytes * 4)
    err = harness.ranks("fsdp2", f"run={tmp_path / 'plan.yaml'}={tmp_path / 'default.pt'}",
                        f"run={forced}={tmp_path / 'forced.pt'}", cwd=tmp_path)
    reference = torch.load(plain)
    for out in ("default.pt", "forced.pt"):
        assert_trains_as_plain(torch.load(tmp_path / out), reference)
    assert "evictions to nvme0" in err  # rank 0's summary: the activations went through the disk
    assert not list(tmp_path.glob("hetero-*"))


def test_a_plan_that_offloads_an_fsdp2_models_optimizer_is_refused_with_exit_5(tmp_path, monkeypatch, capfd):
    """One rank, in this process: FSDP2 shards over a world of 1 all the same (its parameters are DTensors)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    profile = harness.profile("fsdp2", tmp_path)  # stops the script before it destroys its process group
    torch.distributed.destroy_process_group()
    prof = files.load(profile, expect=Profile)
    assert prof.model.sharded and prof.training.optimizer == "other"
    prof.training.optimizer = "adamw"  # a plan made by hand that offloads it anyway
    files.save(prof, profile)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    code, _ = harness.run("fsdp2", harness.forced(profile, tiering=False), tmp_path / "forced.pt")
    err = capfd.readouterr().err
    assert code == UNSUPPORTED_SCRIPT and "FSDP2" in err and "Traceback" not in err  # refused, naming why
    if torch.distributed.is_initialized():  # the refused run stopped the script before it destroyed its group
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
