"""The one memory policy: how a plan under a DRAM budget is trusted, and what margins it keeps.

The plan `hetero plan` chooses by prediction (hetero.plan.footprint) is run in fresh processes, stopped at the
budget (a trial, hetero.launch.trials), and kept only where what they measured fits. The margins come from the
trial, not from constants fitted to one machine:

- **spread**: with malloc's defaults, peaks vary between processes (address-space randomization); a plan keeps the
  trial's range above its highest peak (for 3 normal peaks, about 2.5 standard deviations above their mean);
- **mapped files**: a memory limit also charges the file pages a process keeps using, which a trial measures as
  those its processes referenced in their timed steps;
- **steps**: a plan a trial verified predicts the step it measured.

The profile, which must survive its budget before any of this is known, keeps the room `room_of` leaves
(`profile_headroom` and `profile_mapped_bytes`). Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.schema.plan import Trial


@dataclass(frozen=True, slots=True)
class MemoryPolicy:
    """How trials run and how they are judged; the defaults are documented field by field."""

    trial_processes: int = 3  # fresh processes per trial: their range is the spread a plan keeps above them
    max_trials: int = 4  # candidates tried at most, after which the fastest that fit is taken (or the floor said)
    timed_steps: int = 2  # a trial process's step time: the mean of its last this many steps
    settle_steps: int = 2  # ... which ends once this many steps in a row raised its peak by less than settle_bytes
    settle_bytes: int = 2 << 20  # a step's own noise in the peak
    max_steps: int = 16  # at most this many steps (a peak still rising then rises with the script's own state)
    poll_s: float = 0.002  # how often a trial process reads its resident memory to stop itself at the budget
    profile_headroom: float = 0.03  # the profile's own room under a budget: for its estimates' error ...
    profile_mapped_bytes: int = 16 << 20  # ... and the file pages a process under a limit keeps using
    gpu_headroom: float = 0.03  # a GPU plan's predicted peak keeps this far under a GPU budget (untried on a GPU)
    # Plain training estimated (at its first gradient) under this share of a budget: the budget binds nothing and the
    # profile measures as without one. The estimate sees backward's start only, hence well under a half.
    profile_ample_share: float = 0.25
    profile_block_share: float = 0.125  # before any block ran as written, one is taken to add this share of a budget
    warn_share: float = 0.05  # a run warns once its host peak comes within this share of its budget
    # Below the allocator's switch, the heaps are trimmed after a backward that ended holding this share of the
    # switch's `from_bytes` more than any backward before: the heaps grow within a bound, and a script whose heaps
    # do not grow pays no trim.
    trim_growth_share: float = 1 / 64

    def held_bytes(self, trial: Trial) -> int:
        """The most a process running the trial's plan is taken to hold: its highest measured peak, the trial's
        spread above it, and the file pages its steps used; where a process reached the budget, at least what it
        stopped at."""
        measured = max(trial.peaks_bytes) + spread_bytes(trial) + trial.mapped_bytes if trial.peaks_bytes else 0
        return max(measured, trial.stop_bytes + 1) if trial.stopped else measured

    def fits(self, trial: Trial, budget_bytes: int) -> bool:
        """Whether the trial verified its plan under `budget_bytes`: every process settled below the budget, and
        what `held_bytes` takes them to hold fits it."""
        return trial.stopped == 0 and len(trial.peaks_bytes) >= 2 and self.held_bytes(trial) <= budget_bytes

    def room_of(self, budget_bytes: int) -> int:
        """The most the profile lets its own training hold under `budget_bytes`."""
        return int(budget_bytes * (1 - self.profile_headroom)) - self.profile_mapped_bytes


def spread_bytes(trial: Trial) -> int:
    """The range of the trial's measured peaks (0 for one)."""
    return max(trial.peaks_bytes) - min(trial.peaks_bytes) if trial.peaks_bytes else 0


POLICY = MemoryPolicy()
