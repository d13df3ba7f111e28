"""The files a command finds through another one: a plan's profile, a run's plan."""

from __future__ import annotations

from pathlib import Path

from hetero import files
from hetero.errors import STALE_PLAN, HeteroError
from hetero.plan.schema import Plan
from hetero.profile.schema import Profile


def profile_of(plan: Plan, plan_path: Path, why: str) -> Profile:
    """The profile `plan` was solved from (as written, relative to the plan, or beside it: its hash decides),
    unchanged since; `why` says what needs it, for the error when it is missing."""
    source = Path(plan.source.profile)
    candidates = [source] if source.is_absolute() else [source, plan_path.parent / source]
    found = next((c for c in [*candidates, plan_path.parent / source.name] if c.is_file()), None)
    if found is None:
        raise HeteroError(f"{plan_path} was planned from {source}, which does not exist here; {why}",
                          hint=f"run this where `hetero plan` ran, or re-plan: hetero plan --profile PROFILE "
                               f"-o {plan_path}")
    profile = files.load(found, expect=Profile)
    if files.content_sha256(profile) != plan.source.profile_sha256:
        raise HeteroError(f"{found} changed since {plan_path} was planned from it", exit_code=STALE_PLAN,
                          hint=f"re-plan: hetero plan --profile {found} -o {plan_path}")
    return profile
