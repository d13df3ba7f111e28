"""The one saved-tensor hook pair: handlers in rank order, the first claim wins, what nobody claims is saved without
a reference cycle, and the pair is entered once however many mechanisms hold it open."""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hetero.harness.saved_tensors import Chain


class Tagging:
    """Claims tensors of one size, and gives back what it stood for, scaled (so the test sees whose unpack ran)."""

    def __init__(self, numel: int, scale: float):
        self.numel, self.scale, self.packed, self.unpacked = numel, scale, 0, 0

    def pack(self, tensor):
        if tensor.numel() != self.numel:
            return None
        self.packed += 1
        return tensor.detach().clone()

    def unpack(self, packed):
        self.unpacked += 1
        return packed * self.scale


def test_the_first_handler_by_rank_packs_and_unpacks():
    chain = Chain()
    late, early = Tagging(4, 10.0), Tagging(4, 2.0)
    chain.join(late, 10)
    chain.join(early, 0)
    x = torch.ones(4, requires_grad=True)
    chain.open("a")
    y = (x * x).sum()  # saves x twice: claimed by `early`, whose unpack doubles it
    chain.close("a")
    y.backward()
    assert torch.equal(x.grad, torch.full((4,), 4.0))  # each factor of x * x came back as 2x: 2 + 2
    assert (early.packed, early.unpacked, late.packed) == (2, 2, 0)
    chain.leave(early)
    chain.open("a")
    (x * x).sum().backward()
    chain.close("a")
    assert late.packed == 2


def test_what_no_handler_claims_is_saved_without_a_cycle():
    chain = Chain()
    chain.join(Tagging(1000, 1.0), 0)
    x = torch.ones(4, requires_grad=True)
    chain.open("a")
    out = x.exp()  # saves its own output
    chain.close("a")
    out.sum().backward(retain_graph=True)
    assert torch.equal(x.grad, x.detach().exp())
    storage = StorageWeakRef(out.untyped_storage())
    gc.disable()
    try:
        del out
        assert storage.expired()  # freed by reference counting, not left to the cycle collector
    finally:
        gc.enable()


def test_the_pair_is_entered_once_for_every_opener(monkeypatch):
    chain = Chain()
    entered = []
    original = torch.autograd.graph.saved_tensors_hooks.__enter__
    monkeypatch.setattr(torch.autograd.graph.saved_tensors_hooks, "__enter__",
                        lambda self: entered.append(1) or original(self))
    chain.open("shadow")
    chain.open("tiering")
    chain.open("tiering")
    chain.close("shadow")
    assert chain.context is not None and len(entered) == 1
    chain.close("tiering")
    assert chain.context is None and not chain.is_open("tiering")
