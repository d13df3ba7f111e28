"""Adam updates timed as the runtime drives them: a place's driver thread runs hetero's kernel, the caller waits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetero.kernels.adam import AdamKernel, Hyperparameters
from hetero.profile.timing import beside_compute, median_time, share
from hetero.run.states import AxdimmHome, Driver, HostHome
from hetero.units import measured

UPDATE_SIZES = (4096, 4 * 2**20)  # parameters per update, small and large: a fixed cost plus a rate


@dataclass(frozen=True, slots=True)
class Updates:
    """Adam updates as the runtime drives them: a fixed cost per update and a rate, alone; with the CPU computing,
    the same beside compute and each worker's share of a streaming worker's slowdown of it."""

    launch_s: float
    rate: float
    cpu: float | None = None
    beside_launch_s: float | None = None
    beside_rate: float | None = None


def time_updates(jobs: dict[int, list[Callable[[], None]]], slowdown: float | None) -> Updates:
    """`jobs[n]`: one update of n parameters per worker, each waiting for its own end. Alone on the first worker;
    with `slowdown` (the CPU computes) on every worker at once beside compute, as backward runs them."""
    sizes = tuple(jobs)
    launch, rate = fixed_and_rate(sizes, [median_time(jobs[n][0], repeats=11) for n in sizes])
    if not slowdown:
        return Updates(launch_s=launch, rate=rate)
    beside = [beside_compute(jobs[n]) for n in sizes]
    beside_launch, beside_rate = fixed_and_rate(sizes, [b.work_s for b in beside])
    return Updates(launch_s=launch, rate=rate, cpu=share(beside[-1].compute, slowdown, len(jobs[sizes[-1]])),
                   beside_launch_s=beside_launch, beside_rate=beside_rate)


def host_adam(slowdown: float | None = None, sizes: tuple[int, int] = UPDATE_SIZES) -> Updates:
    """The `host` optimizer device as the runtime drives it: hetero's Adam kernel on one driver thread, the caller
    waiting for the update (of `sizes` parameters: small, then large)."""
    driver, kernel = Driver("host-adam"), AdamKernel()
    try:
        jobs = {n: [update_job(HostHome(driver, kernel, torch.zeros(n)), driver, n)] for n in sizes}
        return time_updates(jobs, slowdown)
    finally:
        driver.close()


def host_adam_beyond_cache(params: int, launch_s: float) -> float:
    """Params/s of the `host` optimizer device on one update of `params` parameters (sized beyond the caches),
    less `launch_s` (a call's fixed cost)."""
    driver, kernel = Driver("host-adam"), AdamKernel()
    try:
        job = update_job(HostHome(driver, kernel, torch.zeros(params)), driver, params)
        return params / max(median_time(job, repeats=3, min_s=0) - launch_s, 1e-9)
    finally:
        driver.close()


def measured_or_none(value: float | None) -> float | None:
    """`measured(value)`, or None where nothing was measured."""
    return None if value is None else measured(value)


def fixed_and_rate(sizes: tuple[int, int], times: list[float]) -> tuple[float, float]:
    """(fixed seconds, units per second) of a line through two (size, time) points."""
    rate = (sizes[1] - sizes[0]) / max(times[1] - times[0], 1e-9)
    return max(0.0, times[0] - sizes[0] / rate), rate


def update_job(home: AxdimmHome | HostHome, driver: Driver, numel: int) -> Callable[[], None]:
    """One update of `home`'s first `numel` parameters through `driver`, returning when it is done."""
    grad, hp = torch.full((numel,), 1e-3), Hyperparameters(decoupled_weight_decay=True)

    def update() -> None:
        home.update(grad, hp, step=1)
        driver.drain()

    return update
