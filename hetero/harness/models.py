"""Several models one script trains (a GAN's generator and discriminator), seen by hetero as one model: `Models`,
under the script's names for them (`netD.0.weight`). It is never called itself: each part is a root (`roots`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from torch import nn


class Models(nn.Module):
    """The models a script trains, by name, in the order the script first called them."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__()
        for name, part in parts.items():
            self.add_module(name, part)

    def forward(self, *args, **kwargs):
        raise TypeError("hetero's view of several models is not called: the script calls each of them")


def roots(model: nn.Module) -> list[nn.Module]:
    """The modules whose calls are the model's forward passes: its parts, or the model itself."""
    return list(model.children()) if isinstance(model, Models) else [model]


def combine(parts: dict[str, nn.Module]) -> nn.Module:
    """One model: the only part itself, or `Models` of several."""
    return next(iter(parts.values())) if len(parts) == 1 else Models(parts)


def part_of(model: nn.Module, layer: str) -> str | None:
    """The name of the model a layer of `model` (by name) belongs to; None for one model."""
    return layer.split(".", 1)[0] if isinstance(model, Models) else None


def part_name(model: nn.Module, part: nn.Module) -> str:
    """`part`'s name in `model` (the model's class name where it is one model)."""
    return next((name for name, m in model.named_children() if m is part), type(part).__name__) \
        if isinstance(model, Models) else type(model).__name__


def script_values(script: str, kind: type, unwrap: Callable[[nn.Module], nn.Module] | None = None) \
        -> list[tuple[str, object]]:
    """(variable, value) for every instance of `kind` a variable of the script's frames holds (innermost frame
    first), modules unwrapped by `unwrap`."""
    out: list[tuple[str, object]] = []
    frame = sys._getframe()
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == script:
            for var, value in {**frame.f_globals, **frame.f_locals}.items():
                if isinstance(value, kind) and not var.startswith("__"):
                    out.append((var, unwrap(value) if unwrap is not None and isinstance(value, nn.Module) else value))
        frame = frame.f_back
    return out


def names(objects: list, script: str, unwrap: Callable[[nn.Module], nn.Module] | None = None) -> list[str]:
    """The variable each object (a module, an optimizer) has in the script's frames (innermost first), else its
    class name; a repeated name gets a number (`Net`, `Net_1`)."""
    held = script_values(script, object, unwrap)
    found = [next((var for var, value in held if value is o), type(o).__name__) for o in objects]
    out: list[str] = []
    for name in found:
        unique, k = name, 0
        while unique in out:
            k += 1
            unique = f"{name}_{k}"
        out.append(unique)
    return out
