"""torchrun as hetero starts it (`python -m hetero.launch.torchrun TORCHRUN-ARGS -m hetero.launch.worker SCRIPT ...`):
torch's own launcher (`torch.distributed.run`), quiet about failures that hetero reports itself, and tied to hetero.

- It ends when hetero ends (parent-death signal: SIGTERM, which stops its workers); its workers do the same
  towards it (hetero.launch.worker).
- A failed worker is torchrun's ChildFailedError: instead of its traceback, each failed rank's exit code goes into
  the exit directory (HETERO_EXIT_DIR) where the worker could not leave it (`os._exit`, a signal; such a rank
  counts as the first to fail), and hetero prints one line per failed rank (report_failures).
- SIGTERM/SIGINT/SIGHUP (forwarded by hetero) stop the workers as torchrun does, then exit 128 + the signal.

The exit directory holds `rank<N>`, one line: `<time ns> <exit code> <last line of the error>`, and
`rank<N>.traceback`, the script's traceback where it raised: hetero prints the first failed rank's, once.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hetero.interrupts import die_with_parent

EXIT_DIR_ENV = "HETERO_EXIT_DIR"


def write_exit(directory: str | os.PathLike, rank: int, code: int, message: str = "", at_ns: int | None = None,
               replace: bool = True) -> None:
    """Leave `rank`'s exit code and the last line of its error (one line, cut to 300 characters)."""
    path = Path(directory, f"rank{rank}")
    if not replace and path.exists():
        return
    line = " ".join(message.split())[:300]
    path.write_text(f"{time.time_ns() if at_ns is None else at_ns} {code} {line}".rstrip() + "\n")


TRACEBACK = ".traceback"  # suffix of a rank's traceback file


def write_traceback(directory: str | os.PathLike, rank: int, text: str) -> None:
    Path(directory, f"rank{rank}{TRACEBACK}").write_text(text)


def traceback_of(exits: Path, rank: int) -> str:
    """The traceback `rank` left; "" if none."""
    try:
        return Path(exits, f"rank{rank}{TRACEBACK}").read_text()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class Failure:
    rank: int
    code: int
    message: str  # the last line of its error; "" if it printed none
    at_ns: int


def failures(exits: Path) -> list[Failure]:
    """The ranks that ended with a nonzero code, first to end first; a file cut short (killed mid-write) is skipped."""
    out = []
    for f in exits.iterdir():
        if f.name.endswith(TRACEBACK) or not f.is_file():
            continue
        try:
            at, code, *message = f.read_text().split(" ", 2)
            failure = Failure(int(f.name.removeprefix("rank")), int(code), " ".join(message).strip(), int(at))
        except ValueError:
            continue
        if failure.code != 0:
            out.append(failure)
    return sorted(out, key=lambda f: (f.at_ns, f.rank))


def first_failure(exits: Path) -> int | None:
    """The exit code of the worker that ended first with one."""
    failed = failures(exits)
    return failed[0].code if failed else None


def report_failures(failed: list[Failure]) -> list[str]:
    """One line per failed rank, the first first: its exit code and the last line of its error."""
    return [f"rank {f.rank} exited with {f.code}"
            + (f" (after rank {failed[0].rank} failed)" if i and f.code in (143, 129, 130) else "")
            + (f": {f.message}" if f.message else "") for i, f in enumerate(failed)]


PARENT_ENV = "HETERO_PARENT_PID"  # hetero's pid: torchrun ends at once if hetero ended before it started


def main(argv: list[str]) -> int:
    die_with_parent(int(os.environ[PARENT_ENV]) if os.environ.get(PARENT_ENV) else None)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # hetero says what failed, once
    # torchrun makes a `torchelastic_*` log directory in the temp directory and never removes it: give it one inside
    # the run's exit directory (a work directory hetero removes, and sweeps after a kill), else one removed here.
    exits = os.environ.get(EXIT_DIR_ENV)
    logs = os.path.join(exits, "torchrun") if exits else tempfile.mkdtemp(prefix="hetero-torchrun-")
    if not any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv):
        argv = ["--log-dir", logs, *argv]
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        for rank, failure in e.failures.items() if exits else ():
            code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode  # -9: killed by SIGKILL
            # No file of its own: it died abruptly (os._exit, a signal), a moment torchrun only knows to the second it
            # noticed. Such a rank is taken to have failed first: its peers' errors (closed connections) follow from it.
            write_exit(exits, rank, code, _signal_note(failure.exitcode), at_ns=0, replace=False)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return 0


def _signal_note(exitcode: int) -> str:
    if exitcode >= 0:
        return ""
    import signal

    try:
        return f"killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"killed by signal {-exitcode}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
