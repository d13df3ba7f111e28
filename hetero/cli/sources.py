"""The files a command finds through another one: a plan's profile, a run's plan."""

from __future__ import annotations

from pathlib import Path

from hetero import files
from hetero.errors import STALE_PLAN, FileProblems, HeteroError, Problem
from hetero.plan.names import unknown_names
from hetero.plan.schema import Plan
from hetero.profile.schema import Profile
from hetero.run.launch import find_profile


def profile_of(plan: Plan, plan_path: Path, why: str) -> Profile:
    """The profile `plan` was solved from, unchanged since; `why` says what needs it, for the error when it is
    missing."""
    found = find_profile(plan, plan_path)
    if found is None:
        raise HeteroError(f"{plan_path} was planned from {plan.source.profile}, which does not exist here; {why}",
                          hint=f"run this where `hetero plan` ran, or re-plan: hetero plan --profile PROFILE "
                               f"-o {plan_path}")
    profile = files.load(found, expect=Profile)
    if files.content_sha256(profile) != plan.source.profile_sha256:
        raise HeteroError(f"{found} changed since {plan_path} was planned from it", exit_code=STALE_PLAN,
                          hint=f"re-plan: hetero plan --profile {found} -o {plan_path}")
    return profile


def name_problems(plan: Plan, plan_path: Path) -> list[Problem]:
    """Layer and parameter names in `plan` that its profile, when found and valid, does not have; none without it."""
    found = find_profile(plan, plan_path)
    try:
        profile = files.load(found, expect=Profile) if found is not None else None
    except FileProblems:
        return []
    return [Problem(str(plan_path), f"{path}: {message}", files.line_of(plan_path, path))
            for path, message in (unknown_names(plan, profile) if profile is not None else [])]


def beside(path: str, run_path: Path) -> Path:
    """A path a run.yaml names: as written (absolute since the recorder writes them so), else beside the file."""
    p = Path(path)
    return p if p.is_absolute() or p.is_file() else run_path.parent / p
