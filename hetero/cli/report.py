"""`hetero report RUN.yaml [--plan PLAN] [--png FILE]`: what a traced run measured against what its plan predicted."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from hetero.cli import usage
from hetero.errors import USAGE, HeteroError
from hetero.report.compare import NEGLIGIBLE, TOLERANCE, Row, compare, folded, grouped_warnings, headline
from hetero.report.png import draw_run
from hetero.schema import files
from hetero.schema.plan import Plan
from hetero.schema.run import Run
from hetero.schema.sources import beside, profile_of


def report(
    run_path: Path = typer.Argument(..., metavar="RUN.yaml", help="The summary `hetero run --trace` wrote."),
    plan_path: Path | None = typer.Option(None, "--plan", metavar="FILE", help="The plan to compare with "
                                          "[default: the one the run carried out]."),
    png: Path | None = typer.Option(None, "--png", metavar="FILE", help="Also draw memory per tier over one step "
                                    "(needs matplotlib: pip install matplotlib)."),
) -> None:
    """Predicted against measured: the iteration and peak memory first, then every layer, then what is off by more
    than 15% (the layers' entries in one line) and how to re-plan from the run. Layers need the plan's profile;
    without it only the iteration and memory are compared."""
    run = files.load(run_path, expect=Run)
    plan_path = plan_path or beside(run.source.plan, run_path)
    if not plan_path.is_file():
        raise HeteroError(f"no plan at {plan_path} to compare {run_path} with", hint="pass --plan PLAN",
                          exit_code=USAGE)
    plan = files.load(plan_path, expect=Plan)
    if plan.source.model_fingerprint != run.source.model_fingerprint:
        raise HeteroError(f"{plan_path} was made for another model than the one {run_path} ran",
                          hint="pass the plan the run carried out with --plan", exit_code=USAGE)
    try:
        profile, note = profile_of(plan, plan_path, "layers are compared only with it"), None
    except HeteroError as e:
        profile, note = None, e.message
    _print(run_path, plan_path, run, compare(run, plan, profile), note)
    if png is not None:
        draw_run(run, run_path, plan, profile, png)
        print(f"wrote {png}")


def _print(run_path: Path, plan_path: Path, run: Run, rows: list[Row], note: str | None) -> None:
    console = usage.console(widest=100)
    t = run.timing
    for line in headline(rows):
        console.print(escape(line), style="bold")
    table = Table(title=f"{run_path}: {run.source.script} under {plan_path}, {t.steps_recorded} steps on {t.device}",
                  title_justify="left")
    for name in ("entry", "predicted", "measured", "error"):
        table.add_column(name, justify="left" if name == "entry" else "right")
    shown, summed = folded(rows)
    for r in shown:
        error = "" if r.error is None or not r.checked else f"{r.error:+.0%}"
        style = "red" if r.off else ("dim" if not r.checked else None)
        table.add_row(escape(r.entry), r.unit.format_short(r.predicted), r.unit.format_short(r.measured), error,
                      style=style)
    console.print(table)
    if summed:
        console.print(f"{summed} layer times under {NEGLIGIBLE:.0%} of the predicted iteration each are summed in "
                      "the 'short layers' rows: one by one they are as short as the timer and hook noise around them")
    if unchecked := sum(not r.checked for r in shown):
        console.print(f"{unchecked} entries under {NEGLIGIBLE:.0%} of the predicted iteration are shown dim, without "
                      "an error, and not checked")
    if note:
        console.print(f"note: {escape(note)}")
    off = grouped_warnings(rows)
    for line in off:
        console.print(f"warning: {escape(line)} (more than {TOLERANCE:.0%} off)", style="yellow")
    if off:
        console.print(f"hint: plan again with the times this run measured: hetero plan --from-run {run_path}")


def register(app: typer.Typer) -> None:
    app.command(name="report", epilog="Example: hetero run --trace run.json train.py && hetero report run.yaml "
                                      "--png memory.png")(report)
