"""`hetero profile` under a memory limit the kernel enforces: a profile the limit kills is said in one line.

The limit's killer sends SIGKILL: no Python code runs. So under a limit `hetero profile` forks before it imports
torch. The child profiles and reports each phase it reaches down a pipe (`Phases`); the parent execs this module
(`python -m hetero.launch.guard`), a bare interpreter, so that no shared pages are copied and charged to the cgroup.
The waiter waits for the child and, where the limit's killer ended it (the cgroup's OOM-kill count grew), says so:
killed while training held as little as the profile makes it (every block recomputed), the floor (exit 2, as
`hetero plan` refuses a budget below it); anywhere else, where (exit 1). It removes the work directories the child
left. Any other end is passed on: the child's exit code, or 128 + the signal that ended it.

Signals: the child stays in the terminal's process group, so Ctrl-C or a hangup reaches it directly; SIGINT,
SIGTERM and SIGHUP a process sends the waiter are passed on (`wait`). The child dies with the waiter. The waiter
is inside the profile's headroom (hetero.plan.policy.MemoryPolicy.profile_headroom).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass, replace

from hetero.profile import phases

WAIT_POLL_S = 0.05  # how often the waiter looks whether the child ended, between signals
FIRST_STEP = "first step"  # the phase until the child reports one: its first forward has not reached a block


class Phases:
    """The child's side of the pipe: a line per phase the profile reaches, and every report of what its training
    holds (hetero.profile.phases.RECOMPUTED and MOVED). A few lines in all: the waiter reads the pipe only after the
    child ended, so it must never fill."""

    def __init__(self, fd: int):
        self.fd = fd
        self.last: str | None = None

    def reached(self, phase: str, done: int, total: int) -> None:
        if phase != self.last or phase in (phases.RECOMPUTED, phases.MOVED):
            self.last = phase
            with contextlib.suppress(BrokenPipeError):  # the waiter is gone: its SIGTERM ends this process next
                os.write(self.fd, f"{phase}\t{done}\t{total}\n".encode())


@dataclass(frozen=True, slots=True)
class Reached:
    """What the waiter read from the pipe: the last phase, and what the training held when last reported."""

    phase: str = FIRST_STEP
    recomputed: tuple[int, int] | None = None  # (blocks recomputed, blocks), as last decided
    moved: bool = False  # the optimizer's states and gradients were on NVMe

    @property
    def least(self) -> bool:
        """Whether the training held as little as the profile makes it: every repeated block recomputed."""
        return self.recomputed is None or self.recomputed[0] == self.recomputed[1]


def needed() -> bool:
    """Whether `hetero profile` runs where a memory limit can kill it: one process (torchrun workers are each
    watched by torchrun and reported by hetero.launch.torchrun) in a memory cgroup with a limit."""
    from hetero.run import process_memory

    return os.environ.get("WORLD_SIZE", "1") == "1" and process_memory.memory_limit_bytes() is not None


def fork(script: str, nvme_dir: str | None) -> Phases:
    """Fork: in the child, return its `Phases`; the parent becomes the waiter and never returns."""
    from hetero import interrupts
    from hetero.run import process_memory

    limit = process_memory.memory_limit_bytes()
    before = process_memory.oom_kills()
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.close(read)
        interrupts.die_with_parent(parent)
        return Phases(write)
    os.close(write)
    os.set_inheritable(read, True)
    os.execv(sys.executable, [sys.executable, "-m", "hetero.launch.guard", str(child), str(read),
                              "-" if before is None else str(before), str(limit or 0), script, nvme_dir or "-"])
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class Ended:
    """How `hetero profile` ends after its child did: the exit code, and the error and hint to print (None: the
    child said what there was to say)."""

    exit_code: int
    message: str | None = None
    hint: str | None = None


def verdict(exit_code: int, oom_before: int | None, oom_after: int | None, reached: Reached, limit_bytes: int,
            script: str) -> Ended:
    """`exit_code`: the child's, as a shell reports it (137: SIGKILL). Killed by the memory limit (SIGKILL, and the
    OOM-kill count grew, or could not be read) while it trained holding as little as it could: the floor, as
    `hetero plan` refuses a budget below it (exit 2); anywhere else: where (exit 1)."""
    from hetero.errors import FAILURE, USAGE
    from hetero.units import SIZE

    killed = exit_code == 128 + signal.SIGKILL and (oom_before is None or oom_after is None or oom_after > oom_before)
    if not killed:
        return Ended(exit_code)
    limit = SIZE.format_short(limit_bytes)
    training = reached.phase == FIRST_STEP or reached.phase in phases.TRAINING
    if training and reached.least:
        held = ["every repeated block recomputed"] if reached.recomputed is not None else []
        held.append("Adam's states and gradients on NVMe" if reached.moved else
                    "the optimizer's states left in memory, where the profile found them to fit")
        return Ended(USAGE, (
            f"below the floor: the least training of {script} needs more than the {limit} memory limit, which killed "
            f"it as the profile ran it holding as little as it could ({', '.join(held)}); no profile written"),
            hint="raise the memory limit, or train a smaller model or batch (a profile taken outside the limit and "
                 f"`hetero plan --dram-budget {limit}` name the least any plan needs)")
    where = f"training, {reached.recomputed[0]} of {reached.recomputed[1]} repeated blocks recomputed" \
        if training else reached.phase
    return Ended(FAILURE, f"the {limit} memory limit killed hetero profile of {script} in its {where}; no profile "
                          "written",
                 hint=f"profile outside the limit and plan with `hetero plan --dram-budget {limit}`, and report "
                      "this: the profile keeps its budget by design")


def read(fd: int) -> Reached:
    """What the child wrote before it ended (a descendant of it that still holds the pipe open adds nothing)."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    out = Reached()
    for line in data.decode(errors="replace").splitlines():
        phase, done, total = line.rsplit("\t", 2)
        out = replace(out, phase=phase)
        if phase == phases.RECOMPUTED:
            out = replace(out, recomputed=(int(done), int(total)))
        elif phase == phases.MOVED:
            out = replace(out, moved=True)
    return out


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def wait(child: int) -> int:
    """The child's wait status, once it ended. Meanwhile each of `FORWARDED` sent to the waiter by a process (kill,
    a scheduler: si_code <= 0) is passed on to the child; one the kernel sent (a terminal's Ctrl-C or hangup, to the
    whole foreground process group: si_code > 0) reached the child too, and is not sent twice."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        while True:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                return status
            info = signal.sigtimedwait(FORWARDED, WAIT_POLL_S)
            if info is not None and info.si_code <= 0:
                os.kill(child, info.si_signo)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def main(argv: list[str]) -> int:
    child, fd, limit = int(argv[0]), int(argv[1]), int(argv[3])
    before = None if argv[2] == "-" else int(argv[2])
    script, nvme = argv[4], None if argv[5] == "-" else argv[5]
    status = wait(child)
    from hetero.run import process_memory

    code = os.waitstatus_to_exitcode(status)
    ended = verdict(code if code >= 0 else 128 - code, before, process_memory.oom_kills(), read(fd), limit, script)
    if ended.message is not None:
        from hetero.run.devices import workdir

        swept = workdir.sweep_earlier([nvme])
        print(f"error: {ended.message}" + (f"\nhint: {ended.hint}" if ended.hint else ""), file=sys.stderr)
        if swept:
            print(f"hetero: {swept}", file=sys.stderr)
    return ended.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
