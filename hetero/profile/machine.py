"""Measure the machine: CPU and memory bandwidth, NUMA nodes, memory tiers with transfer-time curves, the GPU and
its PCIe link, and the (emulated) AXDIMM. What cannot be measured is null, with the reason in `unmeasured`.

Every timing is the median of several repeats on buffers allocated and touched beforehand (first touch of fresh
memory is slow in VMs and would be measured instead of the transfer).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hetero.units import measured
from hetero.profile import dha
from hetero.profile.schema import Axdimm, Cpu, CurvePoint, Gpu, Layer, Machine, NumaNode, Pcie, Peer, Tier

KiB, MiB, GiB = 2**10, 2**20, 2**30
HOST_SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB)
GPU_SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB)


def measure(device: torch.device, nvme_dir: str | None, progress: Callable | None = None,
            peers: list[Peer] | None = None) -> Machine:
    """The machine as seen from `device` (the model's device); `peers`: the links between ranks, measured before."""
    report = progress or (lambda *a: None)
    phases = ["cpu", "gpu", "tiers", "axdimm"]
    report("machine", 0, len(phases))
    cpu = measure_cpu(gpu=device.type == "cuda")
    report("machine", 1, len(phases))
    gpu = measure_gpu(device) if device.type == "cuda" else None
    report("machine", 2, len(phases))
    tiers = measure_tiers(gpu, device, nvme_dir, cpu.background_slowdown)
    report("machine", 3, len(phases))
    axdimm = measure_axdimm()
    report("machine", 4, len(phases))
    return Machine(cpu=cpu, numa=numa_nodes(), gpu=gpu, tiers=tiers, axdimm=axdimm, peers=peers or [])


def unmeasured(device: torch.device, layers: list[Layer] = (), tiers: list[Tier] = ()) -> dict[str, str]:
    """Why the profile's null fields are null on this machine (`layers`, `tiers`: as measured, to name those left
    null)."""
    copies = {f"machine.tiers.{t.name}.{f}": MEMORY_COPY_CPU for t in tiers if t.path is None and (t.read or t.write)
              for f in ("read_cpu", "write_cpu") if getattr(t, f) is None}
    if device.type != "cuda":
        gone = "needs a CUDA device; the model trains on the CPU"
        return {"machine.gpu": "no CUDA device in use", "layers.*.fp_dha": gone, "layers.*.bp_dha": gone,
                "layers.*.bp_grad_host": gone} | copies
    return {"machine.cpu.background_slowdown": ON_GPU} | copies | dha.unmeasured(list(layers))


ON_GPU = "the model computes on the GPU: host worker threads do not take its cores"
MEMORY_COPY_CPU = "a copy within memory is a streaming worker: planned as 1"


# -- host ----------------------------------------------------------------------------------------------------------


def measure_cpu(gpu: bool = False) -> Cpu:
    """`gpu`: the model computes on a GPU, so how host threads slow compute on the cores is not measured."""
    return Cpu(model=_cpu_model(), cores=len(os.sched_getaffinity(0)),
               dram_bandwidth_bytes_per_s=measured(copy_bandwidth()), adam_params_per_s=measured(adam_rate()),
               background_slowdown=None if gpu else measured(background_slowdown()))


def _cpu_model() -> str:
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


def adam_rate(numel: int = 8 * 2**20) -> float:
    """Parameters/s of torch's fused AdamW on the host, all cores (the `host` optimizer device)."""
    param = torch.nn.Parameter(torch.ones(numel))
    param.grad = torch.full_like(param, 1e-3)
    opt = torch.optim.AdamW([param], fused=True)
    opt.step()  # allocates and touches the states
    return numel / median_time(opt.step, repeats=5)


def background_slowdown(buffer_bytes: int = 32 * MiB) -> float:
    """Compute time on all cores while one host thread streams memory, over compute time alone: how much the
    runtime's worker threads (evictions, prefetches, emulated AXDIMM channels) slow training without a GPU. They
    share the cores and the memory bus with torch's intra-op threads, and a parallel GEMM waits for its slowest
    thread."""
    src = torch.ones(buffer_bytes // 4)
    dst = torch.zeros_like(src)
    return slowdown_beside(lambda: dst.copy_(src))


def slowdown_beside(work: Callable[[], object], target_s: float = 0.06) -> float:
    """A loop of GEMMs of about `target_s` with torch's default threads while one thread repeats `work`, over the
    same loop alone; best of 3 each way (about 0.5 s)."""
    a, b = torch.ones(512, 1024), torch.ones(1024, 1024)
    one = median_time(lambda: a @ b, repeats=3, min_s=0)
    count = max(1, round(target_s / one))

    def gemms() -> float:
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        return time.perf_counter() - start

    alone = min(gemms() for _ in range(3))
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    worker = threading.Thread(target=loop, name="hetero-profile-worker", daemon=True)
    worker.start()
    try:
        busy = min(gemms() for _ in range(3))
    finally:
        stop.set()
        worker.join()
    return max(1.0, busy / alone)  # noise can make it read below 1: a worker never speeds compute up


def numa_nodes() -> list[NumaNode]:
    nodes = []
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        match = re.search(r"MemTotal:\s+(\d+) kB", (path / "meminfo").read_text())
        if match:
            nodes.append(NumaNode(node=int(path.name[4:]), memory_bytes=int(match.group(1)) * KiB))
    return nodes or [NumaNode(node=0, memory_bytes=_meminfo("MemTotal"))]


def _meminfo(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return int(match.group(1)) * KiB


def host_copy_curve(sizes: tuple[int, ...] = HOST_SIZES) -> list[CurvePoint]:
    """Time to copy a buffer of each size within host memory."""
    points = []
    for size in sizes:
        src, dst = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
        points.append(CurvePoint(size_bytes=size, time_s=measured(median_time(lambda: dst.copy_(src)))))
    return points


# -- tiers ---------------------------------------------------------------------------------------------------------


def measure_tiers(gpu: Gpu | None, device: torch.device, nvme_dir: str | None,
                  slowdown: float | None = None) -> list[Tier]:
    """Fastest first. Read/write curves are the costs of moving data into and out of that tier from the fast one."""
    dram_capacity = _meminfo("MemAvailable")
    if gpu is None:
        copy = host_copy_curve()
        tiers = [Tier(name="dram", kind="dram", capacity_bytes=dram_capacity, read=copy, write=copy)]
    else:
        tiers = [Tier(name="hbm", kind="hbm", capacity_bytes=gpu.memory_bytes),
                 Tier(name="dram", kind="dram", capacity_bytes=dram_capacity, read=gpu.h2d, write=gpu.d2h)]
    return tiers + [measure_nvme(nvme_dir, slowdown)]


def measure_nvme(nvme_dir: str | None, slowdown: float | None = None) -> Tier:
    """The disk tier through the same store (and I/O path: O_DIRECT where allowed) the runtime uses."""
    from hetero.run.devices.nvme import NvmeStore

    base = Path(nvme_dir or tempfile.gettempdir())
    probe = base / f"hetero-profile-{os.getpid()}"  # made and removed by the store
    with NvmeStore(probe) as store:
        write, read = [], []
        for size in HOST_SIZES:
            data, out = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
            write.append(CurvePoint(size_bytes=size, time_s=measured(
                median_time(lambda: store.write_async("probe", data).wait(), repeats=3, min_s=0))))
            read.append(CurvePoint(size_bytes=size, time_s=measured(
                median_time(lambda: store.read_async("probe", out).wait(), repeats=3, min_s=0))))
        shares = _shares(store, data, out, slowdown) if slowdown else (None, None)
        free = shutil.disk_usage(probe).free
    return Tier(name="nvme0", kind="nvme", capacity_bytes=free, path=str(base), read=read, write=write,
                read_cpu=shares[0], write_cpu=shares[1])


def _shares(store, data: torch.Tensor, out: torch.Tensor, slowdown: float) -> tuple[float, float]:
    """How much of a streaming worker's slowdown of compute a worker moving the largest size to and from the disk
    causes: (compute slowdown beside it - 1) / (slowdown - 1), clamped to [0, 1]. Measured as it acts, not from CPU
    time: the disk's DMA and the guest's interrupt work load the cores and memory bus without showing as the
    process's CPU time."""
    beside_read = slowdown_beside(lambda: store.read_async("probe", out).wait())
    beside_write = slowdown_beside(lambda: store.write_async("probe", data).wait())
    share = lambda s: round(min(1.0, max(0.0, (s - 1) / (slowdown - 1))), 3) if slowdown > 1 else 0.0  # noqa: E731
    return share(beside_read), share(beside_write)


def measure_axdimm(channels: int = 2, sizes: tuple[int, int] = (4096, 4 * 2**20)) -> Axdimm:
    """The emulated AXDIMM: its nominal capacity, and one channel's update time as the runtime drives it (the
    channel's driver thread copies the gradient in, switches the arbiter and launches the kernel; the caller waits for
    its status), at a small and a large size: a fixed cost per update plus a rate."""
    from hetero.kernels.adam import Hyperparameters
    from hetero.run.devices.axdimm import EmulatedAxdimm
    from hetero.run.states import AxdimmHome, ChannelDriver

    hp = Hyperparameters(decoupled_weight_decay=True)
    times = []
    with EmulatedAxdimm(channel_capacity_bytes=4 * sum(sizes) * 4 + 4096, channels=1) as device:
        driver = ChannelDriver(device, 0)
        try:
            for numel in sizes:
                home, grad = AxdimmHome(driver, torch.zeros(numel)), torch.full((numel,), 1e-3)

                def update() -> None:
                    home.update(grad, hp, step=1)
                    driver.drain()

                times.append(median_time(update, repeats=11))
        finally:
            driver.close()
    rate = (sizes[1] - sizes[0]) / max(times[1] - times[0], 1e-9)
    return Axdimm(backend="emulated", channels=channels, channel_capacity_bytes=emulated_channel_capacity(channels),
                  adam_params_per_s=measured(rate), launch_s=measured(max(0.0, times[0] - sizes[0] / rate)))


def emulated_channel_capacity(channels: int) -> int:
    """Nominal capacity of an emulated channel: the paper's 8 GiB, or a quarter of free host memory shared by the
    channels when that is less (the emulation holds the DIMM's memory in host DRAM)."""
    return min(8 * GiB, _meminfo("MemAvailable") // 4 // channels) // MiB * MiB


# -- gpu -----------------------------------------------------------------------------------------------------------


def measure_gpu(device: torch.device) -> Gpu:
    props = torch.cuda.get_device_properties(device)
    uuid = str(props.uuid)
    read, write = dha.bandwidth(device)
    return Gpu(name=props.name, uuid=uuid, memory_bytes=props.total_memory, pcie=_pcie(uuid),
               h2d=_gpu_curve(device, to_device=True), d2h=_gpu_curve(device, to_device=False),
               dha_read_bytes_per_s=measured(read), dha_write_bytes_per_s=measured(write))


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
        times = []
        with torch.cuda.stream(stream):
            for _ in range(6):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        points.append(CurvePoint(size_bytes=size, time_s=measured(statistics.median(times[1:]))))
    return points


# -- timing --------------------------------------------------------------------------------------------------------


def median_time(fn: Callable[[], object], repeats: int = 7, min_s: float = 2e-4) -> float:
    """Median seconds of one call; fast calls are batched until a batch takes at least `min_s`."""
    fn()
    batch = 1
    while True:
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        if time.perf_counter() - start >= min_s or batch >= 2**16:
            break
        batch *= 4
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times)
