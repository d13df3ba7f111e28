"""The whole process's host memory under a plan: plain training's measured peak, plus what the plan's runtime holds
in host memory beyond plain, plus what the plan moves into host memory from a faster tier, less what it moves out.

The profile measures plain training's peak resident memory (interpreter, libraries, allocator slack included); the
plan changes it by a difference of the simulator's static bytes, so everything plain and planned runs share
cancels. With glibc's default allocator, saved activations evicted *from* host memory are not subtracted: the
allocator keeps the memory they freed for the next ones, so the process's peak stays where plain training put it
(docs/benchmarks.md, "Memory is what the process pays"). A plan whose `allocator` section returns freed memory
starts from the peak the profile measured that way, and there evictions do lower it: by the simulated drop of
the saved-activation peak. Recomputed blocks (the plan's `recompute`) never allocate what they would have saved, so
they lower it with either allocator (hetero.plan.recompute.peak_drop).

`contributors` is the one account: the predicted peak is its sum, the plan writes it (`predicted.dram`) and
`hetero run` names its largest entries when the process nears the budget.
"""

from __future__ import annotations

from hetero.plan import axdimm, recompute
from hetero.plan.choices import host_static_bytes
from hetero.schema.plan import ActivationPlan, NvmeOverflow, OptimizerPlan, Plan
from hetero.schema.profile import Profile

ADAM_STATE_BYTES_PER_PARAM = 8  # fp32 m and v, as torch's Adam(W) keeps them beside each parameter
PLAIN = "plain training"  # its measured peak
PLAIN_RETURNED = "plain training, memory returned"  # its peak measured with freed memory returned
STATES = "script's adam states"
OPTIMIZER = "hetero optimizer"  # master copies, states, gradient buffers, an emulated AXDIMM's channels
STAGING = "nvme state staging"
MOVED_IN = "moved in from the gpu"
TIERING = "activation store buffers"
EVICTED = "evicted activations"
GRADS_FREED = "gradients freed in backward"
RECOMPUTED = "activations recomputed in backward"
BELOW_SWITCH = "malloc's defaults below the switch"  # a plan whose allocator returns memory from `from_bytes` on


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


def added_host_bytes(profile: Profile, optimizer: OptimizerPlan | None) -> int:
    """What the optimizer section holds in host memory for the whole iteration beyond plain training: offloaded
    states, master copies and gradient buffers, an emulated AXDIMM's channels, staging (negative: it holds less)."""
    if optimizer is None:
        return 0
    return (host_static_bytes(profile, optimizer) - host_static_bytes(profile, None) - own_states_in_host(profile)
            + staging_bytes(profile, optimizer))


def grads_freed_in_backward(profile: Profile) -> int:
    """What updating in backward (the plan's `update_in_backward`) takes off the peak: every gradient but the
    largest parameter's (a tied embedding's lives through the whole backward), less the two parameter-sized
    temporaries torch's Adam makes for that parameter's update, which now fall inside backward."""
    sizes = [p.num_params for p in axdimm.params(profile)]
    return max(0, 4 * (sum(sizes) - 3 * max(sizes, default=0)))


def returns_memory(profile: Profile, plan: Plan) -> bool:
    """The plan returns freed memory and the profile measured the peak that way."""
    return plan.allocator is not None and profile.memory is not None and \
        profile.memory.dram_peak_returned_bytes is not None


def contributors(profile: Profile, plan: Plan, simulated_host_peak: int, evicted_from_host_peak: int,
                 evicted_saving: int) -> dict[str, int]:
    """The predicted peak by what makes it up. `simulated_host_peak`: the simulator's host peak (static bytes plus
    activations there); `evicted_from_host_peak`: the saved-activation bytes of that peak when host memory is the
    fast tier (0 with a GPU, where host memory is where they go instead); `evicted_saving`: how much tiering lowers
    the saved-activation peak in host memory (counted only where freed memory is returned)."""
    assert profile.memory is not None
    returned = returns_memory(profile, plan)
    out = {PLAIN_RETURNED: profile.memory.dram_peak_returned_bytes} if returned else \
        {PLAIN: profile.memory.dram_peak_bytes}
    if plan.optimizer is not None:
        own, staging = own_states_in_host(profile), staging_bytes(profile, plan.optimizer)
        out[STATES] = -own
        out[OPTIMIZER] = added_host_bytes(profile, plan.optimizer) + own - staging
        out[STAGING] = staging
    moved_in = simulated_host_peak - host_static_bytes(profile, plan.optimizer) - evicted_from_host_peak
    out[MOVED_IN] = max(0, moved_in)
    out[EVICTED] = -evicted_saving if returned else 0
    out[GRADS_FREED] = -grads_freed_in_backward(profile) if plan.update_in_backward is not None else 0
    out[RECOMPUTED] = -recompute.peak_drop(profile, plan.recompute)
    tiered = evicted_from_host_peak and plan.activations is not None and \
        any(e.evict_bytes for e in plan.activations.schedule)
    out[TIERING] = ActivationPlan.STORE_BOUNCES * ActivationPlan.STORE_CHUNK_BYTES if tiered else 0
    return {what: b for what, b in out.items() if b}


def dram_peak_bytes(profile: Profile, plan: Plan, simulated_host_peak: int, evicted_from_host_peak: int,
                    evicted_saving: int = 0) -> int:
    """The process's predicted peak resident memory: the sum of `contributors`."""
    return sum(contributors(profile, plan, simulated_host_peak, evicted_from_host_peak, evicted_saving).values())
