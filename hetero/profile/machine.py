"""Measure the machine: CPU and memory bandwidth, NUMA nodes, memory tiers with transfer-time curves, the GPU and
its PCIe link, and the (emulated) AXDIMM. What cannot be measured is null, with the reason in `unmeasured`. Every
timing is the median of several repeats on buffers allocated and touched beforehand.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hetero.errors import USAGE, HeteroError
from hetero.profile import dha, host_costs
from hetero.profile.tier_steps import DiskBeside
from hetero.profile.timing import beside_compute, median_time, share
from hetero.profile.updates import (
    UPDATE_SIZES,
    host_adam,
    host_adam_beyond_cache,
    measured_or_none,
    time_updates,
    update_job,
)
from hetero.run import process_memory
from hetero.run.devices import workdir
from hetero.run.devices.axdimm import EmulatedAxdimm
from hetero.run.states import AxdimmHome, ChannelDriver
from hetero.schema.profile import Axdimm, Cpu, CurvePoint, Gpu, Layer, Machine, NumaNode, Pcie, Peer, Tier
from hetero.units import measured

KiB, MiB, GiB = 2**10, 2**20, 2**30
HOST_SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB)
BESIDE_SIZES = (64 * KiB, MiB, 4 * MiB, 16 * MiB)  # disk trips timed beside compute: sizes of the tensors moved
GPU_SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB)
NVME_TIER = "nvme0"  # the disk tier's name in profiles
DEFAULT_BYTES = 640 * MiB  # what the measurements hold at most with their default sizes (the copy's 2 x 256 MiB)
BEYOND_CACHE = 4  # host Adam's rate beyond the caches is timed on states this many times the last-level cache
BEYOND_BYTES = 512 * MiB  # those states at most (and where no cache is reported): with a gradient, DEFAULT_BYTES
CPU_SYS = Path("/sys/devices/system/cpu")
# What `measure` records: raised whenever it records something new, so a remembered machine is measured again
RECORD = 2


def measure(device: torch.device, nvme_dir: str | None, progress: Callable | None = None,
            peers: list[Peer] | None = None, disk_beside: DiskBeside | None = None,
            room_bytes: int | None = None) -> Machine:
    """The machine as seen from `device` (the model's); `peers`: the links between ranks; `disk_beside`: the disk
    timed beside the script's training; `room_bytes`: host memory a budget leaves the measurements (None: no budget)."""
    report = functools.partial(progress or (lambda *a: None), "machine")  # (done, total) of cpu, gpu, tiers, axdimm
    largest = largest_buffer(room_bytes)
    report(0, 4)
    cpu = measure_cpu(gpu=device.type == "cuda", copy_bytes=copy_size(room_bytes), largest=largest,
                      beyond_bytes=BEYOND_BYTES if room_bytes is None else largest)
    report(1, 4)
    gpu = measure_gpu(device) if device.type == "cuda" else None
    report(2, 4)
    tiers = measure_tiers(gpu, device, nvme_dir, cpu.background_slowdown, disk_beside, largest)
    report(3, 4)
    axdimm = measure_axdimm(sizes=update_sizes(largest), slowdown=cpu.background_slowdown)
    report(4, 4)
    return Machine(cpu=cpu, numa=numa_nodes(), gpu=gpu, tiers=tiers, axdimm=axdimm, peers=peers or [],
                   memory_limit_bytes=process_memory.memory_limit_bytes(), host=workdir.host())


def unmeasured(device: torch.device, layers: list[Layer] = (), tiers: list[Tier] = (),
               cpu: Cpu | None = None) -> dict[str, str]:
    """Why the profile's null fields are null here (`layers`, `tiers`, `cpu`: as measured, to name those left
    null)."""
    memory = [t for t in tiers if t.path is None and (t.read or t.write)]
    beyond = cpu is not None and cpu.adam_beyond_cache_params_per_s is not None  # measured by this hetero
    cache = {"machine.cpu.last_level_cache": NO_CACHE} if beyond and cpu.last_level_cache_bytes is None else {}
    sides = ("read_cpu", "write_cpu", "read_beside_compute", "write_beside_compute")
    copies = {f"machine.tiers.{t.name}.{f}": MEMORY_COPY_CPU if f.endswith("_cpu") else MEMORY_BESIDE
              for t in memory for f in sides if not getattr(t, f)}
    disk = {f"machine.tiers.{t.name}.{f}": ON_GPU for t in tiers if t.path is not None
            for f in sides if not getattr(t, f)}
    if device.type != "cuda":
        gone = "needs a CUDA device; the model trains on the CPU"
        return {"machine.gpu": "no CUDA device in use", "layers.*.fp_dha": gone, "layers.*.bp_dha": gone,
                "layers.*.bp_grad_host": gone} | copies | cache
    on_gpu = {f"machine.{f}": ON_GPU for f in ("cpu.background_slowdown", "cpu.adam_cpu", "cpu.adam_beside_compute",
                                                "cpu.adam_launch_beside_compute", "axdimm.cpu",
                                                "axdimm.adam_beside_compute", "axdimm.launch_beside_compute")}
    return on_gpu | copies | disk | cache | dha.unmeasured(list(layers))


ON_GPU = "the model computes on the GPU: host worker threads do not take its cores"
NO_CACHE = (f"{CPU_SYS}/cpu*/cache reports no cache sizes: host Adam's rate beyond the caches was timed on up to "
            f"{BEYOND_BYTES // MiB} MiB of states and holds for every model")
MEMORY_COPY_CPU = "a copy within memory is a streaming worker: planned as 1"
MEMORY_BESIDE = "copies within memory are not measured beside compute: planned as 1"


# -- host ----------------------------------------------------------------------------------------------------------


def copy_size(room_bytes: int | None) -> int:
    """The bandwidth copy's buffer: 256 MiB, or under a budget a quarter of the room it leaves (the copy holds two
    buffers), at least 16 MiB: larger than any last-level cache, so still a DRAM-to-DRAM copy."""
    return 256 * MiB if room_bytes is None else max(16 * MiB, min(256 * MiB, room_bytes // 4 // MiB * MiB))


def largest_buffer(room_bytes: int | None) -> int:
    """The largest buffer a measurement of the host, the disk and the updates allocates: 64 MiB, or under a budget
    an eighth of the room it leaves (each holds a few at once), at least 4 MiB."""
    if room_bytes is None:
        return 64 * MiB
    return max(4 * MiB, min(64 * MiB, 1 << max(0, (room_bytes // 8).bit_length() - 1)))


def update_sizes(largest: int) -> tuple[int, int]:
    """Parameters of the small and the large timed update: the large one's `largest` bytes hold 16 B per parameter
    (fp32 master, m, v and a gradient), at most UPDATE_SIZES' 4M parameters."""
    return UPDATE_SIZES[0], max(16 * UPDATE_SIZES[0], min(UPDATE_SIZES[1], largest // 16 // 4096 * 4096))


def measure_cpu(gpu: bool = False, copy_bytes: int = 256 * MiB, largest: int = 64 * MiB,
                beyond_bytes: int = BEYOND_BYTES) -> Cpu:
    """`gpu`: the model computes on a GPU, so how host threads slow compute on the cores is not measured;
    `beyond_bytes`: the most states host Adam's update beyond the caches may hold (`beyond_cache_params`)."""
    slowdown = None if gpu else measured(background_slowdown(min(32 * MiB, largest // 2)))
    adam = host_adam(slowdown, update_sizes(largest))
    cache = last_level_cache_bytes()
    beyond = host_adam_beyond_cache(beyond_cache_params(cache, beyond_bytes), adam.launch_s)
    return Cpu(model=cpu_model(), cores=cores(),
               dram_bandwidth_bytes_per_s=measured(copy_bandwidth(copy_bytes)), adam_params_per_s=measured(adam.rate),
               adam_launch_s=measured(adam.launch_s), adam_beyond_cache_params_per_s=measured(beyond),
               last_level_cache_bytes=cache, background_slowdown=slowdown, adam_cpu=adam.cpu,
               adam_beside_compute_params_per_s=measured_or_none(adam.beside_rate),
               adam_launch_beside_compute_s=measured_or_none(adam.beside_launch_s),
               hook_pair_s=measured(host_costs.hook_pair_s()), saved_tensor_s=measured(host_costs.saved_tensor_s()))


def beyond_cache_params(cache_bytes: int | None, most_bytes: int) -> int:
    """Parameters of host Adam's update timed beyond the caches: states (16 B/param: master copy, m, v, gradient)
    of BEYOND_CACHE times the last-level cache, or `most_bytes` where that is less or no cache is reported."""
    states = most_bytes if cache_bytes is None else min(most_bytes, BEYOND_CACHE * cache_bytes)
    return max(UPDATE_SIZES[0], states // 16 // 4096 * 4096)


def last_level_cache_bytes(cpus: set[int] | None = None, root: Path = CPU_SYS) -> int | None:
    """The last-level caches of `cpus` (None: the cores this process may run on), summed over distinct caches (one
    shared by several cores counts once), as `root` (/sys) reports them; None where it reports none."""
    caches: dict[tuple[int, str], int] = {}  # (level, the cores that share it): bytes
    for cpu in sorted(os.sched_getaffinity(0) if cpus is None else cpus):
        for index in (root / f"cpu{cpu}" / "cache").glob("index[0-9]*"):
            with contextlib.suppress(OSError, ValueError):  # a cache whose entry cannot be read is left out
                if (index / "type").read_text().strip() == "Instruction":
                    continue
                level = int((index / "level").read_text())
                caches[level, (index / "shared_cpu_list").read_text().strip()] = _size((index / "size").read_text())
    top = max((level for level, _ in caches), default=None)
    return None if top is None else sum(size for (level, _), size in caches.items() if level == top)


def _size(text: str) -> int:
    """/sys's cache size: `32768K`, `1M` or bytes."""
    text = text.strip()
    scale = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def cpu_model() -> str:
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        return match.group(1).strip() if match else "unknown"
    except OSError:
        return "unknown"


def copy_bandwidth(nbytes: int = 256 * MiB) -> float:
    """Bytes/s read plus written by a large copy with all cores (what moving a tensor in DRAM costs)."""
    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)
    return 2 * nbytes / median_time(lambda: dst.copy_(src), repeats=5)


def background_slowdown(buffer_bytes: int = 32 * MiB) -> float:
    """Compute time on all cores while one host thread streams memory, over compute time alone: how much the runtime's
    worker threads (evictions, prefetches, emulated AXDIMM channels) slow training without a GPU."""
    src = torch.ones(buffer_bytes // 4)
    dst = torch.zeros_like(src)
    return beside_compute([lambda: dst.copy_(src)]).compute


def numa_nodes() -> list[NumaNode]:
    nodes = []
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        if match := re.search(r"MemTotal:\s+(\d+) kB", (path / "meminfo").read_text()):
            nodes.append(NumaNode(node=int(path.name[4:]), memory_bytes=int(match.group(1)) * KiB))
    return nodes or [NumaNode(node=0, memory_bytes=_meminfo("MemTotal"))]


def available_bytes() -> int:
    """Host memory available now: the DRAM tier's capacity."""
    return _meminfo("MemAvailable")


def _meminfo(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M).group(1)) * KiB


def host_copy_curve(sizes: tuple[int, ...] = HOST_SIZES) -> list[CurvePoint]:
    """Time to copy a buffer of each size within host memory."""
    points = []
    for size in sizes:
        src, dst = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
        points.append(CurvePoint(size_bytes=size, time_s=measured(median_time(lambda: dst.copy_(src)))))
    return points


# -- tiers ---------------------------------------------------------------------------------------------------------


def measure_tiers(gpu: Gpu | None, device: torch.device, nvme_dir: str | None, slowdown: float | None = None,
                  disk_beside: DiskBeside | None = None, largest: int = 64 * MiB) -> list[Tier]:
    """Fastest first. Read/write curves are the costs of moving data into and out of that tier from the fast one;
    host and disk transfers are timed up to `largest` bytes."""
    dram_capacity = available_bytes()
    sizes = tuple(size for size in HOST_SIZES if size <= largest)
    if gpu is None:
        copy = host_copy_curve(sizes)
        tiers = [Tier(name="dram", kind="dram", capacity_bytes=dram_capacity, read=copy, write=copy)]
    else:
        tiers = [Tier(name="hbm", kind="hbm", capacity_bytes=gpu.memory_bytes),
                 Tier(name="dram", kind="dram", capacity_bytes=dram_capacity, read=gpu.h2d, write=gpu.d2h)]
    return tiers + [measure_nvme(nvme_dir, slowdown, disk_beside, sizes)]


def measure_nvme(nvme_dir: str | None, slowdown: float | None = None,
                 disk_beside: DiskBeside | None = None, sizes: tuple[int, ...] = HOST_SIZES) -> Tier:
    """The disk tier through the runtime's store; beside compute as `disk_beside` timed it beside the script's
    training, else beside a GEMM loop."""
    store = _private_store(nvme_dir)
    base = store.directory.parent
    with store:
        write, read = [], []
        for size in sizes:
            data, out = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
            write.append(CurvePoint(size_bytes=size, time_s=measured(
                median_time(lambda: store.write("probe", data), repeats=3, min_s=0))))
            read.append(CurvePoint(size_bytes=size, time_s=measured(
                median_time(lambda: store.read("probe", out), repeats=3, min_s=0))))
        free = shutil.disk_usage(base).free
    beside = None if not slowdown else \
        beside_training(slowdown, disk_beside) if disk_beside else _beside(base, slowdown)
    read_cpu, write_cpu, read_beside, write_beside = beside or (None, None, [], [])
    return Tier(name=NVME_TIER, kind="nvme", capacity_bytes=free, path=str(base), read=read, write=write,
                read_cpu=read_cpu, write_cpu=write_cpu, read_beside_compute=read_beside,
                write_beside_compute=write_beside)


def beside_training(slowdown: float, disk_beside: DiskBeside) -> tuple[float, float, list[CurvePoint],
                                                                       list[CurvePoint]]:
    """The disk tier's `read_cpu`, `write_cpu` and trips beside compute, as the script's own steps timed them."""
    cpu = share(1 + disk_beside.stretch, slowdown)
    return cpu, cpu, disk_beside.read, disk_beside.write


def _private_store(nvme_dir: str | None, workers: int = 2):
    """A store in a private work directory under `nvme_dir` (the temp directory when None), removed on close;
    a directory that cannot be used is a usage error naming --nvme."""
    from hetero.run.devices.nvme import NvmeStore
    from hetero.run.devices.places import PlanPathError

    try:
        return NvmeStore.private(nvme_dir, "profile", "--nvme", workers=workers)
    except PlanPathError as e:
        raise HeteroError(e.message, hint=e.hint, exit_code=USAGE) from None


def _beside(directory: Path, slowdown: float) -> tuple[float, float, list[CurvePoint], list[CurvePoint]]:
    """A tensor's trip to the disk and back beside a GEMM loop, at BESIDE_SIZES, through the runtime's slow tier from
    one worker thread: evict to a new file; bring it back, release it and delete the file (counted with the read).
    The 1 MiB trip's share of a streaming worker's slowdown of compute is the figure for both directions."""
    from hetero.run.devices.slow_tier import NvmeTier

    points: dict[str, list[CurvePoint]] = {"read": [], "write": []}
    tier = NvmeTier("probe", _private_store(str(directory), workers=1))
    try:
        for size in BESIDE_SIZES:
            data, times = torch.ones(size, dtype=torch.uint8), {"read": [], "write": []}

            def cycle() -> None:
                start = time.perf_counter()
                tier.evict("beside", data, size, None)
                wrote = time.perf_counter()
                out, _ = tier.fetch("beside", size, None)
                tier.release(out)
                tier.delete("beside")
                times["write"].append(wrote - start)
                times["read"].append(time.perf_counter() - wrote)

            beside = beside_compute([cycle])
            for kind in points:
                points[kind].append(CurvePoint(size_bytes=size, time_s=measured(statistics.median(times[kind]))))
            if size == MiB:
                cpu = share(beside.compute, slowdown)
    finally:
        tier.close()
    return cpu, cpu, points["read"], points["write"]


def measure_axdimm(channels: int = 2, sizes: tuple[int, int] = UPDATE_SIZES, slowdown: float | None = None) -> Axdimm:
    """The emulated AXDIMM: its nominal capacity, and one channel's update time as the runtime drives it, at a small
    and a large size (a fixed cost plus a rate). With `slowdown` (the CPU computes), the same with every channel
    updating at once beside compute, as backward runs them."""
    # 16 bytes per parameter (value, gradient, two moments); each channel holds a home of each size
    with EmulatedAxdimm(channel_capacity_bytes=16 * sum(sizes) + 8192, channels=channels) as device:
        drivers = [ChannelDriver(device, c) for c in range(channels)]
        try:
            timed = time_updates({n: [update_job(AxdimmHome(d, torch.zeros(n)), d, n) for d in drivers] for n in sizes},
                                 slowdown)
        finally:
            for d in drivers:
                d.close()
    return Axdimm(backend="emulated", channels=channels, channel_capacity_bytes=emulated_channel_capacity(channels),
                  adam_params_per_s=measured(timed.rate), launch_s=measured(timed.launch_s), cpu=timed.cpu,
                  adam_beside_compute_params_per_s=measured_or_none(timed.beside_rate),
                  launch_beside_compute_s=measured_or_none(timed.beside_launch_s))


def emulated_channel_capacity(channels: int) -> int:
    """Nominal capacity of an emulated channel: the paper's 8 GiB, or a quarter of free host memory shared by the
    channels when that is less (the emulation holds the DIMM's memory in host DRAM)."""
    return min(8 * GiB, available_bytes() // 4 // channels) // MiB * MiB


# -- gpu -----------------------------------------------------------------------------------------------------------


def measure_gpu(device: torch.device) -> Gpu:
    props = torch.cuda.get_device_properties(device)
    uuid = str(props.uuid)
    read, write = dha.bandwidth(device)
    return Gpu(name=props.name, uuid=uuid, memory_bytes=props.total_memory, pcie=_pcie(uuid),
               h2d=_gpu_curve(device, to_device=True), d2h=_gpu_curve(device, to_device=False),
               dha_read_bytes_per_s=measured(read), dha_write_bytes_per_s=measured(write),
               event_s=measured(host_costs.event_s(device)))


def _pcie(uuid: str) -> Pcie | None:
    """The link NVML reports for this device, found by UUID: NVML numbers devices ignoring CUDA_VISIBLE_DEVICES."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            return Pcie(generation=pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                        width=pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
                        max_generation=pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
                        max_width=pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or refusing (containers, MIG): the field is optional
        return None


def _gpu_curve(device: torch.device, to_device: bool) -> list[CurvePoint]:
    """Pinned host <-> device copy time by size, timed with CUDA events on a side stream."""
    points = []
    stream = torch.cuda.Stream(device)
    for size in GPU_SIZES:
        host = torch.ones(size, dtype=torch.uint8).pin_memory()
        dev = torch.zeros(size, dtype=torch.uint8, device=device)
        dst, src = (dev, host) if to_device else (host, dev)
        with torch.cuda.stream(stream):
            seconds = dha.cuda_median_s(lambda: dst.copy_(src, non_blocking=True), repeats=5)
        points.append(CurvePoint(size_bytes=size, time_s=measured(seconds)))
    return points
