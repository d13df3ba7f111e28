"""Every check `hetero run` makes of a plan before the script starts, in the one function `hetero check` calls too,
so that the two pass and refuse the same files with the same exit codes. In order:
1. the plan is a valid Plan (exit 3, every problem at its file:line);
2. its profile is found and is a valid Profile (missing: exit 4, unreadable: exit 3; `--skip-profile-check` turns
   both into a warning, and the plan then goes unchecked against it), and unchanged since the plan was made (exit 4;
   `--allow-stale` turns it into a warning), made for the plan's model (exit 4, likewise);
3. against the profile (hetero.schema.sources.against_profile): names the model does not have, parameters the
   optimizer section places nowhere, GPU sections on a machine without one (exit 3 at the entry's line); entries
   `run` would ignore are warnings that say so;
4. the directories the plan names (`optimizer.nvme.path`, `activations.slow_path`): what the run would refuse when
   it makes its work directories there (hetero.run.devices.places), exit 3 at the line.
torch is not imported here: `hetero check` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetero.errors import STALE_PLAN, FileProblems, HeteroError, Problem
from hetero.run.devices import places
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from hetero.schema.sources import against_profile, find_profile

SKIP_PROFILE_CHECK = "--skip-profile-check"


@dataclass(frozen=True, slots=True)
class Checked:
    """A plan `hetero run` may start, with what it should say first."""

    plan: Plan
    profile: Profile | None  # None: not checked against it (--skip-profile-check, or a stale one allowed)
    warnings: list[str]


def check_plan(plan_path: Path, allow_stale: bool = False, skip_profile_check: bool = False) -> Checked:
    """The plan at `plan_path` if `hetero run` may start it; else FileProblems (exit 3) or a HeteroError (exit 4)."""
    plan = files.load(plan_path, expect=Plan)
    profile, warnings = _profile(plan, plan_path, allow_stale, skip_profile_check)
    problems: list[Problem] = []
    if profile is not None:
        for f in against_profile(plan, profile):
            line = files.line_of(plan_path, f.path)
            if f.error:
                problems.append(Problem(str(plan_path), f"{f.path}: {f.message}", line))
            else:
                warnings.append(str(Problem(str(plan_path), f"{f.path}: {f.message}", line)))
    found = bool(problems)
    problems += _directories(plan, plan_path)
    if problems:
        hint = (f"edit those entries, or plan again: hetero plan --profile {find_profile(plan, plan_path)} "
                f"-o {plan_path}") if found else places.HINT
        raise FileProblems(problems, hint=hint)
    return Checked(plan, profile, warnings)


def _profile(plan: Plan, plan_path: Path, allow_stale: bool, skip: bool) -> tuple[Profile | None, list[str]]:
    found = find_profile(plan, plan_path)
    unchecked = f"{plan_path} is not checked against its profile ({SKIP_PROFILE_CHECK})"
    if found is None:
        if skip:
            return None, [f"{unchecked}: {plan.source.profile} not found"]
        raise HeteroError(f"{plan_path} was planned from {plan.source.profile}, which is not found: the plan cannot be "
                          "checked against it", exit_code=STALE_PLAN,
                          hint=f"keep the profile beside the plan, plan again, or pass {SKIP_PROFILE_CHECK} to run "
                               "the plan unchecked")
    try:
        profile = files.load(found, expect=Profile)
    except FileProblems as e:
        if skip:
            return None, [f"{unchecked}: {found} is not a valid profile"]
        raise FileProblems(e.problems, hint=f"profile again (hetero profile SCRIPT -o {found}) and plan again, or "
                                            f"pass {SKIP_PROFILE_CHECK} to run the plan unchecked") from None
    if files.content_sha256(profile) != plan.source.profile_sha256:
        if not allow_stale:
            raise HeteroError(f"{plan_path} is stale: {found} changed since the plan was made",
                              hint=f"plan again (hetero plan --profile {found}) or pass --allow-stale",
                              exit_code=STALE_PLAN)
        return None, [f"running a stale plan: {found} changed since it was made"]
    if plan.source.model_fingerprint != profile.model.fingerprint:
        if not allow_stale:
            raise HeteroError(f"{plan_path} was made for another model ({plan.source.model_fingerprint[:19]}...) "
                              f"than {found} describes ({profile.model.fingerprint[:19]}...)", exit_code=STALE_PLAN,
                              hint=f"plan again (hetero plan --profile {found}) or pass --allow-stale")
        return None, [f"running a plan made for another model than {found} describes"]
    return profile, []


def _directories(plan: Plan, plan_path: Path) -> list[Problem]:
    """The directories the plan names, where the run will make work directories in them."""
    used: list[tuple[str | None, str]] = []
    opt = plan.optimizer
    if opt is not None and opt.device != "gpu" and opt.nvme is not None and any(s.tier == "nvme" for s in opt.states):
        used.append((opt.nvme.path, "optimizer.nvme.path"))
    acts = plan.activations
    if acts is not None and (acts.fast != "gpu" or acts.slow_path is not None):
        used.append((acts.slow_path, "activations.slow_path"))
    problems = []
    for base, field in used:
        try:
            places.inspect(base, field)
        except places.PlanPathError as e:
            problems.append(Problem(str(plan_path), e.message, files.line_of(plan_path, field)))
    return problems
