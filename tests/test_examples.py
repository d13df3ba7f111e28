"""Every file in plans/ stays valid, and each example plan belongs to the example profile beside it."""

from pathlib import Path

import pytest

from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile

PLANS = sorted((Path(__file__).resolve().parents[1] / "plans").glob("*.plan.yaml"))


def test_there_are_examples():
    assert PLANS


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
def test_plan_matches_its_profile(path, repo):
    plan = files.load(path, expect=Plan)
    profile = files.load(repo / plan.source.profile, expect=Profile)
    assert plan.source.profile_sha256 == files.content_sha256(profile)
    assert plan.source.model_fingerprint == profile.model.fingerprint
    names = {layer.name for layer in profile.layers}
    assert {e.layer for e in plan.activations.schedule} <= names
    params = {f"{layer.name}.{local}" for layer in profile.layers for local in layer.params}
    assert {s.param for s in plan.optimizer.states} == params
