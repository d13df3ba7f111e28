"""Where each parameter's fp32 master copy, gradient and Adam states live, and where its update runs (AXDIMM §5).

On the AXDIMM, parameters go to its channels round-robin (§5.2), each within its capacity, so both channels' Adam
kernels work while the link feeds the other. What does not fit goes to NVMe (§5.3): the parameters updated last
(the first layers). The runtime stages them inside `optimizer.step()`, in parameter order, through two staging
slots on the channels, the next tensor's read overlapping the current update, as hetero.plan.simulate predicts.
`host` and `gpu` put every state in host or GPU memory (host overflowing to NVMe the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.errors import USAGE, HeteroError
from hetero.plan import tiering
from hetero.plan.model import Curve, Update
from hetero.schema.names import UPDATE_BUCKETS, UpdateBuckets, update_buckets
from hetero.schema.plan import NvmeOverflow, StatePlacement
from hetero.schema.profile import Cpu, Profile, Tier
from hetero.units import PARAM_RATE, SIZE, TIME

STATE_BYTES_PER_PARAM = 16  # fp32 master copy, gradient, Adam m and v: the four inputs of each update
NVME_BYTES_PER_PARAM = 12  # read back and written out per update: master copy, m and v (the gradient is fresh)


@dataclass(kw_only=True, slots=True)
class Param:
    name: str  # qualified, as in model.named_parameters()
    layer: int
    num_params: int


@dataclass(kw_only=True, slots=True)
class Placement:
    tiers: list[str]  # per parameter, in forward order
    channels: list[int | None]
    channel_bytes: list[int]
    nvme_bytes: int
    staging_bytes: int
    why: str


@dataclass(kw_only=True, slots=True)
class Rates:
    """How fast updates run and states move: per channel (or the host's, or the GPU's) Adam rate, NVMe curves."""

    adam_params_per_s: float
    lanes: list[str]  # one per channel; empty: updates run on the compute lane
    launch_s: float = 0.0  # fixed cost of each call: an AXDIMM channel's mode switches and launch, the host's call
    bucketed: bool = False  # one call per bucket of resident states (the host's fused Adam), else per parameter
    note: str = ""  # which of the measured rates holds, where it says more than the rate
    nvme_read: Curve | None = None
    nvme_write: Curve | None = None


def params(profile: Profile) -> list[Param]:
    """Every parameter the optimizer owns, in forward order, with its element count (a layer's parameters share
    its bytes-per-element, which covers fp32, fp16 and bf16 models alike)."""
    out = []
    for i, layer in enumerate(profile.layers):
        total = layer.params_bytes
        for name, size in zip(layer.param_names(), layer.params.values()):
            out.append(Param(name=name, layer=i, num_params=round(layer.num_params * size / total) if total else 0))
    return out


def update_order(profile: Profile, ps: list[Param]) -> list[int]:
    """Parameter indices in the order their gradients become final: layers by backward start."""
    starts = [layer.bp_start_s for layer in profile.layers]
    return sorted(range(len(ps)), key=lambda k: (starts[ps[k].layer], -ps[k].layer, k))


def nvme_tier(profile: Profile) -> Tier | None:
    return next((t for t in profile.machine.tiers if t.kind == "nvme" and t.read and t.write), None)


def rates(profile: Profile, device: str) -> Rates:
    """Adam per channel on the AXDIMM; on the host as the runtime drives it (or at the script's own step's rate,
    for older profiles), on its driver thread's lane; the script's step on the GPU."""
    m, t = profile.machine, profile.training
    step_rate = profile.model.num_params / t.optimizer_step_s if t.optimizer_step_s > 0 else float("inf")
    nvme = nvme_tier(profile)
    write, read = tiering.disk_curves(nvme) if nvme else (None, None)
    if device == "axdimm":
        lanes = [f"axdimm ch{c}" for c in range(m.axdimm.channels)]
        x = m.axdimm  # emulated channels share the cores with compute where the CPU computes: measured beside it
        beside = x.adam_beside_compute_params_per_s is not None and x.launch_beside_compute_s is not None
        return Rates(adam_params_per_s=x.adam_beside_compute_params_per_s if beside else x.adam_params_per_s,
                     launch_s=x.launch_beside_compute_s if beside else x.launch_s, lanes=lanes, nvme_read=read,
                     nvme_write=write)
    if device == "host":  # the runtime's driver thread: its own lane, beside compute where the CPU computes
        c, n = m.cpu, profile.model.num_params
        beside = m.gpu is None and c.adam_beside_compute_params_per_s is not None
        launch = (c.adam_launch_beside_compute_s if beside else c.adam_launch_s) or 0.0
        return Rates(adam_params_per_s=host_rate(c, n, beside) or step_rate, launch_s=launch, lanes=["host adam"],
                     bucketed=True, note=_cache_note(c, n), nvme_read=read, nvme_write=write)
    return Rates(adam_params_per_s=step_rate, lanes=[])


def host_rate(cpu: Cpu, params: int, beside: bool = False) -> float | None:
    """Host Adam's params/s in a step that updates `params` parameters: alone, or `beside` compute (where measured);
    where their states exceed the last-level cache (or it is not known), at most the rate measured beyond it, where
    every state is read and written in DRAM. None: not measured (older profiles)."""
    rate = cpu.adam_beside_compute_params_per_s if beside else cpu.adam_params_per_s
    beyond = cpu.adam_beyond_cache_params_per_s
    if beyond is None or not _beyond_cache(cpu, params):
        return rate
    return beyond if rate is None else min(rate, beyond)


def _beyond_cache(cpu: Cpu, params: int) -> bool:
    cache = cpu.last_level_cache_bytes
    return cache is None or params * STATE_BYTES_PER_PARAM > cache


def _cache_note(cpu: Cpu, params: int) -> str:
    if cpu.adam_beyond_cache_params_per_s is None:
        return ""
    if cpu.last_level_cache_bytes is None:
        return "as timed beyond the caches"
    where = "beyond" if _beyond_cache(cpu, params) else "within"
    return (f"{SIZE.format_short(params * STATE_BYTES_PER_PARAM)} of states, {where} the "
            f"{SIZE.format_short(cpu.last_level_cache_bytes)} last-level cache")


def state_bytes(p: Param) -> int:
    return p.num_params * STATE_BYTES_PER_PARAM


def place(params: list[Param], update_order: list[int], channels: int, capacity_bytes: int,
          nvme: str | None, label: str) -> Placement:
    """Round-robin over `channels` of `capacity_bytes` each when everything fits; otherwise the parameters updated
    last (`update_order` lists parameter indices in update order) overflow to `nvme`."""
    total = sum(map(state_bytes, params))
    fitted = _round_robin(params, channels, capacity_bytes, label) if total <= channels * capacity_bytes else None
    if fitted is not None:
        tiers, chans, used = fitted
        why = (f"all states fit in {_fits(channels, capacity_bytes)}; round-robin by bytes: {SIZE.format_short(total)} "
               f"of states ({STATE_BYTES_PER_PARAM} B/param), " + ", ".join(
                   f"ch{c} {SIZE.format_short(b)}" for c, b in enumerate(used)) if label == "axdimm" else
               f"all states fit in host memory: {SIZE.format_short(total)} ({STATE_BYTES_PER_PARAM} B/param) of "
               f"{SIZE.format_short(capacity_bytes)} free")
        return Placement(tiers=tiers, channels=chans, channel_bytes=used, nvme_bytes=0, staging_bytes=0, why=why)
    if nvme is None:
        raise HeteroError(f"optimizer states {SIZE.format_short(total)} do not fit in {label} "
                          f"({_fits(channels, capacity_bytes)}) and the profile has no nvme tier to overflow to",
                          hint="profile with an nvme tier, or choose another --optimizer-device", exit_code=USAGE)
    where, slot = _overflow(params, update_order, channels, capacity_bytes)
    if slot > capacity_bytes:
        raise HeteroError(f"one tensor's optimizer states ({SIZE.format_short(slot)}) exceed a whole {label} channel "
                          f"({SIZE.format_short(capacity_bytes)}): it cannot be staged for its update",
                          hint="choose another --optimizer-device", exit_code=USAGE)
    tiers = [label if w is not None else nvme for w in where]
    chans = [w if label == "axdimm" else None for w in where]
    used = [sum(state_bytes(p) for p, w in zip(params, where) if w == c) for c in range(channels)]
    spilled = total - sum(used)
    slots = NvmeOverflow.STAGING_SLOTS
    return Placement(tiers=tiers, channels=chans, channel_bytes=used, nvme_bytes=spilled, staging_bytes=slots * slot,
                     why=(
        f"states {SIZE.format_short(total)} > {_fits(channels, capacity_bytes)}: the {tiers.count(nvme)} parameters "
        f"updated last ({SIZE.format_short(spilled)}) go to {nvme}, read back before their updates through {slots} "
        f"{SIZE.format_short(slot)} staging slots (updated ones leave first); the rest by room in update order"))


def _fits(channels: int, capacity: int) -> str:
    return f"{channels} x {SIZE.format_short(capacity)} channels" if channels > 1 else \
        f"{SIZE.format_short(capacity)} of free host memory"


def _overflow(params: list[Param], update_order: list[int], channels: int, capacity: int) -> tuple[list, int]:
    """Each parameter's channel (None: NVMe) and the staging slot. In update order, each tensor goes to the channel
    with the most room if it fits there, so the ones updated last spill; two staging slots, each as large as the
    largest spilled tensor, sit where NvmeOverflow's staging rule puts them (the runtime stages by the same rule)."""
    slot = 0
    while True:  # the slot only grows, the spilled set with it: this settles within len(params) rounds
        room = [capacity - slot * _slots_on(c, channels) for c in range(channels)]
        where: list[int | None] = [None] * len(params)
        for k in update_order:
            c = max(range(channels), key=lambda c: (room[c], -c))
            if room[c] >= state_bytes(params[k]):
                where[k] = c
                room[c] -= state_bytes(params[k])
        largest = max((state_bytes(p) for p, w in zip(params, where) if w is None), default=0)
        if largest <= slot:
            return where, slot
        slot = largest


def _slots_on(channel: int, channels: int) -> int:
    return sum(NvmeOverflow.staging_channel(s, channels) == channel for s in range(NvmeOverflow.STAGING_SLOTS))


def _round_robin(params: list[Param], channels: int, capacity: int,
                 label: str) -> tuple[list[str], list[int | None], list[int]] | None:
    """Round-robin by bytes: each tensor goes to the channel holding the fewest bytes so far (ties in turn), so a
    model whose tensors alternate weight/bias does not pile every weight on one channel's Adam kernel. None when a
    tensor fits on no channel."""
    used = [0] * channels
    tiers: list[str] = []
    chans: list[int | None] = []
    for p in params:
        size = state_bytes(p)
        fit = min((c for c in range(channels) if used[c] + size <= capacity), key=lambda c: (used[c], c),
                  default=None)
        if fit is None:
            return None
        used[fit] += size
        tiers.append(label)
        chans.append(fit if label == "axdimm" else None)
    return tiers, chans, used


def states(params: list[Param], placement: Placement) -> list[StatePlacement]:
    return [StatePlacement(param=p.name, tier="nvme" if t not in ("axdimm", "host", "gpu") else t, channel=c)
            for p, t, c in zip(params, placement.tiers, placement.channels)]


def updates(params: list[Param], placed: list[StatePlacement], n_layers: int, rates: Rates,
            grads: bool = False) -> list[list[Update]]:
    """Each layer's calls for the simulator: a channel's lane for AXDIMM states (NVMe-staged ones take turns over
    the channels), the compute lane when `rates.lanes` is empty. Each call costs `rates.launch_s` and its parameters
    at the rate: one per parameter, or with `rates.bucketed` one per bucket of the states not staged from NVMe. With
    `grads` an NVMe-held parameter's gradient is written there in backward and read back with its states."""
    out: list[list[Update]] = [[] for _ in range(n_layers)]
    where = {s.param: s for s in placed}
    turn = 0
    for call in calls(params, where, rates.bucketed):
        p, s = call[0], where[call[0].name]
        lane = -1 if not rates.lanes else (s.channel if s.channel is not None else turn % len(rates.lanes))
        update = Update(lane=lane, update_s=rates.launch_s + sum(q.num_params for q in call) / rates.adam_params_per_s)
        if s.tier == "nvme":
            turn += 1
            size, grad = p.num_params * NVME_BYTES_PER_PARAM, 4 * p.num_params if grads else 0
            update.nvme_bytes = state_bytes(p)
            update.read_s, update.write_s = rates.nvme_read.time_s(size + grad), rates.nvme_write.time_s(size)
            update.grad_write_s = rates.nvme_write.time_s(grad) if grad else 0.0
        out[p.layer].append(update)
    return out


def calls(params: list[Param], where: dict[str, StatePlacement], bucketed: bool,
          policy: UpdateBuckets = UPDATE_BUCKETS) -> list[list[Param]]:
    """The placed parameters (`where` names their states; `params` in forward order) as the runtime's calls, in
    order of each call's first parameter (its bucket's last gradient to become final): with `bucketed`, those not
    on NVMe by bucket (hetero.schema.names.update_buckets), else one each."""
    placed = [p for p in params if p.name in where]
    grouped = [p for p in placed if bucketed and where[p.name].tier != "nvme"]
    of = update_buckets([(p.name, p.num_params) for p in grouped], policy)
    out: list[list[Param]] = []
    by_bucket: dict[int, list[Param]] = {}
    for p in placed:
        if p.name not in of:
            out.append([p])
        elif of[p.name] in by_bucket:
            by_bucket[of[p.name]].append(p)
        else:
            out.append(by_bucket.setdefault(of[p.name], [p]))
    return out


def rate_text(rates: Rates) -> str:
    each = " each" if len(rates.lanes) > 1 else ""
    note = f" ({rates.note})" if rates.note else ""
    per = "call (one per bucket)" if rates.bucketed else "update"
    launch = f" + {TIME.format_short(rates.launch_s)} per {per}" if rates.launch_s else ""
    return f"{PARAM_RATE.format_short(rates.adam_params_per_s)}{each}{note}{launch}"
