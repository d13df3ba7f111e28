"""The whole process's host memory under a plan: plain training's measured peak, plus what the plan's runtime holds
in host memory beyond plain, plus what the plan moves into host memory from a faster tier, less what it moves out.

The plan changes the profile's measured peak by a difference of the simulator's static bytes, so what plain and
planned runs share cancels. With glibc's defaults, activations evicted from host memory are subtracted only up to
the activation store's own buffers (the allocator keeps what they freed); a plan whose `allocator` returns freed
memory starts from the peak measured that way, and evictions lower it by the simulated drop of the saved-activation
peak. Recomputed blocks and updates in backward lower it by what they keep from coexisting (hetero.plan.backward).

`contributors` is the one account: the predicted peak is its sum, the plan writes it (`predicted.dram`) and
`hetero run` names its largest entries near the budget. Each section writes its own entries
(`Section.host_bytes`); the entry names are re-exported here for the account's readers.
"""

from __future__ import annotations

from hetero.plan.choices import host_tier, static_bytes
from hetero.plan.section import HostPeak
from hetero.plan.sections import TABLE
from hetero.plan.sections.activations import EVICTED, TIERING
from hetero.plan.sections.optimizer_bytes import ADAM_STATE_BYTES_PER_PARAM, OPTIMIZER, STAGING, STATES
from hetero.plan.sections.recompute import RECOMPUTED
from hetero.plan.sections.update_in_backward import GRADS_FREED
from hetero.schema.plan import Plan
from hetero.schema.profile import Profile

__all__ = ["ADAM_STATE_BYTES_PER_PARAM", "EVICTED", "GRADS_FREED", "OPTIMIZER", "RECOMPUTED",
           "STAGING", "STATES", "TIERING", "contributors", "dram_peak_bytes", "returns_memory"]

PLAIN = "plain training"  # its measured peak
PLAIN_RETURNED = "plain training, memory returned"  # its peak measured with freed memory returned
MOVED_IN = "moved in from the gpu"
# The order plans have always listed their entries in; an entry not here follows them, in the sections' order.
ORDER = (PLAIN, PLAIN_RETURNED, STATES, OPTIMIZER, STAGING, MOVED_IN, EVICTED, GRADS_FREED,
         RECOMPUTED, TIERING)


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
    host, returned = host_tier(profile), returns_memory(profile, plan)
    if returned:
        out = {PLAIN_RETURNED: profile.memory.dram_peak_returned_bytes}
    else:
        out = {PLAIN: profile.memory.dram_peak_bytes}
    moved_in = simulated_host_peak - static_bytes(profile, plan)[host] - evicted_from_host_peak
    out[MOVED_IN] = max(0, moved_in)
    peak = HostPeak(host=host, simulated_bytes=simulated_host_peak, evicted_from_peak=evicted_from_host_peak,
                    evicted_saving=evicted_saving, memory_returned=returned)
    for section in TABLE:
        out.update(section.host_bytes(profile, plan, peak))
    ordered = {what: out[what] for what in ORDER if what in out} | out
    return {what: b for what, b in ordered.items() if b}


def dram_peak_bytes(profile: Profile, plan: Plan, simulated_host_peak: int, evicted_from_host_peak: int,
                    evicted_saving: int = 0) -> int:
    """The process's predicted peak resident memory: the sum of `contributors`."""
    return sum(contributors(profile, plan, simulated_host_peak, evicted_from_host_peak, evicted_saving).values())
