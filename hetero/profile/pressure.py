"""The profile under a budget its forward would not keep: the model's repeated blocks recomputed once the process
nears the budget, and their layers measured in parts.

Under a budget the first module called with gradients that has repeated blocks runs each block through
non-reentrant `torch.utils.checkpoint` (as the runtime does) whenever the process holds more than `mark` as the
block starts. The first forward recomputes every block: the least this training can take, and a measure of what it
holds beyond its blocks. From the second forward on, `mark` is the budget less the plan's headroom and that much; a
block runs as written only where the process, with the most a block kept (`block_bytes`), stays under it, decided
in that second forward for the rest of the profile. The recomputed blocks (`engaged`) save nothing the layer
profiler sees, so `fill` gives their layers what a measured block of the same class saved, and adds back to plain
training's estimated peak what recomputing them took off, as the planner counts it. Each deciding forward reports
its recomputed blocks to `progress` (hetero.profile.phases.RECOMPUTED), for hetero.launch.guard.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetero.harness import hooks
from hetero.harness.layers import repeated_blocks
from hetero.plan import backward
from hetero.plan.policy import POLICY
from hetero.profile import phases
from hetero.run import process_memory
from hetero.schema.profile import Layer
from hetero.units import SIZE


class UnderPressure:
    """Installed before the script runs; `close` takes every override back."""

    def __init__(self, budget_bytes: int, progress=lambda phase, done, total: None):
        self.budget_bytes, self.progress = budget_bytes, progress
        self.mark = 0  # the first forward: every block
        self.first: str | None = None  # the first block, whose start begins a forward
        self.started_at: int | None = None  # resident bytes as the first forward's first block started
        self.calibrated = False
        self.block_bytes = int(budget_bytes * POLICY.profile_block_share)  # the most a block that ran as written added
        self.seen_block = False
        self.last: tuple[int, bool] | None = None  # resident bytes as the last block started, and whether it ran so
        self.engaged: dict[str, int] = {}  # block -> forwards it was recomputed in, from the second forward on
        self.decided: dict[str, bool] = {}  # block -> runs as written (decided in the second forward)
        self.classes: dict[str, type] = {}  # block -> its class
        self.inputs: dict[str, int] = {}  # block -> bytes its checkpoint kept (its inputs)
        self.modules: dict[str, nn.Module] = {}  # block -> the module
        self.calls: dict[type, tuple[str, tuple, dict]] = {}  # class -> its last recomputed block's call
        self.overrides: list[hooks.Override] = []
        self.checked: set[int] = set()
        self.handle = nn.modules.module.register_module_forward_pre_hook(self._called)

    def _called(self, module: nn.Module, args) -> None:
        if not torch.is_grad_enabled() or id(module) in self.checked:
            return
        self.checked.update(id(m) for m in module.modules())
        if not (blocks := repeated_blocks(module)):
            return
        self.handle.remove()
        self.first = blocks[0][0]
        for name, block in blocks:
            self.classes[name], self.modules[name] = type(block), block
            self.overrides.append(hooks.forward_override(block, functools.partial(self._forward, name, block.forward)))

    def _forward(self, name: str, forward, *args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        plain = self.decided[name] if name in self.decided else self._decide(name, process_memory.resident_bytes())
        if plain:
            return forward(*args, **kwargs)
        if self.calibrated:
            self.engaged[name] = self.engaged.get(name, 0) + 1
        self.inputs[name] = sum(t.untyped_storage().nbytes() for t in args if isinstance(t, torch.Tensor))
        self.calls[self.classes[name]] = (name, args, kwargs)  # one block's inputs per class, held until `close`
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    def _decide(self, name: str, resident: int) -> bool:
        """Whether the block runs as written in this forward; from the second forward on, for good."""
        if name == self.first:
            self._forward_starts(resident)
        elif self.last is not None and self.last[1]:  # the block before ran as written: what it kept
            added = max(0, resident - self.last[0])
            self.block_bytes = max(self.block_bytes, added) if self.seen_block else added
            self.seen_block = True
        plain = resident + self.block_bytes <= self.mark
        self.last = (resident, plain)
        if self.calibrated:
            self.decided[name] = plain
            if len(self.decided) == len(self.classes):
                self.progress(phases.RECOMPUTED, len(self.classes) - sum(self.decided.values()), len(self.classes))
        return plain

    def _forward_starts(self, resident: int) -> None:
        """A forward's first block starts: the first time, note what the process holds; the second, set the mark."""
        if self.started_at is None:
            self.started_at = resident
            self.progress(phases.RECOMPUTED, len(self.classes), len(self.classes))
        elif not self.calibrated:
            self.calibrated = True
            beyond = max(0, process_memory.dram_peak_bytes() - self.started_at)
            self.mark = int(self.budget_bytes * (1 - POLICY.profile_headroom)) - beyond

    def fill(self, layers: list[Layer], output_bytes: int, grads_gone: bool) -> tuple[list[Layer], int]:
        """`layers` with every engaged block's layers given what the same layer of a measured block of its class
        saved (with none, what `saved_by_layer` counts), and what recomputing the engaged blocks took off the peak
        by the planner's rule (hetero.plan.backward; `grads_gone`: the gradients went to NVMe)."""
        measured = [b for b in self.classes if b not in self.engaged]
        by_name = {layer.name: layer for layer in layers}
        counted = {cls: self.saved_by_layer(*call) for cls, call in self.calls.items()
                   if not any(self.classes[b] is cls for b in measured)}
        out = list(layers)
        for block in self.engaged:
            twin = next((b for b in measured if self.classes[b] is self.classes[block]), None)
            if twin is None and self.classes[block] not in counted:
                continue
            for k, layer in enumerate(out):
                if not layer.name.startswith(block + "."):
                    continue
                rest = layer.name[len(block):]
                if twin is None:
                    storages = counted[self.classes[block]].get(rest, [])
                    out[k] = replace(layer, saved_bytes=sum(storages), saved_storages_bytes=storages)
                elif (source := by_name.get(twin + rest)) is not None:
                    out[k] = replace(layer, saved_bytes=source.saved_bytes,
                                     saved_storages_bytes=list(source.saved_storages_bytes))
        gradients = backward.Held(gone_grads=frozenset(x.name for x in out) if grads_gone else frozenset(), step=True)
        return out, backward.drop_bytes(out, {b: self.inputs.get(b, 0) for b in self.engaged}, output_bytes,
                                        gradients)

    def saved_by_layer(self, name: str, args: tuple, kwargs: dict) -> dict[str, list[int]]:
        """What the block `name`'s forward saves for backward, by layer (the name after the block's, e.g.
        `.attn.proj`): each distinct storage saved while the layer is the last one started, parameters excluded,
        largest first. Only sizes are kept; the RNG state is left as it was."""
        block = self.modules[name]
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        owners = [(rel, m) for rel, m in block.named_modules() if rel and any(True for _ in m.parameters(False))]
        current = [f".{owners[0][0]}"] if owners else [""]
        # a storage is known by its address only while a tensor saved on it lives: a freed one's is reused
        seen: dict[int, weakref.ref] = {}
        storages: dict[str, list[int]] = {}

        def pack(t: torch.Tensor) -> int:
            storage = t.untyped_storage()
            address = storage.data_ptr()
            earlier = seen[address]() if address in seen else None
            if address not in params and earlier is None:
                seen[address] = weakref.ref(t)
                storages.setdefault(current[0], []).append(storage.nbytes())
            return 0

        starts = [hooks.forward_pre(m, lambda *_, rel=rel: current.__setitem__(0, f".{rel}")) for rel, m in owners]
        rng = torch.get_rng_state()
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
                type(block).forward(block, *args, **kwargs)  # the class's: the instance's is the checkpoint
        finally:
            torch.set_rng_state(rng)
            hooks.removed(starts)
        return {rel: sorted(sizes, reverse=True) for rel, sizes in storages.items()}

    def described(self, added: int) -> str:
        measured = [b for b in self.classes if b not in self.engaged]
        return (f"{len(self.engaged)} of {len(self.classes)} blocks recomputed while the process held more than "
                f"{SIZE.format_short(max(0, self.mark))}, their layers measured in {', '.join(measured[:2]) or 'none'}"
                f"{'...' * (len(measured) > 2)} (plain training would have held {SIZE.format_short(added)} more at its "
                "peak)")

    def least(self) -> None:
        """Recompute every block from now on (the profile's own forward after the script, checking the blocks)."""
        self.decided = dict.fromkeys(self.classes, False)

    def close(self) -> None:
        self.calls.clear()
        self.handle.remove()
        self.overrides = hooks.removed(self.overrides)
