"""`hetero check FILE...`: validate profiles and plans, printing every problem; a plan gets every check `hetero run`
makes before its script starts (hetero.launch.preflight), so the two agree."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from hetero.cli.usage import print_error
from hetero.errors import HeteroError
from hetero.launch.preflight import check_plan
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile


def check(
    files_: list[Path] = typer.Argument(..., metavar="FILE", help="Profile or plan files."),
    allow_stale: bool = typer.Option(False, "--allow-stale", help="Pass a plan made for another profile or model, "
                                     "as `hetero run --allow-stale` runs it."),
    skip_profile_check: bool = typer.Option(False, "--skip-profile-check", help="Pass a plan whose profile cannot "
                                            "be found or read, unchecked against it, as `hetero run "
                                            "--skip-profile-check` runs it."),
) -> None:
    """Validate profile and plan files; print every problem with file:line:col. A plan is checked as `hetero run`
    checks it before the script starts: against its profile (which must be found, valid and unchanged), and the
    directories it names. Exit 3 for an invalid file, 4 for a stale plan (the first failing file's code)."""
    code = 0
    for path in files_:
        try:
            obj = files.load(path)
            warnings = check_plan(path, allow_stale, skip_profile_check).warnings if isinstance(obj, Plan) else []
        except HeteroError as e:
            code = code or e.exit_code
            print_error(e)
        else:
            for warning in warnings:
                print(f"warning: {warning}", file=sys.stderr)
            print(f"{path}: ok ({summary(obj)})")
    if code:
        raise typer.Exit(code)


def summary(obj: Plan | Profile) -> str:
    if isinstance(obj, Plan):
        named = ("optimizer", "activations", "routing", "allocator", "update_in_backward", "recompute")
        sections = [s for s in named if getattr(obj, s) is not None]
        return f"Plan, {len(obj.layers)} GPU layers, sections: {', '.join(sections) or 'none'}"
    return f"Profile, {obj.model.num_params:,} params, {len(obj.layers)} layers"


def register(app: typer.Typer) -> None:
    app.command(name="check", epilog="Example: hetero check profile.yaml plan.yaml")(check)
