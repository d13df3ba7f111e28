"""What the optimizer section holds in each tier: the bytes its placement keeps for the whole iteration (the
simulator's static bytes), the host staging of NVMe-held states, and its entries of the host-memory account
(hetero.plan.footprint). Pure: no torch, no I/O."""

from __future__ import annotations

from hetero.plan import axdimm
from hetero.plan.model import GPU
from hetero.plan.section import HostPeak
from hetero.plan.sections.layers import model_host_bytes
from hetero.schema.plan import NvmeOverflow, OptimizerPlan, Plan
from hetero.schema.profile import Profile

ADAM_STATE_BYTES_PER_PARAM = 8  # fp32 m and v, as torch's Adam(W) keeps them beside each parameter
STATES = "script's adam states"
OPTIMIZER = "hetero optimizer"  # master copies, states, gradient buffers, an emulated AXDIMM's channels
STAGING = "nvme state staging"


def grads_on_nvme(profile: Profile, optimizer: OptimizerPlan | None) -> bool:
    """The gradients of NVMe-held parameters wait on NVMe between backward and step (host-trained ones only)."""
    return optimizer is not None and optimizer.nvme is not None and optimizer.nvme.grads and \
        profile.machine.gpu is None


def static_bytes(profile: Profile, optimizer: OptimizerPlan | None, host: str) -> dict[str, int]:
    """Bytes each tier holds for the whole iteration with this optimizer section, beyond `model_host_bytes`
    (the GPU's parameter and gradient buffers depend on the layer modes: the simulator adds them). An emulated
    AXDIMM lives in host memory."""
    gpu, m, ps = profile.machine.gpu is not None, profile.machine, axdimm.params(profile)
    model = sum(x.params_bytes for x in profile.layers)
    out = {host: model if gpu and optimizer and optimizer.device != "gpu" else 0}  # gradients reach the host
    tier_of = {s.param: s.tier for s in optimizer.states} if optimizer else {}
    if grads_on_nvme(profile, optimizer):  # the gradients counted with the model wait on NVMe instead
        out[host] -= sum(4 * p.num_params for p in ps if tier_of.get(p.name) == "nvme")
    for p in ps:
        tier = tier_of.get(p.name)
        size = axdimm.state_bytes(p) - 4 * p.num_params * _not_held(optimizer, tier, gpu)
        if tier == "host" or (tier == "axdimm" and m.axdimm.backend == "emulated"):
            out[host] += size
        elif tier == "gpu":
            out[GPU] = out.get(GPU, 0) + 8 * p.num_params + (4 * p.num_params if _narrow(profile) else 0)
    if optimizer and optimizer.nvme:
        tier = next((t for t in m.tiers if t.name == optimizer.nvme.tier), None) or \
            next((t for t in m.tiers if t.path == optimizer.nvme.path), axdimm.nvme_tier(profile))
        if tier is not None:
            out[tier.name] = out.get(tier.name, 0) + optimizer.nvme.size_bytes
    return out


def _not_held(optimizer: OptimizerPlan | None, tier: str | None, gpu: bool) -> int:
    """How many of a parameter's four fp32 update buffers its home does not hold: without a GPU the host update
    reads the parameter's own `.grad` (counted with the model), and where the plan's rule shares the master
    (`OptimizerPlan.shares_master`) the parameter's own bytes are it."""
    if optimizer is None or tier is None:
        return 0
    return int(tier == "host" and not gpu) + int(optimizer.shares_master(tier))


def host_static_bytes(profile: Profile, optimizer: OptimizerPlan | None, host: str) -> int:
    """Bytes host memory holds for the whole iteration with this optimizer section, activations aside."""
    return model_host_bytes(profile) + static_bytes(profile, optimizer, host).get(host, 0)


def gpu_state_bytes(profile: Profile, optimizer: OptimizerPlan | None, host: str) -> int:
    """Bytes of optimizer states the plan's own optimizer keeps on the GPU (`optimizer.device: gpu`)."""
    return static_bytes(profile, optimizer, host).get(GPU, 0)


def _narrow(profile: Profile) -> bool:
    """Parameters below fp32 need an fp32 master copy beside Adam's m and v."""
    return profile.model.dtype not in ("float32", "float64")


def simulated_staging_bytes(profile: Profile, plan: Plan, host_static: int, host: str) -> int:
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
    return max(0, capacity - host_static)


def own_states_in_host(profile: Profile) -> int:
    """Bytes of the script's own Adam states that live in host memory under plain training (with its parameters,
    so only without a GPU)."""
    if profile.machine.gpu is not None or profile.training.optimizer not in ("adam", "adamw"):
        return 0
    return ADAM_STATE_BYTES_PER_PARAM * sum(p.num_params for p in axdimm.params(profile))


def staging_bytes(profile: Profile, optimizer: OptimizerPlan | None) -> int:
    """Host memory the runtime holds to stage NVMe-held states when the host updates them
    (hetero.run.nvme_states): two slots of master, m and v sized for the largest staged piece (a GPU's parameter
    whole, with a gradient buffer each; a CPU's in pieces), and the state store's bounce buffers."""
    if optimizer is None or optimizer.device != "host" or optimizer.nvme is None:
        return 0
    tier = {s.param: s.tier for s in optimizer.states}
    spilled = [p.num_params for p in axdimm.params(profile) if tier.get(p.name) == "nvme"]
    if not spilled:
        return 0
    gpu = profile.machine.gpu is not None
    piece = max(spilled) if gpu else min(max(spilled), NvmeOverflow.STAGING_PIECE_PARAMS)
    buffers = 4 if gpu or optimizer.nvme.grads else 3  # master, m, v (and a gradient: a GPU's, or one from NVMe)
    return NvmeOverflow.STAGING_SLOTS * buffers * 4 * piece + \
        NvmeOverflow.STORE_THREADS * NvmeOverflow.STORE_CHUNK_BYTES


def added_host_bytes(profile: Profile, optimizer: OptimizerPlan | None, host: str) -> int:
    """What the optimizer section holds in host memory for the whole iteration beyond plain training: offloaded
    states, master copies and gradient buffers, an emulated AXDIMM's channels, staging (negative: it holds less)."""
    if optimizer is None:
        return 0
    return (host_static_bytes(profile, optimizer, host) - host_static_bytes(profile, None, host)
            - own_states_in_host(profile) + staging_bytes(profile, optimizer))


def host_entries(profile: Profile, plan: Plan, peak: HostPeak) -> dict[str, int]:
    """The optimizer section's entries of the host-memory account."""
    if plan.optimizer is None:
        return {}
    own, staging = own_states_in_host(profile), staging_bytes(profile, plan.optimizer)
    return {STATES: -own, OPTIMIZER: added_host_bytes(profile, plan.optimizer, peak.host) + own - staging,
            STAGING: staging}
