"""Transparent huge pages for a process that returns freed memory (the plan's `allocator` section).

Returning freed memory makes each large tensor a mapping of its own, faulted in anew, zeroed, at each allocation: one
fault per 4 KiB page, the cost the profile measures. glibc 2.35+ started with the tunable `glibc.malloc.hugetlb=1`
asks for transparent huge pages on what malloc maps: one fault per 2 MiB where the kernel's THP mode is `madvise` or
`always`. The tunable is read at process start, so hetero sets it in the environment of the processes it starts to
return memory and `hetero run` starts itself again with it (hetero.launch.launcher). No torch: the profile's small
parent imports this.
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
