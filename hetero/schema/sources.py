"""The files that name one another: a plan names its profile (relative to the plan), a run names its plan."""

from __future__ import annotations

import os
from pathlib import Path

from hetero.errors import STALE_PLAN, FileProblems, HeteroError, Problem
from hetero.schema import files
from hetero.schema.names import unknown_names
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile


def written_profile_path(profile: Path, plan_path: Path) -> str:
    """How a plan at `plan_path` names `profile`: relative to the plan, so that it is found from any directory."""
    return str(profile) if profile.is_absolute() else os.path.relpath(profile.resolve(), plan_path.resolve().parent)


def find_profile(plan: Plan, plan_path: Path) -> Path | None:
    """The plan's profile: its path as written, relative to the plan (as `hetero plan` writes it), relative to the
    current directory (older plans), or beside the plan (the hash decides whether it is the right one)."""
    source = Path(plan.source.profile)
    candidates = [source] if source.is_absolute() else [plan_path.parent / source, source]
    return next((c for c in [*candidates, plan_path.parent / source.name] if c.is_file()), None)


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
