"""hetero.launch.preflight: the checks `hetero run` and `hetero check` make of a plan before its script starts, each
with its exit code (the table in hetero/errors.py)."""

import shutil
from pathlib import Path

import pytest

from hetero.errors import INVALID_FILE, STALE_PLAN, FileProblems, HeteroError
from hetero.launch.preflight import check_plan
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from tests.conftest import REPO

PLAN, PROFILE = REPO / "plans" / "gpt-tiny-cpu.plan.yaml", REPO / "plans" / "gpt-tiny-cpu.profile.yaml"


@pytest.fixture
def plan_path(tmp_path: Path, monkeypatch) -> Path:
    """The bundled plan with its profile beside it, in an empty current directory."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(PROFILE, tmp_path / PROFILE.name)
    shutil.copy(PLAN, tmp_path / PLAN.name)
    return tmp_path / PLAN.name


def test_a_plan_that_agrees_with_its_profile_passes_without_warnings(plan_path: Path):
    checked = check_plan(plan_path)
    assert checked.warnings == [] and checked.profile is not None
    assert checked.plan.source.model_fingerprint == checked.profile.model.fingerprint


def test_a_changed_profile_makes_the_plan_stale_unless_allowed(plan_path: Path):
    profile = files.load(plan_path.parent / PROFILE.name, expect=Profile)
    profile.training.steps_measured += 1
    files.save(profile, plan_path.parent / PROFILE.name)
    with pytest.raises(HeteroError) as e:
        check_plan(plan_path)
    assert e.value.exit_code == STALE_PLAN and "--allow-stale" in e.value.hint
    allowed = check_plan(plan_path, allow_stale=True)
    assert allowed.profile is None and allowed.warnings[0].startswith("running a stale plan")


def test_a_missing_profile_is_refused_unless_the_check_is_skipped(plan_path: Path):
    (plan_path.parent / PROFILE.name).unlink()
    with pytest.raises(HeteroError) as e:
        check_plan(plan_path)
    assert e.value.exit_code == STALE_PLAN and "--skip-profile-check" in e.value.hint
    skipped = check_plan(plan_path, skip_profile_check=True)
    assert skipped.profile is None and len(skipped.warnings) == 1 and "--skip-profile-check" in skipped.warnings[0]


def test_an_unknown_parameter_is_refused_at_its_line_of_the_plan(plan_path: Path):
    plan = files.load(plan_path, expect=Plan)
    plan.optimizer.states[1].param = "no.such.weight"
    files.save(plan, plan_path)
    with pytest.raises(FileProblems) as e:
        check_plan(plan_path)
    problem, unplaced = e.value.problems  # and the parameter it had placed is now placed nowhere
    assert e.value.exit_code == INVALID_FILE
    assert unplaced.message.startswith("optimizer.states: ") and unplaced.line == files.line_of(plan_path,
                                                                                                  "optimizer.states")
    assert problem.message.startswith("optimizer.states[1].param: ") and "'no.such.weight'" in problem.message
    assert "no.such.weight" in plan_path.read_text().splitlines()[problem.line - 1]
