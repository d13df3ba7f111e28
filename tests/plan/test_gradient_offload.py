"""GO-MemFerry's DP: equal to brute force, never over the reserve, monotone in the reserve."""

import itertools
import random

import pytest

from hetero.errors import HeteroError
from hetero.plan import gradient_offload
from hetero.plan.gradient_offload import GradItem, grid_bytes, grid_cells, knapsack, offload
from tests.figures import figures


@pytest.fixture
def coarse(monkeypatch):
    """A 1024-cell grid: the sweeps below solve hundreds of DPs, and the properties do not depend on the grid."""
    monkeypatch.setattr(gradient_offload, "MAX_CELLS", 1024)


def random_items(rng: random.Random, n: int) -> list[GradItem]:
    items = []
    for k in range(n):
        size = rng.choice([0, rng.randint(1, 50_000), rng.randint(1, 5_000_000)])
        gain = rng.choice([None, -rng.uniform(0, 1e-3), rng.uniform(0, 2e-3), 0.0]) if k % 5 else rng.uniform(0, 2e-3)
        items.append(GradItem(name=f"l{k}", size_bytes=size, gain_s=gain))
    return items


def brute_force(items: list[GradItem], reserve: float) -> tuple[float, int]:
    """Best (gain, kept bytes) over every subset, on the same grid the DP uses (forced items always kept); every
    item where all fit the reserve in bytes."""
    total = sum(it.size_bytes for it in items)
    grid = grid_bytes(total, len(items))
    cells = lambda it: -(-it.size_bytes // grid)  # noqa: E731
    forced = [it for it in items if it.size_bytes and it.gain_s is None]
    free = [it for it in items if it.size_bytes and it.gain_s is not None and it.gain_s >= 0]
    if sum(it.size_bytes for it in forced + free) <= int(reserve * total):
        return sum(it.gain_s for it in free), sum(it.size_bytes for it in forced + free)
    room = int(reserve * total) // grid - sum(map(cells, forced))
    best = (0.0, 0)
    for r in range(len(free) + 1):
        for subset in itertools.combinations(free, r):
            if sum(map(cells, subset)) <= room:
                best = max(best, (sum(it.gain_s for it in subset), sum(it.size_bytes for it in subset)))
    return best[0], best[1] + sum(it.size_bytes for it in forced)


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force_and_stays_within_the_reserve(seed):
    rng = random.Random(seed)
    items = random_items(rng, rng.randint(1, 10))
    total = sum(it.size_bytes for it in items)
    reserve = rng.choice([0.0, 0.1, 0.3, 0.5, 0.8, 1.0])
    forced = sum(it.size_bytes for it in items if it.gain_s is None)
    grid = grid_bytes(total, len(items))
    fits = sum(it.size_bytes for it in items if it.gain_s is None or it.gain_s >= 0) <= int(reserve * total)
    if forced > int(reserve * total) // grid * grid and not fits:
        with pytest.raises(HeteroError, match="--reserve"):
            offload(items, reserve)
        return
    result = offload(items, reserve)
    gain, kept = brute_force(items, reserve)
    assert result.gain_s == pytest.approx(gain, abs=1e-15)
    assert result.kept_bytes == kept
    assert result.kept_bytes <= reserve * total
    assert all(keep for it, keep in zip(items, result.keep) if it.gain_s is None and it.size_bytes)
    assert not any(keep for it, keep in zip(items, result.keep) if it.gain_s is not None and it.gain_s < 0)


@pytest.mark.parametrize("seed", range(30))
def test_a_larger_reserve_never_moves_more_gradients_to_host(seed, coarse):
    """Exact in bytes when sizes are multiples of the grid (as here); in grid cells always (next test)."""
    rng = random.Random(seed)
    n = 12
    cuts = sorted(rng.sample(range(1, grid_cells(n)), n - 1))
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, grid_cells(n)])]
    items = [GradItem(name=f"l{k}", size_bytes=part * 4096, gain_s=rng.choice([-1e-4, 0.0, rng.uniform(0, 1e-3)]))
             for k, part in enumerate(parts)]
    assert grid_bytes(sum(it.size_bytes for it in items), n) == 4096
    host = [sum(it.size_bytes for it, keep in zip(items, offload(items, r / 20).keep) if not keep)
            for r in range(21)]
    assert host == sorted(host, reverse=True)
    assert host[-1] == sum(it.size_bytes for it in items if it.gain_s < 0)


@pytest.mark.parametrize("seed", range(30))
def test_kept_grid_cells_grow_with_the_reserve(seed, coarse):
    rng = random.Random(seed)
    items = [GradItem(name=it.name, size_bytes=it.size_bytes, gain_s=it.gain_s if it.gain_s is not None else 1e-4)
             for it in random_items(rng, 12)]
    grid = grid_bytes(sum(it.size_bytes for it in items), len(items))
    cells = [sum(-(-it.size_bytes // grid) for it, keep in zip(items, offload(items, r / 20).keep) if keep)
             for r in range(21)]
    assert cells == sorted(cells)


def test_the_grid_depends_on_the_total_only_and_is_recorded():
    items = [GradItem(name="a", size_bytes=3_000_000, gain_s=1e-3), GradItem(name="b", size_bytes=1_000_001,
                                                                              gain_s=2e-3)]
    grids = {offload(items, r).grid_bytes for r in (0.1, 0.5, 1.0)}
    assert grids == {-(-4_000_001 // 65536)}


def test_worked_example_prefers_the_best_gain_per_budget():
    """Reserve 51% of 10 MiB: keeping a (4 MiB, 3 ms) + c (1 MiB, 1 ms) beats b (5 MiB, 3.5 ms) alone (at exactly
    50% the rounded-up sizes of a and c would take one grid cell more than the reserve)."""
    mib = 2**20
    items = [GradItem(name="a", size_bytes=4 * mib, gain_s=3e-3), GradItem(name="b", size_bytes=5 * mib,
                                                                            gain_s=3.5e-3),
             GradItem(name="c", size_bytes=mib, gain_s=1e-3)]
    result = offload(items, 0.51)
    assert (result.keep, result.grid_bytes, result.kept_bytes) == ([True, False, True], 160, 5 * mib)
    assert result.gain_s == pytest.approx(4e-3)
    assert figures(result.why[1])[0] == "3.5ms"  # b's gain, lost by offloading it
    assert figures(result.why[0])[-3:] == ["5MiB", "5.1MiB", "0.51"]  # kept, of the reserve, its fraction
    assert offload(items, 0.5).keep == [False, True, False]


def test_pinned_gradients_are_kept_as_written_and_count_against_the_reserve():
    mib = 2**20
    items = [GradItem(name="a", size_bytes=4 * mib, gain_s=3e-3, pinned="host"),
             GradItem(name="b", size_bytes=5 * mib, gain_s=3.5e-3, pinned="gpu"),
             GradItem(name="c", size_bytes=mib, gain_s=1e-3)]
    assert offload(items, 0.61).keep == [False, True, True]  # b pinned to the GPU, then c fits
    assert offload(items, 0.55).keep == [False, True, False]
    with pytest.raises(HeteroError, match="must stay there") as e:
        offload(items, 0.3)
    assert e.value.hint.startswith("use --reserve 0.51")


def test_knapsack_tie_keeps_more_bytes():
    assert knapsack([1, 1], [1.0, 1.0], [10, 20], 1) == [1]


def test_a_reserve_every_gradient_fits_keeps_every_one_however_many_cells_they_round_to():
    """1000 gradients on the grid's 1024 cells round up to more cells than the reserve has: the table alone would
    send some to the host though all fit in bytes."""
    rng = random.Random(0)
    items = [GradItem(name=f"l{k}", size_bytes=rng.randint(1, 5_000_000), gain_s=rng.uniform(0, 2e-3))
             for k in range(1000)]
    total = sum(it.size_bytes for it in items)
    grid = grid_bytes(total, len(items))
    assert sum(-(-it.size_bytes // grid) for it in items) > total // grid  # the rounding this is about
    result = offload(items, 1.0)
    assert all(result.keep) and result.kept_bytes == total
    assert result.gain_s == pytest.approx(sum(it.gain_s for it in items))
