"""Private work directories for the files a run writes (evicted activations, NVMe optimizer states).

A run never writes into the base a plan names (`activations.slow_path`, `optimizer.nvme.path`) but into its own
`<base>/hetero-<kind>-<pid>-<host>-<random>` (host: 8 hex digits of a hash of this machine's name; mode 0700):
- made under a hidden name (`mkdtemp`), its `.lock` flocked, then renamed: a sweep only ever sees it locked;
- the base and the way to it must pass hetero.run.devices.places; missing parents are made (0700) and removed
  again, when empty, with the last work directory in them;
- `sweep` removes this machine's directories of this user (mode 0700) whose pid is dead and whose lock it can take;
  `sweep_earlier` runs it at every `hetero run` and `hetero profile` start and says in one line what it found.

Errors are `PlanPathError`s: exit 3, naming the plan field. torch is not imported here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hetero.run.devices.places import PlanPathError, check_place, existing, expand
from hetero.units import SIZE

# evicted activations, optimizer states, `hetero profile`'s disk probe, data-parallel workers' exit codes, and the
# trials `hetero plan` runs a plan in (older hetero's `returned` ones are still swept)
KINDS = ("activations", "states", "profile", "exit", "trial")
# a final name, or (a leading dot) one still being set up: both carry the owner's pid and host
_NAME = re.compile(r"^\.?hetero-(?:activations|states|profile|exit|trial|returned)-(\d+)-([0-9a-f]{8})-")
LOCK = ".lock"  # in every work directory, locked (flock) by its owner for the directory's whole life


@dataclass(slots=True)
class WorkDir:
    path: Path  # the private directory the run writes in
    made: list[Path] = field(default_factory=list)  # parents created for it, outermost first
    lock: int | None = None  # the open, locked `.lock` inside: released when the directory is removed

    def remove(self) -> None:
        """Remove the directory and its files, then the parents this process made while empty; the lock last."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None
        remove_made(self.path.parent)


_made: set[Path] = set()  # directories this process created for work directories and has not removed yet
_made_lock = threading.Lock()


def make_missing(path: Path) -> list[Path]:
    """Create `path` and its missing parents (0700), remembered as this process's; those created, outermost first
    (not one another process made meanwhile). On an OSError what was made is removed again."""
    made: list[Path] = []
    try:
        for p in [p for p in [path, *path.parents] if not p.exists()][::-1]:
            try:
                p.mkdir(mode=0o700)
            except FileExistsError:  # a run beside this one made it meanwhile
                continue
            made.append(p)
            with _made_lock:
                _made.add(p)
    except OSError:
        remove_made(made[-1] if made else path)
        raise
    return made


def remove_made(path: Path) -> None:
    """Remove `path` and the directories above it, innermost first, while this process made them and they are
    empty."""
    for p in [path, *path.parents]:
        with _made_lock:
            if p not in _made:
                return
            try:
                p.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                return
            _made.discard(p)


def remove_parents(made: list[Path]) -> None:
    """Remove the directories in `made` (outermost first) that this process made, innermost first, while empty."""
    if made:
        remove_made(made[-1])


def create(base: str | None, kind: str, field: str) -> WorkDir:
    """A new private, locked directory for `kind` files under the plan's `base` (after sweeping dead runs' ones)."""
    assert kind in KINDS, kind
    root = expand(base, field)
    check_place(existing(root), field)  # nothing is made through a place others control
    try:
        made = make_missing(root)
    except OSError as e:
        raise PlanPathError(field, f"cannot create {root}: {e.strerror}") from None
    try:
        check_place(root, field)  # again, as made: another process may have made it meanwhile
        sweep(root)
        return _new(root, kind, field, made)
    except BaseException:
        remove_parents(made)
        raise


def _new(root: Path, kind: str, field: str, made: list[Path]) -> WorkDir:
    """Made under a hidden name, locked, then renamed: no sweep ever sees it unlocked."""
    name = f"hetero-{kind}-{os.getpid()}-{host()}-"
    lock = None
    try:
        hidden = Path(tempfile.mkdtemp(prefix=f".{name}", dir=root))
    except OSError as e:
        raise PlanPathError(field, f"cannot create a directory in {root}: {e.strerror}") from None
    path = hidden
    try:
        _check_private(hidden, field)
        lock = os.open(hidden / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        final = root / f"{name}{secrets.token_hex(6)}"
        os.rename(hidden, final)  # an unpredictable name: nothing can be waiting there
        path = final
        _check_private(path, field)
    except BaseException as e:
        shutil.rmtree(path, ignore_errors=True)
        if lock is not None:
            os.close(lock)
        if isinstance(e, OSError):
            raise PlanPathError(field, f"cannot set up a directory in {root}: {e.strerror}") from None
        raise
    return WorkDir(path, made, lock)


def _check_private(path: Path, field: str) -> None:
    """What mkdtemp promises, checked without following a link: ours, a directory, 0700."""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        raise PlanPathError(field, f"{path} is not a private directory of this user (mode 0700)")


@dataclass(frozen=True, slots=True)
class Swept:
    """A dead process's work directory, removed."""

    path: Path
    pid: int
    nbytes: int  # what its files held


def sweep(root: Path) -> list[Path]:
    """Remove the work directories in `root` whose owner is gone (see the module's docstring); those removed."""
    return [s.path for s in _sweep(root)]


def _sweep(root: Path) -> list[Swept]:
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
        pid = int(match.group(1))
        if not private or alive(pid):
            continue
        lock = _take_lock(Path(entry.path))
        if lock is False:
            continue  # its owner holds it: alive, somewhere this process cannot see
        try:
            nbytes = _size(Path(entry.path))
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            if lock is not None:
                os.close(lock)
        removed.append(Swept(Path(entry.path), pid, nbytes))
    return removed


def _take_lock(path: Path) -> int | None | bool:
    """The directory's lock taken without waiting (its fd); None: it has no lock file (made before locks were, or
    half removed); False: someone holds it."""
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    return fd


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def sweep_earlier(bases: Iterable[str | None]) -> str | None:
    """Sweep the system temp directory and `bases` (None: the temp directory), skipping bases that cannot be used
    (the command refuses them itself); one line saying what earlier processes left behind, or None."""
    roots: list[Path] = []
    for base in [None, *bases]:
        try:
            root = expand(base, "")
        except PlanPathError:
            continue
        if root.is_dir() and root not in roots:
            roots.append(root)
    if not (swept := [s for root in roots for s in _sweep(root)]):
        return None
    pids = sorted({s.pid for s in swept})
    who = f"an earlier hetero (pid {pids[0]})" if len(pids) == 1 else \
        f"{len(pids)} earlier hetero processes (pids {', '.join(map(str, pids))})"
    places = sorted({str(s.path.parent) for s in swept})
    return (f"{who} ended without cleaning up (killed by SIGKILL or a memory limit, or crashed): removed the "
            f"{len(swept)} work director{'y' if len(swept) == 1 else 'ies'} left in {', '.join(places)} "
            f"({SIZE.format_short(sum(s.nbytes for s in swept))})")


@functools.cache
def host() -> str:
    """This machine, as work directory names carry it: 8 hex digits of a hash of its name."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def alive(pid: int) -> bool:
    """Whether a process `pid` exists in this process's PID namespace (whoever owns it)."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True
