"""The real clients users train with, through profile, plan and run: PyTorch Lightning's `Trainer` (automatic
optimization: the model runs inside `optimizer.step(closure)`), a Hugging Face `Trainer` and an accelerate loop,
each clipping its gradients. The default plan trains as plain; a plan with hetero's Adam (forced, with every
layer's activations through disk) is bit-equal to `AdamW(fused=True)`; a plan that overlaps updates with backward
anyway stops with exit code 4 before the first update reaches the model; without clipping, overlapped updates are
bit-equal too."""

from __future__ import annotations

import pytest
import torch

from hetero.errors import STALE_PLAN
from hetero.schema import files
from hetero.schema.profile import Profile
from tests.scripts import harness
from tests.scripts.harness import assert_trains_as_plain

CLIENTS = {"lightning_module": "pytorch_lightning", "hf_trainer": "transformers", "accelerate_loop": "accelerate"}
pytestmark = pytest.mark.slow  # each imports its framework and trains it three or four times


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def bitwise_equal(result: dict, reference: dict) -> None:
    assert result["losses"] == reference["losses"]
    assert result["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        assert torch.equal(result["state"][key], value), key


@pytest.mark.parametrize("name", CLIENTS)
def test_a_client_trains_as_plain_under_the_default_plan_and_bit_equal_to_fused_adamw_under_heteros(workdir, name):
    pytest.importorskip(CLIENTS[name])
    profile = harness.profile(name, workdir)
    assert files.load(profile, expect=Profile).training.edits_grads  # each clips its gradients
    harness.plan(profile)
    code, result = harness.run(name, workdir / "plan.yaml", workdir / "default.pt")
    assert code == 0
    assert_trains_as_plain(result, harness.plain(name, workdir / "plain.pt"))
    fused = harness.plain(name, workdir / "fused.pt", ("fused",))
    code, result = harness.run(name, harness.forced(profile, optimizer="host"), workdir / "forced.pt")
    assert code == 0
    bitwise_equal(result, fused)
    overlapped = harness.forced(profile, optimizer="host", tiering=False, overlap=True)
    assert harness.run(name, overlapped, workdir / "overlapped.pt") == (STALE_PLAN, None)


@pytest.mark.parametrize("name", CLIENTS)
def test_a_client_that_does_not_clip_overlaps_updates_with_backward_bit_equal_to_fused_adamw(workdir, name):
    pytest.importorskip(CLIENTS[name])
    profile = harness.profile(name, workdir, args=("noclip",))
    assert not files.load(profile, expect=Profile).training.edits_grads
    assert harness.plan(profile, "--optimizer-device", "host").optimizer.overlap_backward
    code, result = harness.run(name, workdir / "plan.yaml", workdir / "planned.pt", args=("noclip",))
    assert code == 0
    bitwise_equal(result, harness.plain(name, workdir / "fused.pt", ("fused", "noclip")))
