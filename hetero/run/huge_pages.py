"""Transparent huge pages for a process that returns freed memory (the plan's `allocator` section).

Returning freed memory makes each large tensor a mapping of its own, whose pages the kernel faults in, zeroed, every
time one is allocated again: with 4 KiB pages that is one fault per 4 KiB, the cost the profile measures for the
section. glibc (2.35 on) asks for transparent huge pages on what its malloc maps when the process starts with the
tunable `glibc.malloc.hugetlb=1`: one fault per 2 MiB where the kernel's THP mode is `madvise` (most
distributions' default) or `always`, and nothing changes where it is `never` or glibc is older. The tunable is read
once, when the process starts: hetero sets it in the environment of the processes it starts to return memory (the
profile's fresh processes, torchrun's workers) and `hetero run` starts itself again with it
(hetero.launch.launcher). Measured: docs/benchmarks.md. No torch: the profile's small parent imports this.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

TUNABLES = "GLIBC_TUNABLES"
SETTING = "glibc.malloc.hugetlb"
WANTED = f"{SETTING}=1"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def env(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to `environ` for a process started with it to ask for huge pages: {} where it asks already, or
    sets the tunable otherwise (the user's choice stays)."""
    tunables = environ.get(TUNABLES, "")
    if any(item.split("=", 1)[0] == SETTING for item in tunables.split(":")):
        return {}
    return {TUNABLES: f"{tunables}:{WANTED}" if tunables else WANTED}


def mode() -> str | None:
    """The kernel's THP mode (`always`, `madvise`, `never`); None where it has none to read."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def in_use(environ: Mapping[str, str]) -> bool:
    """Whether a process started with `environ` gets huge pages from malloc (as far as can be told from outside
    glibc: the tunable set, and a kernel mode that honours it)."""
    return WANTED in environ.get(TUNABLES, "").split(":") and mode() in ("always", "madvise")
