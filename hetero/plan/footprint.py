"""The whole process's host memory under a plan: plain training's measured peak, plus what the plan's runtime holds
in host memory beyond plain, plus what the plan moves into host memory from a faster tier.

The profile measures plain training's peak resident memory (interpreter, libraries, allocator slack included); the
plan changes it by a difference of the simulator's static bytes, so everything plain and planned runs share
cancels. Saved activations evicted *from* host memory are not subtracted: the allocator keeps the memory they
freed for the next ones (glibc's heap does not shrink under the live tensors around it), so the process's peak
stays where plain training put it (docs/benchmarks.md, "Memory is what the process pays").
"""

from __future__ import annotations

from hetero.plan import axdimm
from hetero.plan.choices import host_static_bytes
from hetero.schema.plan import OptimizerPlan, Plan
from hetero.schema.profile import Profile

ADAM_STATE_BYTES_PER_PARAM = 8  # fp32 m and v, as torch's Adam(W) keeps them beside each parameter


def own_states_in_host(profile: Profile) -> int:
    """Bytes of the script's own Adam states that live in host memory under plain training (with its parameters,
    so only without a GPU)."""
    if profile.machine.gpu is not None or profile.training.optimizer == "other":
        return 0
    return ADAM_STATE_BYTES_PER_PARAM * sum(p.num_params for p in axdimm.params(profile))


def added_host_bytes(profile: Profile, optimizer: OptimizerPlan | None) -> int:
    """What the optimizer section holds in host memory for the whole iteration beyond plain training: offloaded
    states, master copies and gradient buffers, an emulated AXDIMM's channels (negative: it holds less)."""
    if optimizer is None:
        return 0
    return host_static_bytes(profile, optimizer) - host_static_bytes(profile, None) - own_states_in_host(profile)


def dram_peak_bytes(profile: Profile, plan: Plan, simulated_host_peak: int, evicted_from_host_peak: int) -> int:
    """The process's predicted peak resident memory. `simulated_host_peak`: the simulator's host peak (static bytes
    plus activations there); `evicted_from_host_peak`: the saved-activation bytes of that peak when host memory is
    the fast tier (0 with a GPU, where host memory is where they go instead)."""
    assert profile.memory is not None
    moved_in = simulated_host_peak - host_static_bytes(profile, plan.optimizer) - evicted_from_host_peak
    return profile.memory.dram_peak_bytes + added_host_bytes(profile, plan.optimizer) + max(0, moved_in)

