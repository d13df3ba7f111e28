"""The options of `hetero plan` checked against the profiled machine, and what every planning phase reads."""

from __future__ import annotations

from dataclasses import dataclass

from hetero.errors import USAGE, HeteroError
from hetero.plan import axdimm, routing, tiering
from hetero.plan.model import GPU
from hetero.schema.plan import OptimizerDevice, Plan, Trial
from hetero.schema.profile import Gpu, Profile, Tier
from hetero.schema.tiers import HOST_KIND, host_tier
from hetero.units import SIZE


@dataclass(kw_only=True, slots=True)
class PlanOptions:
    """The command line of `hetero plan`, checked against the profile by `plan`."""

    profile_path: str = "profile.yaml"
    reserve: float = 0.5
    gpu_memory_bytes: int | None = None
    dram_budget_bytes: int | None = None
    optimizer_device: str | None = None  # default: a real AXDIMM when the profile has one, else host
    emulate: bool = False  # --emulate axdimm: the emulated AXDIMM may hold states (tests and demonstrations)
    tier_activations: bool = False  # --tier-activations: schedule evictions even where they save no process memory
    recompute: bool = False  # --recompute: every block the profile found recomputable, whether or not a budget needs it
    slow_tier: str | None = None
    stay_time_s: float = 1e-3
    previous: Plan | None = None  # --from: its pinned entries are kept
    trials: tuple[Trial, ...] = ()  # what `hetero plan` measured of candidates under a DRAM budget (hetero.plan.fit)
    measuring: bool = False  # `hetero plan` tries the plan it chooses: where none is predicted to fit, the least is


@dataclass(kw_only=True, slots=True)
class Context:
    """The options checked against the machine, and what every phase reads from the profile."""

    profile: Profile
    options: PlanOptions
    gpu: Gpu | None
    host: Tier  # host memory: the fast tier without a GPU
    fast: str
    slow: str | None
    nvme: Tier | None  # where optimizer states overflow
    device: OptimizerDevice | None  # None: --optimizer-device none, the script's optimizer stays its own
    params: list[axdimm.Param]
    update_order: list[int]
    gpu_device_bytes: int  # the whole GPU's memory (0 without a GPU)
    gpu_budget_bytes: int  # GPU memory the plan may use (--gpu-memory, else the whole device; 0 without a GPU)
    dram_budget_bytes: int  # host memory the plan may use (--dram-budget, the memory cgroup, else the host tier)
    budget_source: str | None  # where a DRAM budget came from: the option or the memory cgroup; None: no budget
    host_model_bytes: int  # host memory besides optimizer states: parameters, gradients, activations without a GPU
    links: list[routing.Link]
    ranks: int

    def rates(self, device: str) -> axdimm.Rates:
        return axdimm.rates(self.profile, device)

    def tier_curves(self, slow: str):
        return tiering.curves(self.profile, slow)


def context(profile: Profile, o: PlanOptions) -> Context:
    m = profile.machine
    if not m.tiers:
        raise HeteroError("the profile lists no memory tiers", hint="re-run `hetero profile`", exit_code=USAGE)
    host = host_tier(m.tiers)
    gpu_device, gpu_budget = _gpu_budget(m.gpu, o)
    if not 0 <= o.reserve <= 1:
        raise HeteroError(f"--reserve {o.reserve:g} is not a fraction", hint="use a value from 0 to 1", exit_code=USAGE)
    dram, source = _dram_budget(m, host, o)
    fast = GPU if m.gpu else host.name
    params = axdimm.params(profile)
    layers = profile.layers
    model = 2 * sum(x.params_bytes for x in layers) + (0 if m.gpu else sum(x.saved_bytes for x in layers))
    links, ranks = routing.links(profile)
    return Context(profile=profile, options=o, gpu=m.gpu, host=host, fast=fast, slow=_slow_tier(profile, o, fast),
                   nvme=axdimm.nvme_tier(profile), device=_device(profile, o), params=params,
                   update_order=axdimm.update_order(profile, params), gpu_device_bytes=gpu_device,
                   gpu_budget_bytes=gpu_budget, dram_budget_bytes=dram, budget_source=source, host_model_bytes=model,
                   links=links, ranks=ranks)


CGROUP = "the memory cgroup the profile ran in"


def _dram_budget(m, host: Tier, o: PlanOptions) -> tuple[int, str | None]:
    """The DRAM budget and where it came from: --dram-budget, else the profile's memory cgroup limit, else none
    (the host's capacity bounds the plan)."""
    limit = m.memory_limit_bytes
    if o.dram_budget_bytes is None:
        if limit is None:
            return host.capacity_bytes, None
        return min(limit, host.capacity_bytes), CGROUP
    dram = o.dram_budget_bytes
    if dram > host.capacity_bytes:
        raise HeteroError(f"--dram-budget {SIZE.format_short(dram)} exceeds the "
                          f"{SIZE.format_short(host.capacity_bytes)} the profile measured for {host.name}",
                          hint="lower --dram-budget", exit_code=USAGE)
    if limit is not None and dram > limit:
        raise HeteroError(f"--dram-budget {SIZE.format_short(dram)} exceeds the {SIZE.format_short(limit)} limit of "
                          f"{CGROUP}", hint=f"use at most --dram-budget {SIZE.format_short(limit)}", exit_code=USAGE)
    return dram, "--dram-budget"


def _gpu_budget(gpu: Gpu | None, o: PlanOptions) -> tuple[int, int]:
    if gpu is None:
        if o.gpu_memory_bytes is not None:
            raise HeteroError(f"--gpu-memory {SIZE.format_short(o.gpu_memory_bytes)} given, but the profile has no GPU",
                              hint="drop --gpu-memory, or profile on a machine with a CUDA device", exit_code=USAGE)
        return 0, 0
    if o.gpu_memory_bytes is None:
        return gpu.memory_bytes, gpu.memory_bytes
    if o.gpu_memory_bytes > gpu.memory_bytes:
        raise HeteroError(f"--gpu-memory {SIZE.format_short(o.gpu_memory_bytes)} exceeds the GPU's "
                          f"{SIZE.format_short(gpu.memory_bytes)} ({gpu.name})",
                          hint=f"use at most --gpu-memory {SIZE.format_short(gpu.memory_bytes)}", exit_code=USAGE)
    return gpu.memory_bytes, o.gpu_memory_bytes


def _device(profile: Profile, o: PlanOptions) -> OptimizerDevice | None:
    """An emulated AXDIMM lives in host DRAM and shares the host's cores: never the default, only asked for."""
    m = profile.machine
    if o.optimizer_device == "none" and not o.emulate:
        return None
    usable = m.axdimm is not None and (m.axdimm.backend != "emulated" or o.emulate)
    device = o.optimizer_device or ("axdimm" if usable else "host")
    if device not in ("axdimm", "host", "gpu"):
        raise HeteroError(f"--optimizer-device {device}: not a device", hint="use axdimm, host, gpu or none",
                          exit_code=USAGE)
    if o.emulate and (m.axdimm is None or device != "axdimm"):
        raise HeteroError("--emulate axdimm, but " + ("the profile has no emulated AXDIMM" if m.axdimm is None else
                                                      f"--optimizer-device is {device}"),
                          hint="drop one of the two options" if m.axdimm else "re-run `hetero profile`",
                          exit_code=USAGE)
    if device == "axdimm" and m.axdimm is None:
        raise HeteroError("--optimizer-device axdimm, but the profile has no AXDIMM",
                          hint="use --optimizer-device host", exit_code=USAGE)
    if device == "gpu" and m.gpu is None:
        raise HeteroError("--optimizer-device gpu, but the profile has no GPU",
                          hint="use --optimizer-device host" + (" or axdimm" if m.axdimm else ""), exit_code=USAGE)
    return device


def _slow_tier(profile: Profile, o: PlanOptions, fast: str) -> str | None:
    """--slow-tier, checked; by default host memory below a GPU, else the first NVMe tier, else any slower tier
    with measured transfer times."""
    tiers = profile.machine.tiers
    names = [t.name for t in tiers]
    if o.slow_tier is not None:
        tier = next((t for t in tiers if t.name == o.slow_tier), None)
        if tier is None:
            raise HeteroError(f"--slow-tier {o.slow_tier}: the profile has no such tier",
                              hint=f"tiers in the profile: {', '.join(names)}", exit_code=USAGE)
        if tier.name == fast or tier.kind == "hbm":
            raise HeteroError(f"--slow-tier {o.slow_tier} is where layers compute, not a slower tier",
                              hint=f"pick another of: {', '.join(n for n in names if n != fast)}", exit_code=USAGE)
        if not (tier.read and tier.write) and not (profile.machine.gpu and tier.kind == "dram"):
            raise HeteroError(f"--slow-tier {o.slow_tier} has no measured read/write times",
                              hint="re-run `hetero profile` to measure it, or pick another tier", exit_code=USAGE)
        return tier.name
    if profile.machine.gpu:
        return next((t.name for t in tiers if t.kind == HOST_KIND), None)  # host memory
    usable = [t for t in tiers if t.name != fast and t.kind != "hbm" and t.read and t.write]
    return next((t.name for t in usable if t.kind == "nvme"), usable[0].name if usable else None)
