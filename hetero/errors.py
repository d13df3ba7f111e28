"""User-facing errors and the exit codes every hetero command shares (the table in docs/plan-format.md)."""

from __future__ import annotations

from dataclasses import dataclass

FAILURE = 1
USAGE = 2
INVALID_FILE = 3
STALE_PLAN = 4
UNSUPPORTED_SCRIPT = 5  # the script trains in a way hetero cannot carry out (found by `hetero profile`)
DAMAGED = 6  # a work file hetero keeps training data in was changed or removed behind its back (run/devices/nvme.py)
INTERRUPTED = 130  # Ctrl-C; SIGTERM ends a run with 143 and SIGHUP with 129 (128 + the signal)


class HeteroError(Exception):
    """An error the user can fix: printed as `error: ...` and `hint: ...`, never as a traceback."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = FAILURE):
        super().__init__(message)
        self.message, self.hint, self.exit_code = message, hint, exit_code


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong in a file, located where the user can find it."""

    file: str
    message: str
    line: int | None = None  # 1-based; None when the problem has no place (an unreadable file)
    column: int | None = None  # 1-based

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return f"{where}: {self.message}"


class FileProblems(HeteroError):
    """A file failed validation; carries every problem found, not just the first."""

    def __init__(self, problems: list[Problem], hint: str | None = None):
        assert problems, "FileProblems needs at least one problem"
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"{first}{more}", hint=hint, exit_code=INVALID_FILE)
        self.problems = problems


class Damaged(HeteroError):
    """A file hetero wrote (optimizer states, evicted activations) no longer holds what was written: it was changed,
    cut short or removed by something other than hetero. The run cannot go on without training on wrong numbers,
    so it ends with exit code 6, naming the file and what it held."""

    def __init__(self, message: str, hint: str):
        super().__init__(message, hint=hint, exit_code=DAMAGED)


class Interrupted(BaseException):
    """Ctrl-C, SIGTERM or SIGHUP (hetero.interrupts). A BaseException of our own, so neither a script's
    `except Exception` nor the CLI framework's KeyboardInterrupt handling swallows it; `finally` blocks still clean
    up on the way out. The command exits 128 + the signal's number: 130, 143 or 129."""

    def __init__(self, signum: int = 2):  # SIGINT
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
