"""Where a plan may put files: base directories checked as ssh checks a key's path (hetero.run.devices.workdir
makes its work directories only in places these checks accept). Errors are `PlanPathError`s: exit 3, naming the plan
field. torch is not imported here."""

from __future__ import annotations

import functools
import grp
import os
import pwd
import stat
import tempfile
from pathlib import Path

from hetero.errors import INVALID_FILE, HeteroError

HINT = "set it to a directory you own on a disk with free space, e.g. ~/hetero-tmp"


class PlanPathError(HeteroError):
    """A directory the plan names cannot be used. `field` is its YAML path in the plan (`optimizer.nvme.path`)."""

    def __init__(self, field: str, message: str, hint: str = HINT):
        super().__init__(f"{field}: {message}", hint=hint, exit_code=INVALID_FILE)
        self.field = field


def expand(base: str | None, field: str) -> Path:
    """`base` with `~` expanded, made absolute (a script changing its directory cannot move it); the system temp
    directory when None. An empty or blank path is refused."""
    if base is None:
        return Path(tempfile.gettempdir())
    if not base.strip():
        raise PlanPathError(field, "empty path")
    return Path(os.path.abspath(os.path.expanduser(base)))


def check_place(root: Path, field: str) -> None:
    """ssh's rule for a key's path: the base is a directory on a file system that holds files (not /proc), and it
    and every directory on the way to it only we or root control (or sticky, like /tmp); every link on that way is
    ours or root's. Otherwise others could redirect everything below it."""
    _check_base(root, field)
    kind = file_system(root)
    if kind in PSEUDO:
        raise PlanPathError(field, f"{root} is on a kernel pseudo file system ({kind}), not on a disk")
    for entry, st in way(root, field):
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (os.getuid(), 0):
                raise PlanPathError(field, f"{root} leads through {entry}, a link of another user (uid {st.st_uid}): "
                                           "they could point it elsewhere")
            continue
        if unsafe := _unsafe(st):
            raise PlanPathError(field, f"{root} is inside {entry}, which {unsafe}: others could rename what is "
                                       "below it away and put their own directories in its place")


def existing(root: Path) -> Path:
    """The deepest of `root` and the directories above it that exists (a link counts, even a dangling one)."""
    return next((p for p in [root, *root.parents] if os.path.lexists(p)), Path("/"))


def inspect(base: str | None, field: str) -> None:
    """What `create` would refuse, found without creating anything: the base (or, where it does not exist yet, the
    directory it would be made in) and every directory above it (`hetero check`; `hetero run` before its script)."""
    root = expand(base, field)
    found = existing(root)
    check_place(found, field)
    if not os.access(found, os.W_OK | os.X_OK):
        what = f"create {root}" if found != root else f"write in {root}"
        raise PlanPathError(field, f"cannot {what}: {found} is not writable")


MAX_LINKS = 40  # links followed in resolving one path, as Linux allows


def way(root: Path, field: str) -> list[tuple[Path, os.stat_result]]:
    """Every directory a name is looked up in and every link followed while the kernel resolves `root`, each with
    its `lstat`; not the directory it ends at."""
    met: dict[Path, os.stat_result] = {}
    here, todo, links = Path("/"), list(Path(os.path.abspath(root)).parts[1:]), 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            here = here.parent
            continue
        entry = here / part
        try:
            if here not in met:
                met[here] = os.lstat(here)
            st = os.lstat(entry)
            if not stat.S_ISLNK(st.st_mode):
                here = entry
                continue
            links += 1
            target = os.readlink(entry)
        except OSError as e:
            raise PlanPathError(field, f"cannot use {root}: {entry}: {e.strerror}") from None
        if links > MAX_LINKS:
            raise PlanPathError(field, f"cannot use {root}: more than {MAX_LINKS} links on the way")
        met[entry] = st
        if os.path.isabs(target):
            here = Path("/")
        todo[:0] = [p for p in Path(target).parts if p != "/"]
    return list(met.items())


# Kernel file systems that show the kernel's state rather than keep files (a tmpfs or a ramfs does keep them).
PSEUDO = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
                    "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs", "binfmt_misc", "autofs",
                    "efivarfs", "selinuxfs", "nsfs", "rpc_pipefs"})


def file_system(path: Path) -> str | None:
    """The type of the file system `path` is on (`ext4`, `proc`), from the mount of its device in /proc/self/mountinfo;
    None where that cannot be told (no such file: not Linux; a device no mount names, as a btrfs subvolume's)."""
    try:
        dev = os.stat(path).st_dev
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    for fields in (line.split() for line in reversed(lines)):  # the last mount of a device is the one on top
        # ID, parent, major:minor, root, mount point, options, optional fields, "-", type, source, super options
        if len(fields) > 8 and fields[2] == wanted and "-" in fields[6:]:
            return fields[fields.index("-", 6) + 1]
    return None


def _check_base(root: Path, field: str) -> None:
    try:
        st = root.stat()
    except OSError as e:
        raise PlanPathError(field, f"cannot use {root}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise PlanPathError(field, f"{root} is not a directory")
    if unsafe := _unsafe(st):
        raise PlanPathError(field, f"{root} {unsafe}: others could replace hetero's files")


def _unsafe(st: os.stat_result) -> str | None:
    """Why others could rename entries of a directory with this stat (ssh's rule for a key's path); None: safe."""
    if st.st_uid not in (os.getuid(), 0):
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & stat.S_ISVTX:  # as /tmp: only an entry's owner may rename it
        return None
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & stat.S_IWOTH:
        return f"is writable by others (mode {mode:04o}) and not sticky"
    if st.st_mode & stat.S_IWGRP and not group_is_mine(st.st_gid):
        return f"is writable by group {st.st_gid}, which is not yours alone (mode {mode:04o}), and not sticky"
    return None


def group_is_mine(gid: int) -> bool:
    """Whether group `gid` is this user's alone, as ssh allows a group-writable path: this process has it, and no
    other user is in it, as a listed member or by having it as primary group."""
    return (gid == os.getegid() or gid in os.getgroups()) and group_users(gid) <= {os.getuid()}


@functools.cache
def group_users(gid: int) -> frozenset[int]:
    """The uids of the users in group `gid`: those it lists (an unknown name counts as uid -1, someone else) and
    those whose primary group it is (reading the whole user database: cached)."""
    try:
        listed = grp.getgrgid(gid).gr_mem
    except KeyError:  # a group with no entry: only its users' primary groups can bring anyone in
        listed = []
    uids = set()
    for name in listed:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            uids.add(-1)
    return frozenset(uids | {p.pw_uid for p in pwd.getpwall() if p.pw_gid == gid})
