"""Recomputation as a lever of the DRAM-budget fit (hetero.plan.fit): activation checkpointing of chosen blocks.

A recomputed block keeps only its measured `input_bytes`; backward reruns its forward to rebuild the rest. Its
saved bytes are its layers' (`Layer.saved_bytes`), its cost its forward's span (from the end of the layer before
it to the end of its last layer). Blocks are taken by bytes saved per second of recomputation, so the fewest
seconds buy the saving a budget needs (`fewest`). What it takes off the peak (`peak_drop`): the highest level of
saved activations and gradients through the step (hetero.plan.backward); once that is the optimizer step's, with
all gradients held, recomputing more saves nothing. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hetero.plan import backward
from hetero.schema.plan import RecomputePlan
from hetero.schema.profile import Block, Profile
from hetero.units import SIZE, short_time


@dataclass(frozen=True, slots=True)
class Unit:
    name: str
    saved_bytes: int  # what its layers save per micro-batch
    kept_bytes: int  # its inputs, which checkpointing keeps
    forward_s: float  # one recomputation, per micro-batch

    @property
    def saving_bytes(self) -> int:
        return max(0, self.saved_bytes - self.kept_bytes)


def units(profile: Profile) -> tuple[list[Unit], dict[str, str]]:
    """The blocks recomputation can take, best saving per second first, and why each other block is not one."""
    out, refused = [], {}
    for block in profile.blocks:
        if not block.recomputable:
            refused[block.name] = block.why or "not recomputable"
            continue
        unit = _unit(profile, block)
        if unit is None:
            refused[block.name] = "none of the profile's layers is inside it"
        elif unit.saving_bytes == 0:
            refused[block.name] = f"its inputs ({SIZE.format_short(unit.kept_bytes)}) are all it saves"
        else:
            out.append(unit)
    out.sort(key=lambda u: (-u.saving_bytes / max(u.forward_s, 1e-9), u.name))
    return out, refused


def _unit(profile: Profile, block: Block) -> Unit | None:
    inside = [i for i, layer in enumerate(profile.layers) if backward.in_block(layer.name, block.name)]
    if not inside:
        return None
    layers = profile.layers
    first, last = inside[0], inside[-1]
    start = layers[first - 1].fp_end_s if first > 0 else layers[first].fp_end_s - layers[first].fp_s
    return Unit(name=block.name, saved_bytes=sum(layers[i].saved_bytes for i in inside), kept_bytes=block.input_bytes,
                forward_s=max(0.0, layers[last].fp_end_s - start))


def layers_of(profile: Profile, blocks: list[str]) -> set[str]:
    """The profile's layers inside the recomputed `blocks` (their saved tensors are rebuilt, never kept)."""
    return {layer.name for layer in profile.layers if any(backward.in_block(layer.name, b) for b in blocks)}


def chosen(profile: Profile, recomputed: RecomputePlan | None) -> list[Unit]:
    """The units of the blocks the section `recomputed` names (a block the profile does not know counts for
    nothing)."""
    if recomputed is None:
        return []
    by_name = {b.name: b for b in profile.blocks}
    found = [_unit(profile, by_name[name]) for name in recomputed.blocks if name in by_name]
    return [u for u in found if u is not None]


def cost_s(profile: Profile, recomputed: RecomputePlan | None) -> float:
    """What recomputation adds to an iteration: each chosen block's forward once more, every micro-batch."""
    return sum(u.forward_s for u in chosen(profile, recomputed)) * profile.training.grad_accumulation


def peak_drop(profile: Profile, recomputed: RecomputePlan | None,
              base: backward.Held = backward.Held(step=True)) -> int:
    """What recomputation takes off the process's predicted peak, its gradients placed as `base` places them (see
    the module's docstring)."""
    return backward.drop_bytes(profile.layers, kept_inputs(profile, recomputed), profile.training.output_bytes, base)


def kept_inputs(profile: Profile, recomputed: RecomputePlan | None) -> dict[str, int]:
    """Each recomputed block the profile knows, with the input bytes it keeps."""
    return {u.name: u.kept_bytes for u in chosen(profile, recomputed)}


def section(profile: Profile, count: int | None = None) -> RecomputePlan | None:
    """The first `count` units (all of them: None) as a plan section, in forward order; None when there is none."""
    found, refused = units(profile)
    taken = found if count is None else found[:count]
    if not taken:
        return None
    order = {b.name: i for i, b in enumerate(profile.blocks)}
    names = sorted((u.name for u in taken), key=order.__getitem__)
    saving = sum(u.saving_bytes for u in taken)
    seconds = sum(u.forward_s for u in taken) * profile.training.grad_accumulation
    left = "".join(f"; not {name}: {why}" for name, why in refused.items())
    return RecomputePlan(blocks=names, why=(
        f"{len(names)} of {len(profile.blocks)} blocks recomputed in backward (torch.utils.checkpoint, "
        f"use_reentrant=False, RNG state preserved): their layers' saved tensors ({SIZE.format_short(saving)} per "
        f"micro-batch beyond the inputs kept) are rebuilt from their inputs, for one more forward of each "
        f"({short_time(seconds)} per iteration); the blocks saving most per second first{left}"))


def fewest(fits: Callable[[int], bool], most: int) -> int:
    """The fewest units (1..most) for which `fits(k)` holds, given that it holds for `most` and more units never
    fit less (bisection)."""
    low, high = 0, most
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def refused_text(profile: Profile) -> str:
    """Why recomputation is not a lever here ('' where it is)."""
    if not profile.blocks:
        return "the profile found no repeated blocks to recompute (or was made before hetero looked for them)"
    found, refused = units(profile)
    if found:
        return ""
    name, why = next(iter(refused.items()))
    return f"no block can be recomputed ({name}: {why})"
