"""Where a plan may put files: base directories checked as ssh checks a key's path (hetero.run.devices.workdir
makes its work directories only in places these checks accept). Errors are `PlanPathError`s: exit 3, naming the plan
field. torch is not imported here."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from hetero.errors import INVALID_FILE, HeteroError


class PlanPathError(HeteroError):
    """A directory the plan names cannot be used. `field` is its YAML path in the plan (`optimizer.nvme.path`)."""

    def __init__(self, field: str, message: str, hint: str):
        super().__init__(f"{field}: {message}", hint=hint, exit_code=INVALID_FILE)
        self.field = field


HINT = "set it to a directory you own on a disk with free space, e.g. ~/hetero-tmp"


def expand(base: str | None, field: str) -> Path:
    """`base` with `~` expanded, made absolute (a script changing its directory cannot move it); the system temp
    directory when None. An empty or blank path is refused."""
    if base is None:
        return Path(tempfile.gettempdir())
    if not base.strip():
        raise PlanPathError(field, "empty path", HINT)
    return Path(os.path.abspath(os.path.expanduser(base)))


def check_place(root: Path, field: str) -> None:
    """The base must be a directory that only we (or root, or our own group) control, or a sticky one like /tmp, and
    so must every directory above it: one that others could rename lets them redirect everything below it."""
    _check_base(root, field)
    # above the path as written (a link in it could be swapped) and above where it leads
    above = dict.fromkeys([*Path(os.path.abspath(root)).parents, *Path(os.path.realpath(root)).parents])
    for parent in above:
        try:
            st = parent.stat()
        except OSError as e:
            raise PlanPathError(field, f"cannot use {root}: {parent}: {e.strerror}", HINT) from None
        unsafe = _unsafe(st)
        if unsafe:
            raise PlanPathError(field, f"{root} is inside {parent}, which {unsafe}: others could rename what is "
                                       "below it away and put their own directories in its place", HINT)


def inspect(base: str | None, field: str) -> None:
    """What `create` would refuse, found without creating anything: the base (or, where it does not exist yet, the
    directory it would be made in) and every directory above it (`hetero check`, and `hetero run` before the
    script starts)."""
    root = expand(base, field)
    existing = next((p for p in [root, *root.parents] if os.path.lexists(p)), Path("/"))
    check_place(existing, field)
    if not os.access(existing, os.W_OK | os.X_OK):
        what = f"create {root}" if existing != root else f"write in {root}"
        raise PlanPathError(field, f"cannot {what}: {existing} is not writable", HINT)


def _check_base(root: Path, field: str) -> None:
    try:
        st = root.stat()
    except OSError as e:
        raise PlanPathError(field, f"cannot use {root}: {e.strerror}", HINT) from None
    if not stat.S_ISDIR(st.st_mode):
        raise PlanPathError(field, f"{root} is not a directory", HINT)
    unsafe = _unsafe(st)
    if unsafe:
        raise PlanPathError(field, f"{root} {unsafe}: others could replace hetero's files", HINT)


def _unsafe(st: os.stat_result) -> str | None:
    """Why others could rename entries of a directory with this stat (ssh's rule for a key's path); None: safe."""
    if st.st_uid not in (os.getuid(), 0):
        return f"belongs to another user (uid {st.st_uid})"
    # Writable by a group other than the user's own (umask 002 makes the user's group-writable dirs) or by all.
    others = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != os.getgid())
    if others and not st.st_mode & stat.S_ISVTX:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o}) and not sticky"
    return None
