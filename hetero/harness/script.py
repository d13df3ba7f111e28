"""Run a training script we did not write exactly as `python script.py args` would, in this process.

The script sees its own `sys.argv` and `sys.path[0]`, runs as `__main__`, and its exit code passes through. A crash
prints the traceback from the script's own frames on and gives exit code 1.
"""

from __future__ import annotations

import runpy
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hetero.errors import USAGE, HeteroError


class StopScript(BaseException):
    """Raised from a hook to end the script early (a BaseException: the script's `except Exception:` cannot
    swallow it); `error`, hetero's problem, is re-raised by `run_script` outside the script."""

    def __init__(self, error: HeteroError | None = None):
        super().__init__(error.message if error else "stop")
        self.error = error


@dataclass(frozen=True, slots=True)
class ScriptResult:
    exit_code: int
    stopped: bool  # ended by StopScript rather than by running to its end
    error: str = ""  # the last line of the script's traceback, or of what it passed to sys.exit; "" if none


def script_argv(script: str, args: list[str]) -> list[str]:
    """`sys.argv` the script sees: its path, then its arguments exactly as given after it (a `--` too, as
    `python script.py -- x` would pass it; hetero's own options all come before the script)."""
    return [script, *args]


def check_script(script: str) -> Path:
    """The script's path; a HeteroError (exit 2) when it is not a file hetero can read."""
    path = Path(script)
    hint = "give the path of a Python training script, e.g. examples/train_gpt.py"
    if not path.is_file():
        raise HeteroError(f"no such script: {script}", hint=hint, exit_code=USAGE)
    try:
        with path.open("rb"):
            pass
    except OSError as e:
        raise HeteroError(f"cannot read the script {script}: {e.strerror}", hint=hint, exit_code=USAGE) from None
    return path


def run_script(script: str, args: list[str], tracebacks: TextIO | None = None,
               explain: Callable[[BaseException], HeteroError | None] | None = None) -> ScriptResult:
    """Run `script` as `__main__` with `args`; returns how it ended. Ctrl-C propagates, and so does a HeteroError
    raised by hetero's code inside the script, or given by `explain` for the script's exception instead of its
    traceback. The script's traceback goes to `tracebacks` (default: stderr)."""
    path = check_script(script)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = script_argv(script, args)
    sys.path[:1] = [str(path.resolve().parent)]  # as `python script.py` does: the script's folder comes first
    try:
        runpy.run_path(str(path), run_name="__main__")
        return ScriptResult(0, stopped=False)
    except StopScript as stop:
        if stop.error is not None:
            raise stop.error from None
        return ScriptResult(0, stopped=True)
    except SystemExit as e:
        message = "" if e.code is None or isinstance(e.code, int) else str(e.code)
        return ScriptResult(_exit_code(e), stopped=False, error=message)
    except HeteroError:
        raise
    except Exception as e:
        explained = explain(e) if explain is not None else None
        if explained is not None:
            raise explained from None
        _print_script_traceback(e, path, tracebacks or sys.stderr)
        return ScriptResult(1, stopped=False, error=traceback.format_exception_only(type(e), e)[-1].strip())
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _exit_code(e: SystemExit) -> int:
    """What the interpreter would exit with for `sys.exit(e.code)`."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _print_script_traceback(e: BaseException, path: Path, file: TextIO) -> None:
    script = str(path.resolve())
    tb = e.__traceback__
    while tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()) != script:
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__, file=file)
