"""Per-layer GPU modes (MemFerry §IV-B): where each layer's parameters are when the GPU computes with them.

`gfgb` copies a layer to the GPU before its forward; `dha` lets the GPU read it from pinned host memory in both
passes; `dfgb` reads it from host memory in the forward and copies it to the GPU for the backward. The paper's
forward algorithm (Alg. 1, with its backtracking) and its greedy DFGB choice give the starting plan of the
simulator's searches (hetero.plan.memferry_solve).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.plan.model import Costs, LayerCosts
from hetero.plan.simulate import Result
from hetero.schema.plan import LayerMode, Mode
from hetero.units import short_time

MODES = LayerMode.ALL
FORWARD_MODES = (LayerMode.GFGB, LayerMode.DHA)


@dataclass(kw_only=True, slots=True)
class Modes:
    modes: list[Mode]
    why: list[str]


def allowed_modes(layer: LayerCosts, modes: tuple[Mode, ...] = MODES) -> tuple[Mode, ...]:
    """A layer without parameters has nothing to place; without DHA timings it cannot run from host memory."""
    if layer.params_bytes == 0 or layer.fp_dha_s is None:
        return (LayerMode.GFGB,)
    return tuple(m for m in modes if m != LayerMode.DHA or layer.bp_dha_s is not None)


# -- the paper's forward algorithm ------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _Alg1:
    """Alg. 1's running totals: T_all, the forward time so far, and T_res, the compute time not yet used to hide a
    copy (its reserved overlap time)."""

    layers: list[LayerCosts]
    modes: list[Mode]
    why: list[str]
    fixed: dict[int, Mode]
    total: float = 0.0
    reserve: float = 0.0
    tag: int = -1  # the first GFGB layer whose copy was hidden: backtracking starts there

    def update(self, total: float, reserve: float) -> None:
        self.total += total
        self.reserve += reserve


def forward_modes(layers: list[LayerCosts], fixed: dict[int, Mode] | None = None,
                  modes: tuple[Mode, ...] = MODES) -> Modes:
    """MemFerry Alg. 1: DHA where it beats copy + on-GPU forward, else GFGB, backtracking earlier GFGB layers to
    DHA when a copy cannot be hidden. `fixed` modes (pinned entries) are taken as given."""
    fixed = fixed or {}
    st = _Alg1(layers=layers, modes=[LayerMode.GFGB] * len(layers), why=[""] * len(layers), fixed=fixed)
    for i, layer in enumerate(layers):
        st.update(layer.fp_gap_s, layer.fp_gap_s)
        if i in fixed:
            _fixed(st, i, fixed[i])
        elif LayerMode.DHA not in allowed_modes(layer, modes) and layer.params_bytes == 0:
            st.why[i] = "no parameters of its own"
            st.update(layer.fp_s, layer.fp_s)
        elif LayerMode.DHA in allowed_modes(layer, modes) and layer.fp_dha_s <= layer.fp_s + layer.copy_s:
            st.modes[i] = LayerMode.DHA
            st.why[i] = (f"DHA fp {short_time(layer.fp_dha_s)} <= copy {short_time(layer.copy_s)} + fp "
                         f"{short_time(layer.fp_s)} (Alg. 1)")
            st.update(layer.fp_dha_s, layer.fp_dha_s)
        else:
            _gfgb(st, i, modes)
    return Modes(modes=st.modes, why=st.why)


def _fixed(st: _Alg1, i: int, mode: Mode) -> None:
    layer = st.layers[i]
    st.modes[i] = mode
    if mode != LayerMode.GFGB:
        st.update(layer.fp_dha_s, layer.fp_dha_s)
    elif layer.copy_s < st.reserve:
        st.update(layer.fp_s, layer.fp_s - layer.copy_s)
    else:
        wait = layer.copy_s - st.reserve
        st.total += wait + layer.fp_s
        st.reserve = layer.fp_s


def _gfgb(st: _Alg1, i: int, modes: tuple[Mode, ...]) -> None:
    layer = st.layers[i]
    dha = f"fp_dha {short_time(layer.fp_dha_s)} > copy {short_time(layer.copy_s)} + fp {short_time(layer.fp_s)}; " \
        if layer.fp_dha_s is not None else "no DHA timing; "
    if layer.copy_s < st.reserve:
        if st.tag == -1:
            st.tag = i
        st.why[i] = f"{dha}copy hidden in {short_time(st.reserve)} of earlier compute (Alg. 1)"
        st.update(layer.fp_s, layer.fp_s - layer.copy_s)
    else:
        reserve = st.reserve
        moved = _backtrack(st, i, modes)
        st.why[i] = f"{dha}copy {short_time(layer.copy_s)} > {short_time(reserve)} of overlap" + (
            f"; backtracking made {', '.join(moved)} DHA (Alg. 1)" if moved else "; waits for its copy (Alg. 1)")
    st.modes[i] = LayerMode.GFGB


def _backtrack(st: _Alg1, l: int, modes: tuple[Mode, ...]) -> list[str]:
    """Turn earlier GFGB layers (from `tag` on) into DHA while that shortens the forward pass: each one's copy no
    longer delays layer l, at the price of its slower DHA forward. The paper's `update(base, ...)` after the loop
    sets the totals (base already includes T_all), which is how it is read here."""
    layer = st.layers[l]
    base = st.total + layer.copy_s + layer.fp_s - st.reserve
    reserve = st.reserve
    moved = []
    for i in range(max(st.tag, 0), l):
        prev = st.layers[i]
        if st.modes[i] != LayerMode.GFGB or i in st.fixed or LayerMode.DHA not in allowed_modes(prev, modes):
            continue
        gain = prev.copy_s + prev.fp_dha_s - prev.fp_s
        total_i = max(layer.copy_s - reserve - gain, 0.0) + st.total + (prev.fp_dha_s - prev.fp_s + layer.fp_s)
        if total_i < base:
            st.modes[i], st.tag = LayerMode.DHA, i + 1
            st.why[i] = (f"made DHA by Alg. 1 backtracking for {layer.name}: forward {short_time(base - st.total)} -> "
                         f"{short_time(total_i - st.total)} from here")
            moved.append(prev.name)
            base, reserve = total_i, reserve + gain
            if reserve >= layer.copy_s:
                break
    st.total = base
    st.reserve = max(reserve - layer.copy_s, 0.0) + layer.fp_s
    return moved


# -- the paper's greedy DFGB choice -----------------------------------------------------------------------------


def choose_dfgb(costs: Costs, modes: list[Mode], result: Result, room_bytes: int, fixed: dict[int, Mode],
                allowed: tuple[Mode, ...] = MODES) -> Modes:
    """Copy DHA layers to the GPU after their forward where the H2D link is idle (after the GFGB copies) and the copy
    lands before the layer's backward: greedily by backward time saved per second of copy, within `room_bytes`."""
    layers = costs.layers
    out, why = list(modes), [""] * len(layers)
    window = max((result.fp_start_s[i] for i, m in enumerate(modes) if m == LayerMode.GFGB and layers[i].copy_s > 0),
                 default=0.0)  # the last GFGB copy ends before its forward starts
    position = {i: k for k, i in enumerate(costs.bp_order)}
    candidates = [i for i, m in enumerate(modes) if m == LayerMode.DHA and i not in fixed
                  and LayerMode.DFGB in allowed_modes(layers[i], allowed) and layers[i].bp_dha_s > layers[i].bp_s]
    candidates.sort(key=lambda i: -(layers[i].bp_dha_s - layers[i].bp_s) / max(layers[i].copy_s, 1e-12))
    chosen: list[int] = []
    for i in candidates:
        layer = layers[i]
        if layer.params_bytes > room_bytes:
            continue
        trial = sorted([*chosen, i], key=position.__getitem__)
        if _copies_on_time(trial, layers, result, window):
            chosen = trial
            room_bytes -= layer.params_bytes
            out[i] = LayerMode.DFGB
            why[i] = (f"DFGB: bp {short_time(layer.bp_s)} instead of bp_dha {short_time(layer.bp_dha_s)} for a "
                      f"{short_time(layer.copy_s)} copy in the idle H2D window before its backward at "
                      f"{short_time(result.bp_start_s[i])}")
    return Modes(modes=out, why=why)


def _copies_on_time(chosen: list[int], layers: list[LayerCosts], result: Result, window: float) -> bool:
    t = window
    for i in chosen:
        t = max(t, result.fp_end_s[i]) + layers[i].copy_s
        if t > result.bp_start_s[i]:
            return False
    return True
