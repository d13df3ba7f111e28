"""The command line as users write and read it: quantities with units in options, and help text with
`SCRIPT [ARGS]...` in usage lines where typer writes `{SCRIPT}` and no Python types (`ARGS <list[str]>`).
"""

from __future__ import annotations

import os
import re
import sys

from rich.console import Console
from typer.core import TyperCommand

from hetero.errors import USAGE, FileProblems, HeteroError
from hetero.units import Unit

_REQUIRED = re.compile(r"\{([A-Z][A-Za-z0-9_.]*)\}")  # {SCRIPT} -> SCRIPT
_OPTION_TYPE = re.compile(r"(--[a-z][a-z-]*) <(int|float|str|path)>")  # "--steps <int>" -> "--steps N"
_METAVAR = {"int": "N", "float": "NUMBER", "str": "TEXT", "path": "FILE"}
_TYPE = re.compile(r" <[A-Za-z][A-Za-z\[\], |]*>")  # "SCRIPT <str>", "FILE <list[Path]>": an argument's type


def readable(text: str) -> str:
    """Help or usage text with hetero's argument names; the help column stays aligned."""
    text = _REQUIRED.sub(r"\1", text)  # in the usage line only, where nothing is aligned
    text = _OPTION_TYPE.sub(lambda m: f"{m[1]} {_METAVAR[m[2]]}".ljust(len(m[0])), text)
    return _TYPE.sub(lambda m: " " * len(m.group(0)), text)


class Command(TyperCommand):
    def collect_usage_pieces(self, ctx) -> list[str]:
        """Click's pieces, a variadic argument's ending with `...` whatever typer writes (0.27 leaves it out)."""
        variadic = {(p.metavar or p.name or "").upper() for p in self.params
                    if p.param_type_name == "argument" and p.nargs == -1}
        return [f"{piece}..." if piece.strip("[]{}") in variadic and not piece.endswith("...") else piece
                for piece in super().collect_usage_pieces(ctx)]

    def get_usage(self, ctx) -> str:
        return readable(super().get_usage(ctx))

    def get_help(self, ctx) -> str:
        return readable(super().get_help(ctx))


def print_error(e: HeteroError) -> None:
    """`error:` lines on stderr (each of a file's problems, else the message), then the `hint:` line."""
    for line in [str(p) for p in e.problems] if isinstance(e, FileProblems) else [e.message]:
        print(f"error: {line}", file=sys.stderr)
    if e.hint:
        print(f"hint: {e.hint}", file=sys.stderr)


def own_process(ctx) -> bool:
    """Whether hetero is this process's command (`hetero ...`, `python -m hetero`; hetero.cli.main sets it), not a
    call of `main()` from a Python program: only then may a command fork or replace the process."""
    return bool(ctx.obj and ctx.obj.get("own_process"))


def quantity(unit: Unit, text: str | None, flag: str):
    """The value of option `flag` (`8GiB`, `1ms`) in `unit`'s base unit; None when not given."""
    if text is None:
        return None
    try:
        return unit.parse(text)
    except ValueError as e:
        raise HeteroError(f"{flag}: {e}", hint=f"write it like {flag} {unit.example()}", exit_code=USAGE) from None


def console(widest: int, stderr: bool = False) -> Console:
    """A console as wide as `COLUMNS` says where it is set, else the terminal's width up to `widest`, else (piped)
    `widest`: long cells wrap inside their column."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return Console(width=int(columns), stderr=stderr)
    probe = Console(stderr=stderr)
    return Console(width=min(probe.width, widest) if probe.is_terminal else widest, stderr=stderr)
