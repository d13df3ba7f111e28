"""The files that name one another: a plan names its profile (relative to the plan), a run names its plan."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hetero.errors import STALE_PLAN, HeteroError
from hetero.schema import files
from hetero.schema.names import unknown_names
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile


def written_profile_path(profile: Path, plan_path: Path) -> str:
    """How a plan at `plan_path` names `profile`: relative to the plan, so that it is found from any directory."""
    return str(profile) if profile.is_absolute() else os.path.relpath(profile.resolve(), plan_path.resolve().parent)


def find_profile(plan: Plan, plan_path: Path) -> Path | None:
    """The plan's profile, relative to the plan (as `hetero plan` writes it), to the current directory (older plans)
    or beside the plan: the first regular file of those, else the first that exists (loading it then says what it
    is), else None. Only `stat`ed, never opened: a FIFO cannot block it."""
    source = Path(plan.source.profile)
    candidates = [source] if source.is_absolute() else [plan_path.parent / source, source]
    candidates.append(plan_path.parent / source.name)
    return next((c for c in candidates if c.is_file()), None) or next((c for c in candidates if c.exists()), None)


def profile_of(plan: Plan, plan_path: Path, why: str) -> Profile:
    """The profile `plan` was solved from, unchanged since; `why` says what needs it, for the error when missing."""
    if (found := find_profile(plan, plan_path)) is None:
        raise HeteroError(f"{plan_path} was planned from {plan.source.profile}, which does not exist here; {why}",
                          hint=f"run this where `hetero plan` ran, or re-plan: hetero plan --profile PROFILE "
                               f"-o {plan_path}")
    profile = files.load(found, expect=Profile)
    if files.content_sha256(profile) != plan.source.profile_sha256:
        raise HeteroError(f"{found} changed since {plan_path} was planned from it", exit_code=STALE_PLAN,
                          hint=f"re-plan: hetero plan --profile {found} -o {plan_path}")
    return profile


@dataclass(frozen=True, slots=True)
class Finding:
    """Something in a plan that its profile shows `hetero run` cannot carry out (`error`: it refuses the plan) or
    carries out otherwise than written (a warning saying what it does instead)."""

    path: str  # the YAML path in the plan, e.g. `optimizer.states[3].param`
    message: str
    error: bool = True


def against_profile(plan: Plan, profile: Profile) -> list[Finding]:
    """What `hetero run` would refuse or ignore in `plan`, found from its (unchanged) profile alone: names the model
    does not have, parameters with no state placement, GPU sections on a machine without a GPU. Pure."""
    placed = {s.param for s in plan.optimizer.states} if plan.optimizer is not None else set()
    kept = profile.kept_models()
    owned = [name for layer in profile.layers if layer.model not in kept for name in layer.param_names()]
    offloaded = plan.optimizer is not None and plan.optimizer.device != "gpu"
    unplaced = [name for name in owned if name not in placed] if offloaded else []
    # an extra entry of optimizer.states: the run never looks it up
    out = [Finding(path, f"{message}; hetero run ignores this entry", error=False)
           if path.startswith("optimizer.states") and not unplaced else Finding(path, message)
           for path, message in unknown_names(plan, profile)]
    if unplaced:
        out.append(Finding("optimizer.states", f"no placement for {len(unplaced)} of the profile's parameters, e.g. "
                                               f"{unplaced[0]}: hetero run needs one for every parameter"))
    if profile.machine.gpu is None:
        out += [Finding(path, f"{what}, but the profile's machine has no GPU") for path, what in _on_gpu(plan)]
    return out


def _on_gpu(plan: Plan) -> list[tuple[str, str]]:
    """(YAML path, what) for each entry that needs a GPU."""
    out = [("layers", f"{len(plan.layers)} layer(s) placed in GPU memory")] if plan.layers else []
    if plan.optimizer is not None and plan.optimizer.device == "gpu":
        out.append(("optimizer.device", "the optimizer updates on the GPU (gpu: the script's own optimizer)"))
    if plan.activations is not None and plan.activations.fast == "gpu":
        out.append(("activations.fast", "activations are tiered from GPU memory (fast: gpu)"))
    return out


def beside(path: str, run_path: Path) -> Path:
    """A path a run.yaml names: as written (absolute since the recorder writes them so), else beside the file."""
    p = Path(path)
    return p if p.is_absolute() or p.is_file() else run_path.parent / p
