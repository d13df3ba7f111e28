"""The layers of a model as hetero sees them (a module with its own parameters, or a repeated block), and the
tensors in a module's output: what the profiler, the recorder and the mechanisms that hook layers share."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetero.schema.profile import ROOT_LAYER


@dataclass(slots=True)
class LayerSpec:
    """A layer to measure: a module and the parameters counted as its own."""

    name: str
    module: nn.Module
    params: dict[str, nn.Parameter]  # local name -> parameter (a shared parameter counts for its first owner)


def select_layers(model: nn.Module, granularity: str) -> list[LayerSpec]:
    """Modules owning parameters directly, or (`block`) the repeated blocks plus the owners outside them."""
    blocks = _repeated_blocks(model) if granularity == "block" else []
    inside = {id(m) for b in blocks for m in b.modules()}
    seen: set[int] = set()
    layers = []
    for name, module in model.named_modules():
        if any(module is b for b in blocks):
            local = dict(module.named_parameters())
        elif id(module) in inside:
            continue
        else:
            if not (local := dict(module.named_parameters(recurse=False))):
                continue
        mine = {k: p for k, p in local.items() if id(p) not in seen}
        seen.update(id(p) for p in local.values())
        layers.append(LayerSpec(name or ROOT_LAYER, module, mine))
    return layers


def layers_named(model: nn.Module, wanted: set[str]) -> tuple[list[LayerSpec], list[str]]:
    """The layers of the first granularity (module, then block) that has every name in `wanted`, and the names
    neither has (then the module layers are returned)."""
    first, missing = None, []
    for granularity in ("module", "block"):
        layers = select_layers(model, granularity)
        names = {spec.name for spec in layers}
        if wanted <= names:
            return layers, []
        first, missing = first or layers, missing or sorted(wanted - names)
    return first, missing


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks (see `select_layers`' `block` granularity) by module path, in definition order:
    what the profile checks for recomputation and the runtime checkpoints."""
    blocks = {id(b) for b in _repeated_blocks(model)}
    return [(name, module) for name, module in model.named_modules() if id(module) in blocks]


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Children of ModuleLists/Sequentials whose members all share one class: a transformer's blocks."""
    blocks = []
    for module in model.modules():
        children = list(module.children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) > 1 and \
                len({type(c) for c in children}) == 1 and any(True for _ in children[0].parameters()):
            if not any(any(c is m for m in b.modules()) for b in blocks for c in children):
                blocks.extend(children)
    return blocks


def storages(params) -> set[int]:
    """Addresses of the storages these parameters own in this process (a sharded parameter, FSDP2's DTensor, owns
    none: read them again at each layer's forward start, `sharded`)."""
    out = set()
    for p in params:
        with contextlib.suppress(RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
            out.add(p.untyped_storage().data_ptr())
    return out


def sharded(model: nn.Module) -> bool:
    """Whether some parameter of `model` is a tensor subclass sharded across ranks (FSDP2's `fully_shard`)."""
    return any(type(p) not in (nn.Parameter, torch.Tensor) and not storages([p]) for p in model.parameters())


def tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a module's output (nested tuples, lists and dicts)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    return [t for o in output for t in tensors(o)] if isinstance(output, (tuple, list)) else []


def unique_storages(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """`ts` less every tensor whose storage an earlier one shares (views of one storage count once)."""
    out, ids = [], set()
    for t in ts:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in ids:
            ids.add(key)
            out.append(t)
    return out


def before_backward(output: Any, hook) -> None:
    """Call `hook(grad_outputs)` when backward reaches a module's output (a pre-hook on each distinct grad_fn of it)."""
    for grad_fn in {t.grad_fn for t in tensors(output) if t.grad_fn is not None}:
        grad_fn.register_prehook(hook)


def adopt_unseen(specs: list[LayerSpec], ran: list[int]) -> tuple[list[int], dict[int, dict[str, nn.Parameter]],
                                                                  dict[int, int]]:
    """(layers in forward order, each layer's parameters by local name, unseen layer -> the ran layer it is timed
    as). An unseen layer's parameters join the nearest ran layer enclosing it; with none, it stays a layer, placed
    after the ran layer whose name shares the longest dotted prefix with its own."""
    params = {i: dict(spec.params) for i, spec in enumerate(specs)}
    order, timed_as = list(ran), {}
    if not ran:
        return order, params, timed_as
    for i, spec in enumerate(specs):
        if i in ran or not spec.params:
            continue
        parent = max((j for j in ran if specs[j].name == ROOT_LAYER or spec.name.startswith(specs[j].name + ".")),
                     key=lambda j: len(specs[j].name), default=None)
        if parent is not None:
            path = spec.name if specs[parent].name == ROOT_LAYER else spec.name[len(specs[parent].name) + 1:]
            params[parent].update({f"{path}.{k}": p for k, p in spec.params.items()})
            params[i] = {}
            continue
        near = max(ran, key=lambda j: _shared(specs[j].name, spec.name))  # first in forward order on a tie
        order.insert(order.index(near) + 1, i)
        timed_as[i] = near
    return order, params, timed_as


def _shared(a: str, b: str) -> int:
    return len(os.path.commonprefix([a.split("."), b.split(".")]))
