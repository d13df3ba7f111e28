"""Which layers write their gradients straight to pinned host memory (GO-MemFerry §IV-D).

The reserve factor bounds the gradient bytes kept on the GPU. Keeping layer i's gradients there saves
T_GBP(i) - T_CBP(i) of backward time: a 0/1 knapsack, solved by the paper's dynamic program
D[i][j] = max(D[i-1][j], D[i-1][j - s_i] + T_GBP(i) - T_CBP(i)) over a byte grid. Sizes round up to the grid and the
capacity down, so the kept bytes never exceed the reserve; where every gradient fits, all are kept without the
table. Of equal gains the one keeping more bytes wins, so a larger capacity never keeps fewer grid cells.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.errors import USAGE, HeteroError
from hetero.schema.plan import GradPlace, LayerGrad
from hetero.units import SIZE, TIME

DP_CELL_UPDATES = 300_000  # table size the DP may fill (bounds its time); a finer grid for models with fewer layers
MIN_CELLS, MAX_CELLS = 1024, 65536


@dataclass(kw_only=True, slots=True)
class GradItem:
    name: str
    size_bytes: int
    gain_s: float | None  # T_GBP - T_CBP; None: no host-write timing, the gradient stays on the GPU
    pinned: GradPlace | None = None  # where the user pinned the entry's gradient; None: not pinned


@dataclass(kw_only=True, slots=True)
class Offload:
    keep: list[bool]  # True: the gradient stays on the GPU
    grid_bytes: int
    capacity_bytes: int
    kept_bytes: int
    gain_s: float
    why: list[str]


def grid_cells(n_items: int) -> int:
    """Cells over the whole gradient: as many as the time budget allows, from the model alone, so the grid never
    depends on the reserve (a larger reserve then only ever adds cells)."""
    return min(MAX_CELLS, max(MIN_CELLS, DP_CELL_UPDATES // max(1, n_items)))


def grid_bytes(total_bytes: int, n_items: int) -> int:
    return max(1, -(-total_bytes // grid_cells(n_items)))


def offload(items: list[GradItem], reserve: float) -> Offload:
    total = sum(it.size_bytes for it in items)
    grid = grid_bytes(total, len(items))
    capacity = int(reserve * total)
    cells = [-(-it.size_bytes // grid) for it in items]
    forced = [k for k, it in enumerate(items) if it.size_bytes and (it.pinned == LayerGrad.GPU or
                                                                     (it.pinned is None and it.gain_s is None))]
    candidates = [k for k, it in enumerate(items) if it.size_bytes and it.pinned is None and it.gain_s is not None
                  and it.gain_s >= 0]
    if sum(items[k].size_bytes for k in forced + candidates) <= capacity:
        # all of them, as the table would without its rounding: each size rounded up to whole cells can need more
        # cells than the reserve has (1000 gradients on a 1024-cell grid: 1752), dropping gradients that fit
        chosen = list(range(len(candidates)))
    else:
        free_cells = capacity // grid - sum(cells[k] for k in forced)
        if free_cells < 0:
            _too_small(items, forced, capacity, reserve, total)
        chosen = knapsack([cells[k] for k in candidates], [items[k].gain_s for k in candidates],
                          [items[k].size_bytes for k in candidates], free_cells)
    keep = [False] * len(items)
    for k in forced + [candidates[c] for c in chosen]:
        keep[k] = True
    kept = sum(it.size_bytes for it, kp in zip(items, keep) if kp)
    gain = sum(items[candidates[c]].gain_s for c in chosen)
    result = Offload(keep=keep, grid_bytes=grid, capacity_bytes=capacity, kept_bytes=kept, gain_s=gain, why=[])
    use = f"kept {SIZE.format_short(kept)} of the {SIZE.format_short(capacity)} reserve ({reserve:g})"
    result.why = [_why(it, kp, use) for it, kp in zip(items, keep)]
    return result


def knapsack(weights: list[int], values: list[float], sizes: list[int], capacity: int) -> list[int]:
    """Indices maximizing (total value, total size) with total weight <= capacity: the paper's table, kept as one
    row updated in place from high capacities down, with a bit per item and capacity to walk back."""
    best = [0.0] * (capacity + 1)
    size = [0] * (capacity + 1)
    taken = []
    for w, v, s in zip(weights, values, sizes):
        row = bytearray(capacity + 1)
        for j in range(capacity, w - 1, -1):
            value = best[j - w] + v
            if value > best[j] or (value == best[j] and size[j - w] + s > size[j]):
                best[j], size[j], row[j] = value, size[j - w] + s, 1
        taken.append(row)
    out, j = [], capacity
    for k in range(len(weights) - 1, -1, -1):
        if taken[k][j]:
            out.append(k)
            j -= weights[k]
    return sorted(out)


def _why(item: GradItem, keep: bool, use: str) -> str:
    if not item.size_bytes:
        return "no parameters of its own"
    if item.pinned:
        return f"pinned: {item.pinned}"
    if item.gain_s is None:
        return f"no host-write timing: stays on the GPU; {use}"
    gain = TIME.format_short(item.gain_s)
    if item.gain_s < 0:
        return f"writing to host is faster: T_GBP - T_CBP = {gain}"
    if keep:
        return f"GO DP keeps it: saves {gain} of backward for {SIZE.format_short(item.size_bytes)}; {use}"
    return f"GO DP offloads it: costs {gain} of backward, the least per byte within the reserve; {use}"


def _too_small(items: list[GradItem], forced: list[int], capacity: int, reserve: float, total: int) -> None:
    need = sum(items[k].size_bytes for k in forced)
    names = ", ".join(items[k].name for k in forced[:3]) + (" ..." if len(forced) > 3 else "")
    raise HeteroError(
        f"--reserve {reserve:g} keeps at most {SIZE.format_short(capacity)} of gradients on the GPU, but "
        f"{SIZE.format_short(need)} must stay there ({names}: pinned to gpu or without a host-write timing)",
        hint=f"use --reserve {min(1.0, need / total + 0.005):.2f} or more, or unpin those layers", exit_code=USAGE)
