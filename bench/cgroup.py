"""Run one command inside a fresh memory cgroup with a hard limit, and say how it ended and what it peaked at.

    .venv/bin/python bench/cgroup.py --limit 1GiB [--purpose NAME] -- COMMAND [ARGS...]

The kernel charges a cgroup with its processes' resident anonymous memory *and* the page cache they bring in (files
read or written without O_DIRECT), and kills a process of it (SIGKILL, exit 137) when reclaim cannot keep it under
`memory.limit_in_bytes` (cgroup v1) or `memory.max` (v2) -- the same death a CUDA out-of-memory brings on a GPU.
Swap is capped too (`memory.memsw.limit_in_bytes`, `memory.swap.max`) so that swapping cannot hide usage.

The cgroup `hetero-<purpose>-<pid>` is made inside the caller's own memory cgroup (so whatever accounts for the
caller still accounts for the child), the child enters it before it execs (a two-line shell shim writes its pid to
`cgroup.procs`), and it is removed afterwards, its remaining processes killed first, even on Ctrl-C. Needs root and
a mounted memory controller; `unavailable()` says in one line why not and what to run instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.units import SIZE, short_size  # noqa: E402

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")
# The shim: join the cgroup, then become the command (exec keeps the pid, so the exit status is the command's).
SHIM = 'echo $$ > "$0" && exec "$@"'
INSTEAD = ("run it as root (sudo -E env PATH=$PATH ...), or cap one command by hand with "
           "`systemd-run --scope -p MemoryMax=SIZE -p MemorySwapMax=0 COMMAND`")


@dataclass(frozen=True)
class Capped:
    """How a command ended under its cgroup: exit code as a shell reports it (137 = SIGKILL), whether the memory
    limit killed it (the cgroup's OOM killer fired), and the cgroup's high-water mark of charged bytes."""

    exit_code: int
    limit_bytes: int | None  # None: no limit, the cgroup only measured
    peak_bytes: int
    oom_killed: bool
    version: int  # 1 or 2: which cgroup interface measured it

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class Layout:
    """Where the cgroup goes and which files mean what in this cgroup version."""

    version: int
    parent: Path
    limit: str
    swap_limit: str | None  # None: no swap accounting (v1 without swapaccount=1): memory counts alone
    peak: str  # the high-water mark's file; v2 before Linux 5.19 has none, and the peak is then sampled


def _own_path(controller: str) -> str:
    """This process's cgroup path in the hierarchy of `controller` ('' selects the unified v2 hierarchy)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller == "" and names == "") or controller in names.split(","):
            return path
    return "/"


def layout() -> Layout | str:
    """The cgroup layout to use, or the reason there is none (one line)."""
    if os.geteuid() != 0:
        return "not root: creating a memory cgroup needs root"
    if (V1_ROOT / "memory.limit_in_bytes").exists() or (V1_ROOT / "cgroup.procs").exists():
        parent = V1_ROOT / _own_path("memory").lstrip("/")
        swap = "memory.memsw.limit_in_bytes" if (parent / "memory.memsw.limit_in_bytes").exists() else None
        return Layout(1, parent, "memory.limit_in_bytes", swap, "memory.max_usage_in_bytes")
    if (V2_ROOT / "cgroup.controllers").exists():
        for parent in (V2_ROOT / _own_path("").lstrip("/"), V2_ROOT):
            # v2's no-internal-processes rule: a child gets the memory controller only where the parent hands it on.
            if "memory" in (parent / "cgroup.subtree_control").read_text().split():
                return Layout(2, parent, "memory.max", "memory.swap.max", "memory.peak")
        return "cgroup v2 without the memory controller enabled for child cgroups (cgroup.subtree_control)"
    return "no memory cgroup controller mounted at /sys/fs/cgroup"


def end_on_sigterm() -> None:
    """Make SIGTERM end this benchmark as Ctrl-C does, through its `finally` blocks: work folders and cgroups are
    removed (by default SIGTERM ends the process at once, and they were left behind)."""
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))


def unavailable() -> str | None:
    """None when `run` can work here; otherwise one line: why not, and what to run instead."""
    found = layout()
    return f"cannot create a memory cgroup ({found}): {INSTEAD}" if isinstance(found, str) else None


def swap_on() -> bool:
    """Whether any swap is active (then only a swap limit keeps the cgroup's usage honest)."""
    return len(Path("/proc/swaps").read_text().splitlines()) > 1


def _read_int(path: Path) -> int:
    text = path.read_text().strip()
    return sys.maxsize if text == "max" else int(text)


def _limit_killed(where: Layout, group: Path, exit_code: int) -> bool:
    """Whether the cgroup's OOM killer killed a process (v1: memory.oom_control, v2: memory.events). v1 kernels
    before 4.13 have no oom_kill count: there, a SIGKILL after the limit was hit (memory.failcnt) counts."""
    name = "memory.oom_control" if where.version == 1 else "memory.events"
    fields = dict(line.split() for line in (group / name).read_text().splitlines())
    if "oom_kill" in fields:
        return int(fields["oom_kill"]) > 0
    return exit_code == 137 and where.version == 1 and _read_int(group / "memory.failcnt") > 0


def _create(where: Layout, purpose: str, limit_bytes: int | None) -> Path:
    group = where.parent / f"hetero-{purpose}-{os.getpid()}"
    group.mkdir()
    if limit_bytes is None:  # measure only: a new cgroup starts unlimited
        return group
    # Memory before memory+swap: v1 refuses a memsw limit below the memory limit, and both start unlimited.
    (group / where.limit).write_text(str(limit_bytes))
    if where.swap_limit:
        (group / where.swap_limit).write_text(str(limit_bytes if where.version == 1 else 0))
    return group


def _remove(group: Path) -> None:
    """Kill what is left in the cgroup, then remove it (rmdir fails while a task remains; retry briefly)."""
    for _ in range(100):
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.05)
    print(f"bench/cgroup.py: could not remove {group}; remove it with: rmdir {group}", file=sys.stderr)


def _exit_code(returncode: int) -> int:
    """A signal death as a shell reports it: SIGKILL -> 137."""
    return 128 - returncode if returncode < 0 else returncode


def run(argv: list[str], limit_bytes: int | None, purpose: str = "run", **popen) -> Capped:
    """Run `argv` to its end in a new cgroup limited to `limit_bytes` (memory and swap together; None: unlimited,
    to measure the peak the kernel counts); `popen` goes to subprocess.Popen (cwd, env, stdout, ...). Raises
    RuntimeError with `unavailable()`'s line where it cannot."""
    where = layout()
    if isinstance(where, str):
        raise RuntimeError(f"cannot create a memory cgroup ({where}): {INSTEAD}")
    group = _create(where, purpose, limit_bytes)
    peak_file = group / where.peak if (group / where.peak).exists() else None
    peak_sampled = 0
    try:
        child = subprocess.Popen(["/bin/sh", "-c", SHIM, str(group / "cgroup.procs"), *argv], **popen)
        try:
            while child.poll() is None:
                if peak_file is None:
                    peak_sampled = max(peak_sampled, _read_int(group / "memory.current"))
                try:
                    child.wait(timeout=0.02 if peak_file is None else None)
                except subprocess.TimeoutExpired:
                    pass
        except BaseException:
            child.kill()
            child.wait()
            raise
        peak = _read_int(peak_file) if peak_file else peak_sampled
        code = _exit_code(child.returncode)
        return Capped(code, limit_bytes, peak, _limit_killed(where, group, code), where.version)
    finally:
        _remove(group)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", required=True, help="memory limit, e.g. 1GiB, 800MiB; none: only measure the peak")
    parser.add_argument("--purpose", default="cli", help="part of the cgroup's name")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    reason = unavailable()
    if reason:
        print(f"bench/cgroup.py: {reason}", file=sys.stderr)
        return 2
    try:
        result = run(command, None if args.limit == "none" else SIZE.parse(args.limit), args.purpose)
    except KeyboardInterrupt:  # the cgroup is gone already (run's finally); the child had its own SIGINT
        return 130
    killed = " (killed by the memory limit)" if result.oom_killed else ""
    limit = short_size(result.limit_bytes) if result.limit_bytes is not None else "no limit"
    print(f"bench/cgroup.py: exit {result.exit_code}{killed}, peak {short_size(result.peak_bytes)} of {limit}, "
          f"cgroup v{result.version}, swap {'on' if swap_on() else 'off'}", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
