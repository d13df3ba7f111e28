"""Private work directories for the files a run writes (evicted activations, NVMe optimizer states).

A plan names a base directory (`activations.slow_path`, `optimizer.nvme.path`); a run never writes into it
directly but into a directory of its own made inside it:

    <base>/hetero-<kind>-<pid>-<host>-<random>   kind: activations | states | profile | exit
                                                 host: 8 hex digits of a hash of this machine's name
                                                 mode 0700, owned by the user

Contracts:
- The name is unpredictable and the directory is made with `tempfile.mkdtemp` (an exclusive mkdir, mode 0700):
  a directory someone else created beforehand is never used. The base itself must be the user's (or root's), and
  if others may write in it, sticky like /tmp, so nobody else can rename our directory away and put theirs in its
  place (writable by the user's own group is fine: umask 002 makes such directories).
- `~` is expanded; an empty base is refused. Parents of the base that did not exist are created (0700) and removed
  again with the work directory when empty.
- The pid and host in the name are the owning process and its machine. `sweep` removes the work directories of this
  machine's processes that are gone (a run killed with SIGKILL, or one that called `os._exit`), but only those of
  this user with mode 0700; every run sweeps its base before making its own. A directory shared between machines
  never loses a live run's files to another machine's sweep.

Errors are `PlanPathError`s: exit 3, naming the plan field, which the launcher turns into the plan's file:line.
torch is not imported here.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hetero.errors import INVALID_FILE, HeteroError

# evicted activations, optimizer states, `hetero profile`'s disk probe, data-parallel workers' exit codes
KINDS = ("activations", "states", "profile", "exit")
_NAME = re.compile(r"^hetero-(?:activations|states|profile|exit)-(\d+)-([0-9a-f]{8})-")


class PlanPathError(HeteroError):
    """A directory the plan names cannot be used. `field` is its YAML path in the plan (`optimizer.nvme.path`)."""

    def __init__(self, field: str, message: str, hint: str):
        super().__init__(f"{field}: {message}", hint=hint, exit_code=INVALID_FILE)
        self.field = field


@dataclass(slots=True)
class WorkDir:
    path: Path  # the private directory the run writes in
    made: list[Path] = field(default_factory=list)  # parents created for it, outermost first

    def remove(self) -> None:
        """Remove the directory with whatever is still in it, then the parents made for it while they are empty."""
        shutil.rmtree(self.path, ignore_errors=True)
        remove_parents(self.made)


def remove_parents(made: list[Path]) -> None:
    """Remove the directories in `made` (outermost first) innermost first, stopping at the first one not empty."""
    for parent in reversed(made):
        try:
            parent.rmdir()
        except OSError:  # someone else put files there meanwhile: leave it, and them
            return


def create(base: str | None, kind: str, field: str) -> WorkDir:
    """A new private directory for `kind` files under the plan's `base` (after sweeping dead runs' ones there)."""
    assert kind in KINDS, kind
    root = expand(base, field)
    made = _make_parents(root, field)
    try:
        _check_base(root, field)
        sweep(root)
        try:
            path = Path(tempfile.mkdtemp(prefix=f"hetero-{kind}-{os.getpid()}-{host()}-", dir=root))
        except OSError as e:
            raise PlanPathError(field, f"cannot create a directory in {root}: {e.strerror}", HINT) from None
        _check_private(path, field)
    except BaseException:
        remove_parents(made)
        raise
    return WorkDir(path, made)


HINT = "set it to a directory you own on a disk with free space, e.g. ~/hetero-tmp"


def expand(base: str | None, field: str) -> Path:
    """`base` with `~` expanded; the system temp directory when None. An empty or blank path is refused."""
    if base is None:
        return Path(tempfile.gettempdir())
    if not base.strip():
        raise PlanPathError(field, "empty path", HINT)
    return Path(os.path.expanduser(base))


def _make_parents(root: Path, field: str) -> list[Path]:
    missing = [p for p in [root, *root.parents] if not p.exists()][::-1]
    made: list[Path] = []
    try:
        for path in missing:
            try:
                path.mkdir(mode=0o700)
            except FileExistsError:  # a run beside this one made it meanwhile: it is not ours to remove
                continue
            made.append(path)
    except OSError as e:
        remove_parents(made)
        raise PlanPathError(field, f"cannot create {root}: {e.strerror}", HINT) from None
    return made


def _check_base(root: Path, field: str) -> None:
    """The base must be a directory that only we (or root, or our own group) control, or a sticky one like /tmp."""
    try:
        st = root.stat()
    except OSError as e:
        raise PlanPathError(field, f"cannot use {root}: {e.strerror}", HINT) from None
    if not stat.S_ISDIR(st.st_mode):
        raise PlanPathError(field, f"{root} is not a directory", HINT)
    if st.st_uid not in (os.getuid(), 0):
        raise PlanPathError(field, f"{root} belongs to another user (uid {st.st_uid})", HINT)
    # Writable by a group other than the user's own (umask 002 makes the user's group-writable dirs) or by all.
    others = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != os.getgid())
    if others and not st.st_mode & stat.S_ISVTX:
        raise PlanPathError(field, f"others may write in {root} (mode {stat.S_IMODE(st.st_mode):04o}) and it is "
                                   "not sticky: they could replace hetero's files", HINT)


def _check_private(path: Path, field: str) -> None:
    """What mkdtemp promises, checked without following a link: ours, a directory, 0700."""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        raise PlanPathError(field, f"{path} is not a private directory of this user (mode 0700)", HINT)


def sweep(root: Path) -> list[Path]:
    """Remove the work directories in `root` whose owning process is gone; those removed.

    Only directories named by `create`, owned by this user and of mode 0700 are touched; a live pid (also one reused
    by an unrelated process) keeps its directory."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid() or match.group(2) != host():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        private = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        if private and not alive(int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


@functools.cache
def host() -> str:
    """This machine, as work directory names carry it: 8 hex digits of a hash of its name."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def alive(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True
