"""`hetero plan --from-run`: re-time a profile with what a traced run measured, on disk, in one call.

The merge itself is pure (`hetero.plan.from_run`); this module finds the run's plan and profile and writes the
re-timed profile beside the new plan, which names it, so that `hetero run` can check the plan against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetero.errors import USAGE, HeteroError
from hetero.plan.from_run import measured_profile
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile
from hetero.schema.run import Run
from hetero.schema.sources import beside, profile_of


@dataclass(frozen=True, slots=True)
class Retimed:
    path: Path  # where the re-timed profile was written
    profile: Profile
    ran: Plan  # the plan the run carried out: its pinned entries survive unless the user passes --from


def retime(run_path: Path, profile_path: Path | None, plan_output: Path) -> Retimed:
    """The profile at `profile_path` (default: the profile of the plan the run carried out) with the run's timings,
    written as `<plan_output stem>.profile.yaml` beside `plan_output`."""
    run = files.load(run_path, expect=Run)
    ran_path = beside(run.source.plan, run_path)
    if not ran_path.is_file():
        raise HeteroError(f"{run_path} ran {run.source.plan}, which is not here", exit_code=USAGE,
                          hint="run this where the run was made, or pass the plan with --from")
    ran = files.load(ran_path, expect=Plan)
    base = files.load(profile_path, expect=Profile) if profile_path else profile_of(ran, ran_path, "it is re-timed")
    merged = measured_profile(base, ran, run)
    target = plan_output.with_name(f"{plan_output.stem}.profile.yaml")
    files.save(merged, target, header=(f"the profile of {ran.source.profile} with the timings measured in {run_path}",
                                       "Written by hetero plan --from-run."))
    return Retimed(target, merged, ran)
