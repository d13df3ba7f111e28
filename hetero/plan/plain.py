"""Plain training as the profile measured it, and a plan's iteration anchored on it: plain training's measured step
plus the simulated difference between the plan and plain training, since a process pays for more than the simulator
times (launch gaps, data, what a script does between steps). A plan that moves nothing is predicted as measured.
"""

from __future__ import annotations

from hetero.schema.profile import Profile


def anchored_iteration_s(profile: Profile, simulated_s: float, plain_simulated_s: float) -> float:
    """A plan's iteration: plain training's measured step (on a GPU timed without the profiler's hooks, whose launch
    gaps a CPU's kernels hide) plus the simulated difference, so that a plan that moves nothing is predicted as
    measured, however the simulator counts the script's steps (a GAN's three backward calls); the simulation as is
    where a GPU's plain step was not timed."""
    t = profile.training
    measured = t.plain_iteration_s if profile.machine.gpu is not None else t.iteration_s
    if measured is None:  # a GPU's plain step untimed (an older profile, a single warm-up step)
        return simulated_s
    return max(0.0, measured + simulated_s - plain_simulated_s)
