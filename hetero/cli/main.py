"""Entry point: registers the subcommands and turns errors into `error:`/`hint:` lines and exit codes."""

from __future__ import annotations

import sys
import traceback

import typer

from hetero import __version__, interrupts
from hetero.cli import check, plan, profile, report, run, show, usage
from hetero.errors import HeteroError, Interrupted

app = typer.Typer(name="hetero", help="Train PyTorch models larger and faster than GPU memory allows, using every "
                  "memory tier.", epilog="Example: hetero check plan.yaml && hetero show plan.yaml",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
_debug = False


def _version(value: bool) -> None:
    if value:
        print(f"hetero {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Print the version."),
             debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    global _debug
    _debug = debug


check.register(app)
profile.register(app)
plan.register(app)
run.register(app)
report.register(app)
show.register(app)
for _command in app.registered_commands:  # usage lines without {SCRIPT} or <list[str]>
    _command.cls = usage.Command  # every command is a plain TyperCommand otherwise


def main(argv: list[str] | None = None) -> int:
    """Run `hetero` with `argv` (default: sys.argv[1:]) and return its exit code; user errors never show a
    traceback (`--debug` shows one). Typer itself reports usage errors (exit 2). Ctrl-C, SIGTERM and SIGHUP end
    the command with 130, 143 and 129 once everything is cleaned up, even where a script swallowed the exception."""
    try:
        with interrupts.handled():
            code = _run(argv)
    except Interrupted as e:  # a signal after `_run` returned (a third one, forcing the end of a slow cleanup)
        code = e.exit_code
    if (interrupted := interrupts.exit_code()) is not None:
        print(f"error: {interrupts.name(interrupted - 128)}", file=sys.stderr)
        return interrupted
    return code


def _run(argv: list[str] | None) -> int:
    try:
        # argv None: hetero is this process's command, which `hetero run` may replace with the script itself
        app(args=argv, prog_name="hetero", obj={"own_process": argv is None})
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except HeteroError as e:
        if _debug:
            traceback.print_exception(e)
        usage.print_error(e)
        return e.exit_code
    except Interrupted as e:
        return e.exit_code
    return 0

