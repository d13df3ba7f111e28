"""A script that changes its gradients between backward and step, by any of torch's ways, is never trained
differently in silence: the profile sees the change, so the plan updates after backward (bit-equal to
`AdamW(fused=True)`); a plan that overlaps anyway stops at `step()` with exit code 4 before a changed gradient's
update reaches the model."""

from __future__ import annotations

import pytest
import torch

from hetero.errors import STALE_PLAN
from hetero.profile.profiler import ProfileOptions, measure_script
from hetero.schema import files
from hetero.schema.profile import Profile
from tests.scripts import harness

EDITS = ["norm", "value", "total_norm", "foreach", "scaler", "inplace", "data", "replace", "closure"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _needs(how: str) -> None:
    if how == "total_norm" and not hasattr(torch.nn.utils, "get_total_norm"):
        pytest.skip("get_total_norm is new in torch 2.6")


@pytest.mark.parametrize("how", ["none", *EDITS])
def test_the_profile_sees_every_way_of_changing_gradients(tmp_path, how):
    _needs(how)
    run = measure_script(harness.script("grad_edits"), [str(tmp_path / "out.pt"), "4", how],
                         ProfileOptions(steps=1, warmup=1))
    assert run.training.edits_grads is (how != "none")


def _bitwise_equal(result: dict, reference: dict) -> None:
    assert result["losses"] == reference["losses"]
    for key, value in reference["state"].items():
        assert torch.equal(result["state"][key], value), key


@pytest.mark.parametrize("how", EDITS)
def test_changed_gradients_train_bit_equal_to_fused_adamw_or_stop_before_the_update_is_kept(workdir, how):
    _needs(how)
    profile = harness.profile("grad_edits", workdir, args=(how,))
    reference = harness.plain("grad_edits", workdir / "fused.pt", args=(how, "fused"))
    planned = harness.plan(profile, "--optimizer-device", "host")
    assert planned.optimizer.overlap_backward is False
    code, result = harness.run("grad_edits", workdir / "plan.yaml", workdir / "planned.pt", args=(how,))
    assert code == 0
    _bitwise_equal(result, reference)
    overlapped = harness.forced(profile, optimizer="host", tiering=False, overlap=True)
    code, result = harness.run("grad_edits", overlapped, workdir / "overlapped.pt", args=(how,))
    assert (code, result) == (STALE_PLAN, None)


def test_unchanged_gradients_overlap_backward_and_train_bit_equal_to_fused_adamw(workdir):
    profile = harness.profile("grad_edits", workdir)
    assert files.load(profile, expect=Profile).training.edits_grads is False
    reference = harness.plain("grad_edits", workdir / "fused.pt", args=("none", "fused"))
    assert harness.plan(profile, "--optimizer-device", "host").optimizer.overlap_backward is True
    code, result = harness.run("grad_edits", workdir / "plan.yaml", workdir / "planned.pt")
    assert code == 0
    _bitwise_equal(result, reference)
