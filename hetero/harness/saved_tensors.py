"""One `saved_tensors_hooks` pair for every mechanism that packs what autograd saves.

torch calls only the innermost pair, so two mechanisms with their own pairs would lose one. `chain` is the one pair
of this process: handlers join it at a fixed rank, and the first (lowest rank) whose `pack` claims a tensor packs it.
An unclaimed tensor is saved as a detached alias (a pack hook may not return its input: a reference cycle). The pair
is entered, on the forward's thread, while at least one opener holds it open; unpacking needs no pair entered.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

SHADOW, TIERING = 0, 10  # ranks: DFGB's parameter views first (tiering never moves parameters anyway)


class Handler(Protocol):
    def pack(self, tensor: torch.Tensor) -> Any:
        """What to save instead of `tensor`, or None to leave it to the next handler."""

    def unpack(self, packed: Any) -> torch.Tensor:
        """The tensor `pack` stood for, with its dtype, shape and strides."""


class Packed:
    __slots__ = ("handler", "value")

    def __init__(self, handler: Handler, value: Any):
        self.handler, self.value = handler, value


class Chain:
    def __init__(self):
        self.handlers: list[tuple[int, Handler]] = []
        self.order: tuple[Handler, ...] = ()  # by rank; replaced, never changed in place, so packing reads it unlocked
        self.openers: set[int] = set()
        self.context: torch.autograd.graph.saved_tensors_hooks | None = None
        self.lock = threading.Lock()

    def join(self, handler: Handler, rank: int) -> None:
        with self.lock:
            self.handlers = sorted([*self.handlers, (rank, handler)], key=lambda x: x[0])
            self.order = tuple(h for _, h in self.handlers)

    def leave(self, handler: Handler) -> None:
        with self.lock:
            self.handlers = [(r, h) for r, h in self.handlers if h is not handler]
            self.order = tuple(h for _, h in self.handlers)

    def open(self, opener: object) -> None:
        """Hold the pair open for `opener` (again: nothing); the first opener enters it."""
        if id(opener) in self.openers:
            return
        if not self.openers:
            self.context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self.context.__enter__()
        self.openers.add(id(opener))

    def close(self, opener: object) -> None:
        """`opener` no longer needs the pair; the last one leaves it."""
        if id(opener) not in self.openers:
            return
        self.openers.discard(id(opener))
        if not self.openers:
            context, self.context = self.context, None
            context.__exit__(None, None, None)

    def is_open(self, opener: object) -> bool:
        return id(opener) in self.openers

    def _pack(self, tensor: torch.Tensor) -> Any:
        for handler in self.order:
            if (packed := handler.pack(tensor)) is not None:
                return Packed(handler, packed)
        return tensor.detach()

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.handler.unpack(packed.value) if type(packed) is Packed else packed


chain = Chain()
