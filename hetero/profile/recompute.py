"""Which of the model's repeated blocks activation checkpointing can recompute, and what it keeps of each.

Non-reentrant checkpointing (hetero.run.recompute) keeps a block's inputs and runs its forward again in backward
from the same RNG state: plain training's gradients only where that computes what the first forward did (not with a
generator of its own, nor where the forward changes buffers, e.g. BatchNorm). Once the script has stopped, the
model's last training call runs again up to the end of its last block, and each block's forward post-hook runs the
block again from the RNG state the first began with, comparing outputs bit for bit, after checking its buffers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn

from hetero.harness import hooks
from hetero.harness.layers import repeated_blocks, sharded, tensors, unique_storages
from hetero.profile.dha import RootInputs
from hetero.schema.profile import Block

SIDE_EFFECTS = "its forward changes its buffers (e.g. BatchNorm's running statistics): a recomputation would change " \
               "them twice"
RANDOMNESS = "its forward, run again from the same RNG state on the same inputs, gave another output (randomness " \
             "checkpointing cannot replay, e.g. a generator of its own)"
NOT_RUN = "the model's last training call did not reach it"
SHARDED = "FSDP2 shards the model's parameters: its forward cannot be run again on one rank to check it (its " \
          "all-gathers need every rank)"


@dataclass(slots=True)
class _Seen:
    """One block's first forward, as its hooks saw it."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    rng: tuple = ()
    buffers: str = ""
    training: bool = True
    input_bytes: int = 0
    why: str | None = None
    done: bool = False


def watch(model: nn.Module) -> RootInputs | None:
    """Keep the model's latest training call, for `check`; None when the model has no repeated blocks."""
    return RootInputs(model) if repeated_blocks(model) else None


def check(model: nn.Module, inputs: RootInputs | None) -> list[Block]:
    """Every repeated block, checked by running the kept call again (the script must have stopped: this is one more
    forward, and no profiler hook may see it)."""
    if inputs is None:
        return []
    inputs.close()
    blocks = repeated_blocks(model)
    if inputs.call is None or sharded(model):
        why = SHARDED if sharded(model) else NOT_RUN
        return [Block(name=name, input_bytes=0, recomputable=False, why=why) for name, _ in blocks]
    seen: dict[str, _Seen] = {name: _Seen() for name, _ in blocks}
    handles = [handle for name, module in blocks for handle in (
        hooks.forward_pre(module, _before(seen[name]), with_kwargs=True),
        hooks.forward(module, _after(seen[name]), with_kwargs=True), hooks.forward(module, _stop_once_all_done(seen)))]
    args, kwargs = inputs.call
    try:
        with torch.enable_grad():
            model(*args, **kwargs)  # the graph it builds is dropped with the output
    except _AllChecked:
        pass
    except Exception as e:  # the script changed what its last call took (in place), or its model cannot run again
        why = f"the check's forward of the model's last call failed ({type(e).__name__}: {_gist(e)})"
        return [Block(name=name, input_bytes=s.input_bytes, recomputable=False, why=why) for name, s in seen.items()]
    finally:
        hooks.removed(handles)
    return [Block(name=name, input_bytes=s.input_bytes, recomputable=s.done and s.why is None,
                  why=s.why if s.done else NOT_RUN) for name, s in seen.items()]


def _gist(error: Exception, most: int = 160) -> str:
    """An error's message in one line of at most about `most` characters, cut between words."""
    text = " ".join(str(error).split())
    return text if len(text) <= most else text[:most].rsplit(" ", 1)[0] + " ..."


class _AllChecked(Exception):
    """Every block is checked: the rest of the forward (the head, the logits, the loss) is not run."""


def _stop_once_all_done(seen: dict[str, _Seen]):
    def hook(*_) -> None:
        if all(s.done for s in seen.values()):
            raise _AllChecked()
    return hook


def _before(seen: _Seen):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if seen.done:
            return
        seen.args, seen.kwargs, seen.training = args, kwargs, module.training
        seen.input_bytes = sum(t.untyped_storage().nbytes() for t in unique_storages(tensors([args, kwargs])))
        seen.rng = _rng_state(tensors(args))
        seen.buffers = _digest(list(module.buffers()))
    return hook


def _after(seen: _Seen):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if seen.done:
            return
        seen.done = True
        if _digest(list(module.buffers())) != seen.buffers:
            seen.why = SIDE_EFFECTS
            return
        first, after = _digest(tensors(output)), _rng_state(tensors(args))
        _set_rng_state(seen.rng)
        try:
            again = module.forward(*seen.args, **seen.kwargs)  # its own hooks not again: they are these
            if _digest(tensors(again)) != first:
                seen.why = RANDOMNESS
        finally:
            _set_rng_state(after)
        seen.args, seen.kwargs = (), {}
    return hook


def _digest(ts: list[torch.Tensor]) -> str:
    """A hash of the tensors' values, bit for bit."""
    h = hashlib.sha256()
    for t in ts:
        data = t.detach().contiguous().cpu()
        h.update(str((tuple(data.shape), data.dtype)).encode())
        h.update(data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def _rng_state(inputs: list[torch.Tensor]) -> tuple:
    """The CPU generator's state, and each CUDA input device's, as checkpoint preserves them."""
    devices = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
    return torch.get_rng_state(), tuple((d, torch.cuda.get_rng_state(d)) for d in devices)


def _set_rng_state(state: tuple) -> None:
    cpu, gpus = state
    torch.set_rng_state(cpu)
    for device, gpu in gpus:
        torch.cuda.set_rng_state(gpu, device)
