"""`hetero show FILE`: a profile or plan as Rich tables, one per section, or as JSON."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hetero.cli.usage import console
from hetero.schema import files
from hetero.schema.fields import FieldSpec, is_schema, specs, strip_optional
from hetero.schema.profile import CurvePoint
from hetero.units import RATE, TIME


def show(
    path: Path = typer.Argument(..., metavar="FILE", help="A profile or plan file."),
    as_json: bool = typer.Option(False, "--json", help="Print the parsed file as JSON (base units) on stdout."),
    timeline: bool = typer.Option(False, "--timeline", help="Write a plan's predicted iteration as a Chrome/Perfetto "
                                                            "trace (simulated from the profile the plan names)."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Where --timeline writes (default: "
                                                                     "predicted.json)."),
) -> None:
    """Show a profile or plan: a table per section (layers, tiers, schedule, predictions)."""
    if timeline or output is not None:
        _timeline(path, output, timeline)
        return
    obj = files.load(path)
    if as_json:
        print(json.dumps(files.to_data(obj), indent=2))
        return
    # 100 columns at most unless COLUMNS says otherwise: long cells (why, storages) wrap inside their column
    out = console(widest=100)
    out.print(f"[bold]{type(obj).__name__}[/bold] {path}")
    # Plans say why a section is absent, profiles why a field is null: show it where the section would be.
    reasons = getattr(obj, "omitted", None) or getattr(obj, "unmeasured", None) or {}
    for spec in specs(type(obj)):
        _section(out, spec.key, getattr(obj, spec.name), spec, reasons)


def _section(console: Console, title: str, value: Any, spec: FieldSpec, reasons: dict[str, str]) -> None:
    tp = strip_optional(spec.type)
    if value is None or value == [] or value == {}:
        reason = f" ({reasons[title]})" if title in reasons else ""
        console.print(f"\n[bold]{title}[/bold]: none{escape(reason)}")
    elif typing.get_origin(tp) is list and is_schema(typing.get_args(tp)[0]):
        _rows(console, title, value, typing.get_args(tp)[0])
    elif is_schema(tp):
        _record(console, title, value, reasons)
    else:
        table = Table(title=title, title_justify="left", show_header=False)
        for key, item in value.items():
            table.add_row(str(key), _cell(item, spec))
        console.print(table)


def _record(console: Console, title: str, value: Any, reasons: dict[str, str]) -> None:
    """Scalar fields as one key/value table, then each nested section under its own title."""
    table = Table(title=title, title_justify="left", show_header=False)
    nested = []
    for spec in specs(type(value)):
        item = getattr(value, spec.name)
        if _is_section(spec, item):
            nested.append(spec)
        else:
            table.add_row(spec.key, _cell(item, spec))
    if table.row_count:
        console.print(table)
    for spec in nested:
        _section(console, f"{title}.{spec.key}", getattr(value, spec.name), spec, reasons)


def _rows(console: Console, title: str, items: list, cls: type) -> None:
    # A column empty in every row (DHA times on a CPU-only profile, `why` of hand-written entries) says nothing.
    columns = [s for s in specs(cls) if any(getattr(i, s.name) not in (None, "") for i in items)]
    table = Table(title=f"{title} ({len(items)})", title_justify="left")
    for i, spec in enumerate(columns):
        # Headers break at underscores rather than inside words; the first column (a name) never breaks.
        table.add_column(spec.key.replace("_", "_\n"), justify="right" if spec.unit else "left", overflow="fold",
                         no_wrap=i == 0)
    for item in items:
        table.add_row(*[_cell(getattr(item, s.name), s) for s in columns])
    console.print(table)


def _is_section(spec: FieldSpec, value: Any) -> bool:
    tp = strip_optional(spec.type)
    return is_schema(tp) or (typing.get_origin(tp) is list and is_schema(typing.get_args(tp)[0])
                             and tp != list[CurvePoint])


def _cell(value: Any, spec: FieldSpec) -> str:
    if value is None:
        return "-"
    if isinstance(value, list) and value and isinstance(value[0], CurvePoint):
        peak = max(p.size_bytes / p.time_s for p in value if p.time_s > 0)
        return RATE.format_short(peak)  # the best of the measured sizes: a curve does not fit a cell
    if isinstance(value, dict) and spec.unit is not None:
        return spec.unit.format_short(sum(value.values()))
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v, spec)}" for k, v in value.items()) or "-"
    if isinstance(value, list) and spec.unit is not None and len(value) > 2:  # e.g. saved storages, largest first
        return f"{_cell(value[0], spec)} +{len(value) - 1}"
    if isinstance(value, list):
        return ", ".join(_cell(v, spec) for v in value) or "-"
    if is_schema(type(value)):
        return ", ".join(f"{s.key}={_cell(getattr(value, s.name), s)}" for s in specs(type(value)))
    if spec.unit is not None:
        return spec.unit.format_short(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _timeline(path: Path, output: Path | None, timeline: bool) -> None:
    from hetero.errors import USAGE, HeteroError
    from hetero.plan.simulate import chrome_trace
    from hetero.plan.solve import predict
    from hetero.schema.plan import Plan
    from hetero.schema.sources import profile_of

    if not timeline:
        raise HeteroError("-o is only used with --timeline", hint=f"hetero show --timeline {path} -o {output}",
                          exit_code=USAGE)
    plan = files.load(path, expect=Plan)
    result = predict(profile_of(plan, path, "the timeline is simulated from it"), plan, record=True)
    target = output or Path("predicted.json")
    try:
        target.write_text(json.dumps(chrome_trace(result, plan.predicted.iteration_s)))
    except OSError as e:
        raise HeteroError(f"cannot write {target}: {e.strerror}", hint="pass -o with a writable path") from None
    print(f"wrote {target}: {len(result.spans)} spans, simulated iteration {TIME.format_short(result.iteration_s)}, "
          f"predicted {TIME.format_short(plan.predicted.iteration_s)} (open it in https://ui.perfetto.dev or "
          "chrome://tracing)")


def register(app: typer.Typer) -> None:
    app.command(name="show", epilog="Example: hetero show plan.yaml   |   hetero show --json profile.yaml | jq .layers"
                                    "   |   hetero show --timeline plan.yaml -o predicted.json")(show)
