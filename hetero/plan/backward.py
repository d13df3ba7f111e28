"""Saved activations and gradients through one training step, at their highest: the one rule the GPU prediction
(hetero.plan.plain), recomputation and updates in backward (hetero.plan.footprint) and the profile's estimate of
plain training under a budget (hetero.profile.pressure) count a plan's memory by.

Backward runs the layers from the last. When it starts, every saved tensor of forward is held and no gradient
exists; the loss's backward comes first: a cross-entropy holds three tensors of the output's size
(`Training.output_bytes`), where an LM's peak can be. A layer's gradients appear during its backward, while its
saved tensors are held; those go once it ends. A recomputed block holds only its inputs; when backward reaches its
last layer, all its layers' saved tensors are back at once. Gradients leave once made where they go to another tier
(`gone_grads`) or where each parameter is updated in backward (`in_backward`: a gradient and Adam's temporaries, one
`UPDATE_PIECE_BYTES` piece at a time); otherwise they all coexist at the step, with its scratch
(`step_scratch_bytes`). Tiering holds at most its peak of saved tensors (`saved_cap`). Differences of `peak_bytes`
are what a plan changes at the process's peak. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from hetero.schema.profile import AdamImplementation, Layer

ADAM_TEMPORARIES = 2  # tensors the size of what it updates that torch's single-tensor Adam(W) makes per parameter
# Updates in backward step pieces of a parameter at most this large (hetero.run.update_in_backward), so their
# temporaries are this size, not the largest parameter's (smaller under freed memory returned: `update_piece_bytes`).
UPDATE_PIECE_BYTES = 1 << 20
LEAST_MMAP_THRESHOLD = 128 << 10  # glibc's default mmap threshold, from which its dynamic threshold grows
LOSS_OUTPUTS = 3  # output-sized tensors a cross-entropy's backward holds: its saved log-probabilities, two gradients


@dataclass(frozen=True, slots=True)
class Held:
    """What one configuration keeps through the step."""

    recomputed: Mapping[str, int] = field(default_factory=dict)  # block name -> the input bytes it keeps
    gone_grads: frozenset[str] = frozenset()  # layers whose gradients leave for another tier as they are made
    in_backward: bool = False  # each parameter updated, and its gradient freed, as soon as it is final
    step: bool = False  # count the optimizer's step, all gradients held
    implementation: AdamImplementation = "single"  # how torch steps Adam there (`step_scratch_bytes`)
    saved_cap: int | None = None  # the most saved bytes held at once (tiering keeps the rest away); None: no cap


def step_scratch_bytes(implementation: AdamImplementation, params: Sequence[int]) -> int:
    """Bytes torch's Adam(W) step makes beside its states over parameters of `params` bytes each, by how torch steps
    it (`ScriptOptimizer.implementation`): one tensor at a time, `ADAM_TEMPORARIES` the size of the largest; foreach,
    a scratch the size of every parameter of the group (the square roots of every exp_avg_sq at once; one group
    taken); fused, none."""
    if implementation == "foreach":
        return sum(params)
    if implementation == "fused":
        return 0
    return ADAM_TEMPORARIES * max(params, default=0)


def update_piece_bytes(mmap_threshold_bytes: int | None) -> int:
    """The most bytes of a parameter updates in backward step at once: `UPDATE_PIECE_BYTES`, or where the plan
    returns freed memory (its `mmap_threshold`), a 16th below that threshold, so that each piece's temporaries come
    from the heap and go back to it; not below glibc's own least threshold (128 KiB), where a step would loop over
    thousands of pieces and each is mapped anyway."""
    if mmap_threshold_bytes is None or mmap_threshold_bytes < LEAST_MMAP_THRESHOLD:
        return UPDATE_PIECE_BYTES
    return min(UPDATE_PIECE_BYTES, mmap_threshold_bytes - mmap_threshold_bytes // 16)


def in_block(layer: str, block: str) -> bool:
    """Whether the layer named `layer` is the block `block` or inside it (`h.1.attn` is in `h.1`, `h.10` is not)."""
    return layer == block or layer.startswith(block + ".")


def peak_bytes(layers: Sequence[Layer], held: Held = Held(), output_bytes: int = 0) -> int:
    """Saved activations and gradients at their highest through backward (and the step, with `held.step`), the
    loss's backward on a model output of `output_bytes` included."""
    block_of = {x.name: next((b for b in held.recomputed if in_block(x.name, b)), None) for x in layers}
    rebuilt = {b: sum(x.saved_bytes for x in layers if block_of[x.name] == b) for b in held.recomputed}
    params = [b for x in layers for b in x.params.values()]
    largest = max(params, default=0)
    present = set(block_of.values())
    saved = sum(x.saved_bytes for x in layers if block_of[x.name] is None) + \
        sum(kept for b, kept in held.recomputed.items() if b in present)
    peak, grads, seen = _held(saved, held) + LOSS_OUTPUTS * output_bytes, 0, set()
    for x in reversed(layers):
        block = block_of[x.name]
        if block is not None and block not in seen:  # its last layer: the block's forward runs again
            seen.add(block)
            saved += rebuilt[block] - held.recomputed[block]
        if x.name not in held.gone_grads:
            grads += x.params_bytes
        made = min(grads, largest + ADAM_TEMPORARIES * min(largest, UPDATE_PIECE_BYTES)) if held.in_backward \
            else grads
        peak = max(peak, _held(saved, held) + made)
        saved -= x.saved_bytes
    if held.step and not held.in_backward:
        peak = max(peak, grads + step_scratch_bytes(held.implementation, params))
    return peak


def _held(saved: int, held: Held) -> int:
    """Of `saved` bytes saved, those on the device (at most `held.saved_cap`)."""
    return saved if held.saved_cap is None else min(saved, held.saved_cap)


def drop_bytes(layers: Sequence[Layer], recomputed: Mapping[str, int], output_bytes: int = 0,
               base: Held = Held(step=True)) -> int:
    """What recomputing `recomputed` (block -> input bytes kept) takes off the peak of the configuration `base`
    (its gradients where it keeps them; by default all held until the optimizer steps): where the gradients leave as
    they are made, the step no longer hides the activations, so counting them held would find recomputing useless
    where it is needed."""
    return peak_bytes(layers, base, output_bytes) - \
        peak_bytes(layers, replace(base, recomputed=recomputed), output_bytes)
