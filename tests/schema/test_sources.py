"""hetero.schema.sources: how a plan names its profile, finding it again, and what a plan asks that its profile shows
`hetero run` cannot do."""

import dataclasses
import shutil
from pathlib import Path

import pytest

from hetero.errors import STALE_PLAN, HeteroError
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from hetero.schema.sources import against_profile, beside, find_profile, profile_of, written_profile_path
from tests.conftest import REPO

PLAN, PROFILE = REPO / "plans" / "gpt-tiny-cpu.plan.yaml", REPO / "plans" / "gpt-tiny-cpu.profile.yaml"


@pytest.fixture
def copied(tmp_path: Path, monkeypatch) -> Path:
    """The bundled plan and its profile side by side in an empty directory, which is also the current one (the
    plan names its profile as `plans/...`, relative to where it was made)."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(PROFILE, tmp_path / PROFILE.name)
    shutil.copy(PLAN, tmp_path / PLAN.name)
    return tmp_path / PLAN.name


def test_a_plan_names_its_profile_relative_to_itself(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert written_profile_path(Path("profiles/p.yaml"), Path("plans/plan.yaml")) == "../profiles/p.yaml"
    assert written_profile_path(Path("p.yaml"), Path("plan.yaml")) == "p.yaml"
    assert written_profile_path(tmp_path / "p.yaml", Path("plans/plan.yaml")) == str(tmp_path / "p.yaml")


def test_the_profile_is_found_beside_the_plan_and_must_be_unchanged(copied: Path):
    plan = files.load(copied, expect=Plan)
    assert find_profile(plan, copied) == copied.parent / PROFILE.name
    assert files.content_sha256(profile_of(plan, copied, "to check it")) == plan.source.profile_sha256
    profile = files.load(copied.parent / PROFILE.name, expect=Profile)
    profile.training.steps_measured += 1
    files.save(profile, copied.parent / PROFILE.name)
    with pytest.raises(HeteroError) as e:
        profile_of(plan, copied, "to check it")
    assert e.value.exit_code == STALE_PLAN and "changed since" in e.value.message


def test_a_missing_profile_says_what_needed_it(copied: Path):
    (copied.parent / PROFILE.name).unlink()
    with pytest.raises(HeteroError) as e:
        profile_of(files.load(copied, expect=Plan), copied, "to simulate it")
    assert PROFILE.name in e.value.message and e.value.message.endswith("to simulate it")  # and what needed it
    assert "hetero plan --profile" in e.value.hint


def test_a_plan_its_profile_allows_has_no_findings():
    assert against_profile(files.load(PLAN, expect=Plan), files.load(PROFILE, expect=Profile)) == []


def test_a_parameter_without_a_placement_is_refused_and_an_extra_entry_only_warned():
    plan, profile = files.load(PLAN, expect=Plan), files.load(PROFILE, expect=Profile)
    dropped = plan.optimizer.states.pop()
    [finding] = against_profile(plan, profile)
    assert (finding.path, finding.error) == ("optimizer.states", True)
    assert dropped.param in finding.message
    plan.optimizer.states += [dropped, dataclasses.replace(dropped, param="no.such.param")]
    [finding] = against_profile(plan, profile)
    assert finding.path == f"optimizer.states[{len(plan.optimizer.states) - 1}].param" and not finding.error
    assert "'no.such.param'" in finding.message


def test_gpu_entries_are_refused_on_a_profile_without_a_gpu():
    plan, profile = files.load(PLAN, expect=Plan), files.load(PROFILE, expect=Profile)
    assert profile.machine.gpu is None
    plan.optimizer.device = "gpu"
    assert [(f.path, f.error) for f in against_profile(plan, profile)] == [("optimizer.device", True)]


def test_a_path_a_run_names_is_found_as_written_or_beside_the_run(tmp_path: Path):
    run = tmp_path / "out" / "run.yaml"
    assert beside(str(tmp_path / "x.yaml"), run) == tmp_path / "x.yaml"
    assert beside("plan.yaml", run) == tmp_path / "out" / "plan.yaml"
