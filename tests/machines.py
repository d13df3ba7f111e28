"""A `--machine` file for tests that run `hetero profile` in a process of its own (a memory cgroup, torchrun's
workers), where the bundled_machine fixture cannot reach: measuring the machine takes ~10 s here and no such test
looks at it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hetero.schema import files
from hetero.schema.profile import Profile

REPO = Path(__file__).resolve().parents[1]


def this_machine(folder: Path) -> Path:
    """The bundled profile with this machine's identity and its disk tier in `folder`, written there."""
    from hetero.profile import machine
    from hetero.run.devices import workdir

    profile = files.load(REPO / "plans/gpt-tiny-cpu.profile.yaml", expect=Profile)
    m = profile.machine
    tiers = [replace(t, path=str(folder)) if t.kind == "nvme" else t for t in m.tiers]
    profile.machine = replace(m, host=workdir.host(), cpu=replace(m.cpu, model=machine.cpu_model(),
                                                                  cores=machine.cores()),
                              numa=machine.numa_nodes(), tiers=tiers)
    files.save(profile, folder / "machine.yaml")
    return folder / "machine.yaml"
