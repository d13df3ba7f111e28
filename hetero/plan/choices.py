"""A plan in the simulator's terms: what `hetero plan` chose, or what a user edited, as `Choices` over the profile's
`Costs`. `hetero plan` and `hetero show --timeline` simulate a plan through this one translation.
"""

from __future__ import annotations

from hetero.errors import USAGE, HeteroError
from hetero.plan import axdimm, routing, tiering
from hetero.plan.model import GPU, Choices, Costs, LayerCosts, costs, timed
from hetero.schema.plan import LayerPlan, OptimizerPlan, Plan
from hetero.schema import tiers
from hetero.schema.profile import Profile


def build(profile: Profile, plan: Plan) -> tuple[Costs, Choices]:
    """`plan` (possibly edited by hand) in the simulator's terms; entries naming unknown layers are ignored."""
    acts, opt, gpu = plan.activations, plan.optimizer, profile.machine.gpu is not None
    evict, prefetch = tiering.curves(profile, acts.slow) if acts else (None, None)
    profiled = costs(profile, evict, prefetch)
    n = len(profiled.layers)
    index = {c.name: i for i, c in enumerate(profiled.layers)}
    modes, grads = ["gfgb"] * n, ["gpu"] * n
    for e in plan.layers:
        if e.name in index:
            modes[index[e.name]], grads[index[e.name]] = _timed_mode(profiled.layers[index[e.name]], e, gpu)
    evicted, trigger, at = [0] * n, [None] * n, [0.0] * n
    for e in acts.schedule if acts else []:
        if (i := index.get(e.layer)) is not None:
            evicted[i] = min(e.evict_bytes, profiled.layers[i].saved_bytes)
            trigger[i], at[i] = index.get(e.prefetch_after) if e.prefetch_after else None, e.prefetch_at_s
    ps = axdimm.params(profile)
    rates = axdimm.rates(profile, opt.device) if opt else None
    updates = axdimm.updates(ps, opt.states, n, rates, grads=grads_on_nvme(profile, opt)) if opt else \
        [[] for _ in range(n)]
    host = host_tier(profile)
    static = _static(profile, opt, ps, host)
    choices = Choices(
        modes=modes, grads=grads, evict_bytes=evicted, trigger=trigger, prefetch_at_s=at, updates=updates,
        lanes=rates.lanes if rates else [], overlap_backward=opt.overlap_backward if opt else False,
        grads_to_host=opt is not None and opt.device != "gpu",
        params_on_gpu=gpu and (opt is None or opt.device == "gpu"),
        step_s=0.0 if opt else profile.training.optimizer_step_s, staging_bytes=_staging(profile, plan, static, host),
        sync_s=sync_times(profile, plan), fast=acts.fast if acts else (GPU if gpu else host),
        slow=acts.slow if acts else None, static_bytes=static,
        cpu_share=cpu_share(profile, plan, rates.lanes if rates else []))
    return profiled, timed(profiled, choices)


def host_tier(profile: Profile) -> str:
    """The name of the profile's host-memory tier (hetero.schema.tiers)."""
    return tiers.host_tier(profile.machine.tiers).name


def grads_on_nvme(profile: Profile, optimizer: OptimizerPlan | None) -> bool:
    """The gradients of NVMe-held parameters wait on NVMe between backward and step (host-trained ones only)."""
    return optimizer is not None and optimizer.nvme is not None and optimizer.nvme.grads and \
        profile.machine.gpu is None


def host_static_bytes(profile: Profile, optimizer: OptimizerPlan | None) -> int:
    """Bytes host memory holds for the whole iteration with this optimizer section, activations aside."""
    host = host_tier(profile)
    return _static(profile, optimizer, axdimm.params(profile), host).get(host, 0)


def gpu_state_bytes(profile: Profile, optimizer: OptimizerPlan | None) -> int:
    """Bytes of optimizer states the plan's own optimizer keeps on the GPU (`optimizer.device: gpu`)."""
    return _static(profile, optimizer, axdimm.params(profile), host_tier(profile)).get(GPU, 0)


def cpu_share(profile: Profile, plan: Plan, optimizer_lanes: list[str]) -> dict[str, float]:
    """Share of a core the worker behind each background lane keeps busy while it works. Disk workers mostly wait
    for the device (the profile measures how much); unmeasured ones count as busy all the time, as a memory copy
    is. Emulated AXDIMM channels and the host optimizer's driver are host threads running Adam (the profile measures
    their share when the CPU computes); a hardware AXDIMM computes on its own device."""
    m, acts, opt = profile.machine, plan.activations, plan.optimizer
    out: dict[str, float] = {}
    slow = next((t for t in m.tiers if acts and t.name == acts.slow), None)
    if slow is not None:
        out["evict"], out["prefetch"] = _share(slow.write_cpu), _share(slow.read_cpu)
    nvme = axdimm.nvme_tier(profile)  # the tier whose curves time the optimizer's state reads and writes
    if nvme is not None:
        out["nvme read"], out["nvme write"] = _share(nvme.read_cpu), _share(nvme.write_cpu)
    on_device = opt is not None and opt.device == "axdimm" and m.axdimm is not None and m.axdimm.backend == "hardware"
    if opt is not None and opt.device == "host":
        worker = m.cpu.adam_cpu
    else:
        worker = m.axdimm.cpu if m.axdimm is not None else None
    out.update(dict.fromkeys(optimizer_lanes, 0.0 if on_device else _share(worker)))
    return out


def _share(measured: float | None) -> float:
    return 1.0 if measured is None else measured


def _timed_mode(layer: LayerCosts, e: LayerPlan, gpu: bool) -> tuple[str, str]:
    """A layer entry's mode and gradient place, refused where the profile has no timing for them (an edited plan
    can ask for DHA on a layer the profiler could not run from host memory)."""
    unknown = gpu and ((e.mode != "gfgb" and layer.fp_dha_s is None) or (e.mode == "dha" and layer.bp_dha_s is None)
                       or (e.grad == "host" and layer.bp_grad_host_s is None))
    if unknown:
        raise HeteroError(f"layers.{e.name}: mode {e.mode} / grad {e.grad} needs DHA or host-gradient timings the "
                          f"profile does not have", hint=f"set `mode: gfgb, grad: gpu` for {e.name}, or re-profile",
                          exit_code=USAGE)
    return e.mode, e.grad


def _static(profile: Profile, opt: OptimizerPlan | None, ps: list[axdimm.Param], host: str) -> dict[str, int]:
    """Bytes each tier holds for the whole iteration, besides the GPU's parameter and gradient buffers (which depend
    on the layer modes: the simulator adds them) and activations. An emulated AXDIMM lives in host memory."""
    gpu, m = profile.machine.gpu is not None, profile.machine
    model = sum(x.params_bytes for x in profile.layers)
    out = {host: model + (model if not gpu or (opt and opt.device != "gpu") else 0)}
    tier_of = {s.param: s.tier for s in opt.states} if opt else {}
    if grads_on_nvme(profile, opt):  # the gradients counted with the model above wait on NVMe instead
        out[host] -= sum(4 * p.num_params for p in ps if tier_of.get(p.name) == "nvme")
    for p in ps:
        tier = tier_of.get(p.name)
        # without a GPU the host update reads the parameter's own `.grad` (counted with the model): no gradient buffer
        size = axdimm.state_bytes(p) - (4 * p.num_params if tier == "host" and not gpu else 0)
        if tier == "host" or (tier == "axdimm" and m.axdimm.backend == "emulated"):
            out[host] += size
        elif tier == "gpu":
            out[GPU] = out.get(GPU, 0) + 8 * p.num_params + (4 * p.num_params if _narrow(profile) else 0)
    if opt and opt.nvme:
        tier = next((t for t in m.tiers if t.path == opt.nvme.path), axdimm.nvme_tier(profile))
        if tier is not None:
            out[tier.name] = out.get(tier.name, 0) + opt.nvme.size_bytes
    return out


def _narrow(profile: Profile) -> bool:
    """Parameters below fp32 need an fp32 master copy beside Adam's m and v."""
    return profile.model.dtype not in ("float32", "float64")


def _staging(profile: Profile, plan: Plan, static: dict[str, int], host: str) -> int:
    """Room for states read back from NVMe: what the placement leaves free on the device."""
    opt = plan.optimizer
    if opt is None or opt.nvme is None:
        return 0
    tier_of = {s.param: s.tier for s in opt.states}
    resident = sum(axdimm.state_bytes(p) for p in axdimm.params(profile) if tier_of.get(p.name) == opt.device)
    if opt.device == "axdimm":
        ax = profile.machine.axdimm
        return max(0, ax.channels * ax.channel_capacity_bytes - resident)
    capacity = plan.budget.dram_budget_bytes or next(t.capacity_bytes for t in profile.machine.tiers if t.name == host)
    return max(0, capacity - static.get(host, 0))


def sync_times(profile: Profile, plan: Plan) -> list[float]:
    """Each layer's gradient all-reduce time under the plan's routing; empty without routing."""
    r = plan.routing
    links, ranks = routing.links(profile)
    by_peer = {k.peer: k.curve for k in links}
    if r is None or r.latency_peer not in by_peer or r.bandwidth_peer not in by_peer:
        return []
    lat, bw = by_peer[r.latency_peer], by_peer[r.bandwidth_peer]
    return [routing.sync_time_s(x.params_bytes, ranks, r.threshold_bytes, r.shard_bytes, lat, bw) if x.params_bytes
            else 0.0 for x in profile.layers]
