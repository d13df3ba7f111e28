"""`hetero check FILE...`: validate profiles and plans, printing every problem."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from hetero.errors import INVALID_FILE, FileProblems
from hetero.schema import files, sources
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile


def check(files_: list[Path] = typer.Argument(..., metavar="FILE", help="Profile or plan files.")) -> None:
    """Validate profile and plan files; print every problem with file:line:col and exit 3 if any. A plan is also
    checked against its profile when that is found: every layer and parameter it names must be there."""
    bad = 0
    for path in files_:
        try:
            obj = files.load(path)
            if isinstance(obj, Plan) and (problems := sources.name_problems(obj, path)):
                raise FileProblems(problems)
        except FileProblems as e:
            bad += 1
            for problem in e.problems:
                print(f"error: {problem}", file=sys.stderr)
        else:
            print(f"{path}: ok ({summary(obj)})")
    if bad:
        raise typer.Exit(INVALID_FILE)


def summary(obj: Plan | Profile) -> str:
    if isinstance(obj, Plan):
        named = ("optimizer", "activations", "routing", "allocator", "update_in_backward", "recompute")
        sections = [s for s in named if getattr(obj, s) is not None]
        return f"Plan, {len(obj.layers)} GPU layers, sections: {', '.join(sections) or 'none'}"
    return f"Profile, {obj.model.num_params:,} params, {len(obj.layers)} layers"


def register(app: typer.Typer) -> None:
    app.command(name="check", epilog="Example: hetero check profile.yaml plan.yaml")(check)
