"""The machine section of an earlier profile of this machine, taken instead of measuring it again: `hetero profile
--machine FILE`, or by default the last profile that measured this host (`remembered`, kept in the user's cache by
`remember`; `--measure-machine` measures it again).

What was measured is taken as it stands; what describes the present is read again: available memory and free disk,
the memory cgroup's limit, the NUMA nodes, the links between ranks, the disk tier's directory, and the disk's trips
beside this script's training where its steps timed them. FILE must be of this machine (host, processor, cores,
NUMA nodes, the disk tier's filesystem) and beside the same GPU, or none; a FILE without a host is refused.
"""

from __future__ import annotations

import os
import shutil
from contextlib import suppress
from dataclasses import replace
from pathlib import Path

import torch

from hetero.errors import USAGE, HeteroError
from hetero.profile import machine
from hetero.profile.tier_steps import DiskBeside
from hetero.run import process_memory
from hetero.run.devices import places, workdir
from hetero.schema import files
from hetero.schema.profile import Machine, Peer, Profile, Tier

HINT = "leave out --machine to measure this machine (the profile it writes can then be given to --machine)"


def load(path: str, nvme_dir: str | None) -> Machine:
    """The machine section of the profile at `path`, if it was measured on this machine with its disk tier on the
    filesystem of `nvme_dir` (None: the temp directory); HeteroError otherwise (exit 2; 3 for no valid profile)."""
    known = files.load(path, expect=Profile).machine
    if differ := differences(known, nvme_dir):
        raise HeteroError(f"--machine {path} was measured on another machine: {'; '.join(differ)}", hint=HINT,
                          exit_code=USAGE)
    return known


def differences(known: Machine, nvme_dir: str | None) -> list[str]:
    """How `known` differs from this machine, in words; [] for none."""
    if known.host is None:
        return ["it records no host (written before profiles recorded one)"]
    here = {"host": workdir.host(), "processor": machine.cpu_model(), "cores": machine.cores(),
            "NUMA nodes": [n.node for n in machine.numa_nodes()]}
    there = {"host": known.host, "processor": known.cpu.model, "cores": known.cpu.cores,
             "NUMA nodes": [n.node for n in known.numa]}
    differ = [f"{what} {there[what]}, here {here[what]}" for what in here if here[what] != there[what]]
    disk = next((t for t in known.tiers if t.kind == "nvme" and t.path is not None), None)
    if not differ and disk is not None and _filesystem(Path(disk.path)) != _filesystem(_base(nvme_dir)):
        differ.append(f"its disk tier was measured in {disk.path}, on another filesystem than {_base(nvme_dir)}")
    return differ


def reuse(known: Machine, device: torch.device, nvme_dir: str | None, peers: list[Peer],
          disk_beside: DiskBeside | None) -> Machine:
    """`known` (from `load`) as this profile's machine, its present read again; HeteroError (exit 2) if the model
    is not on the device `known` was measured beside."""
    _check_device(known, device)
    axdimm = known.axdimm
    if axdimm is not None and axdimm.backend == "emulated":
        axdimm = replace(axdimm, channel_capacity_bytes=machine.emulated_channel_capacity(axdimm.channels))
    return replace(known, numa=machine.numa_nodes(), peers=peers, axdimm=axdimm,
                   tiers=[_now(t, nvme_dir, known.cpu.background_slowdown, disk_beside) for t in known.tiers],
                   memory_limit_bytes=process_memory.memory_limit_bytes())


def _now(tier: Tier, nvme_dir: str | None, slowdown: float | None, disk_beside: DiskBeside | None) -> Tier:
    if tier.kind == "dram":
        return replace(tier, capacity_bytes=machine.available_bytes())
    if tier.kind != "nvme":
        return tier
    base = _base(nvme_dir)
    tier = replace(tier, path=str(base), capacity_bytes=shutil.disk_usage(_existing(base)).free)
    if slowdown and disk_beside:  # this script's steps timed the disk beside its own training: those, as measured
        read_cpu, write_cpu, read, write = machine.beside_training(slowdown, disk_beside)
        tier = replace(tier, read_cpu=read_cpu, write_cpu=write_cpu, read_beside_compute=read,
                       write_beside_compute=write)
    return tier


def _check_device(known: Machine, device: torch.device) -> None:
    if device.type == "cuda":
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        if known.gpu is None or known.gpu.uuid != uuid:
            was = "no GPU" if known.gpu is None else f"GPU {known.gpu.name} ({known.gpu.uuid})"
            raise HeteroError(f"--machine: measured beside {was}; the script's model is on GPU {uuid}", hint=HINT,
                              exit_code=USAGE)
    elif known.gpu is not None:
        raise HeteroError(f"--machine: measured beside GPU {known.gpu.name}, whose figures say nothing of a CPU "
                          f"that computes; the script's model is on the {device.type}", hint=HINT, exit_code=USAGE)


def _base(nvme_dir: str | None) -> Path:
    """The disk tier's directory, as the profile's measurements name it."""
    return places.expand(nvme_dir, "--nvme")


def _filesystem(path: Path) -> int:
    return os.stat(_existing(path)).st_dev


def _existing(path: Path) -> Path:
    """`path`, or its nearest existing parent (each run makes and removes the disk tier's directory)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def cache_path() -> Path:
    """Where the last profile that measured this host is kept: `$XDG_CACHE_HOME/hetero`, a file per host and
    `machine.RECORD`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hetero" / f"machine-{workdir.host()}-{machine.RECORD}.profile.yaml"


def remembered(nvme_dir: str | None, device: torch.device) -> Machine | None:
    """The machine `remember` kept for this host, where it is this machine's beside `device`; else None."""
    path = cache_path()
    if not path.is_file():
        return None
    try:
        known = files.load(path, expect=Profile).machine
        _check_device(known, device)
    except HeteroError:  # another machine's, another GPU's, or damaged: measured again
        return None
    return None if differences(known, nvme_dir) else known


def remember(profile: Profile) -> None:
    """Keep `profile` (its machine measured in full) for the next profile on this host, removing earlier records'
    files; nothing where the cache directory cannot be written."""
    path = cache_path()
    with suppress(OSError):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        files.save(profile, path)
        for older in path.parent.glob(f"machine-{workdir.host()}*.profile.yaml"):
            if older != path:
                older.unlink(missing_ok=True)
