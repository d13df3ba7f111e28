"""The profile finds the model's repeated blocks and checks each for recomputation once the script has stopped:
dropout from the global generator replays, a generator of the block's own does not, BatchNorm's running statistics
are a side effect; what checkpointing keeps of a block is its inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetero.profile import recompute


class Mlp(nn.Module):
    def __init__(self, width: int, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width) if kind == "batchnorm" else nn.LayerNorm(width)
        self.g = torch.Generator().manual_seed(3)

    def forward(self, x):
        y = self.norm(F.relu(self.fc(x)))
        if self.kind == "dropout":
            y = F.dropout(y, 0.5, self.training)
        if self.kind == "own generator":
            y = y * torch.rand(y.shape, generator=self.g)
        return x + y


class Net(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.blocks = nn.Sequential(*(Mlp(8, kind) for _ in range(2)))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def checked(kind: str):
    torch.manual_seed(0)
    model = Net(kind)
    inputs = recompute.watch(model)
    for _ in range(2):  # training steps, the last call kept
        model(torch.randn(4, 8)).sum().backward()
    return recompute.check(model, inputs)


@pytest.mark.parametrize("kind, why", [("plain", None), ("dropout", None),
                                       ("own generator", recompute.RANDOMNESS),
                                       ("batchnorm", recompute.SIDE_EFFECTS)])
def test_each_block_is_recomputable_or_says_why_not(kind, why):
    blocks = checked(kind)
    assert [b.name for b in blocks] == ["blocks.0", "blocks.1"]
    assert all(b.recomputable == (why is None) and b.why == why for b in blocks)
    assert all(b.input_bytes == 4 * 8 * 4 for b in blocks)  # a 4 x 8 fp32 input each


def test_a_model_without_repeated_blocks_has_none_to_check():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert recompute.watch(model) is None and recompute.check(model, None) == []


def test_a_last_call_that_cannot_run_again_leaves_every_block_not_recomputable():
    torch.manual_seed(0)
    model = Net("plain")
    inputs = recompute.watch(model)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    inputs.call = ((torch.randn(4, 3),), {})  # as if the script had changed its input in place since
    blocks = recompute.check(model, inputs)
    assert not any(b.recomputable for b in blocks) and blocks[0].why.startswith("the check's forward of the model's")
    long = "the input has another shape than the one this block was built for, " * 5

    def refuse(x):
        raise ValueError(long)

    model.blocks[0].forward = refuse  # a long error: cut between words
    why = recompute.check(model, inputs)[0].why
    message = why.split(": ", 1)[1].removesuffix(" ...)")
    assert why.endswith(" ...)") and len(why) < 260 and long.startswith(message + " ")


def test_the_check_stops_after_the_last_block_the_head_never_runs_again():
    torch.manual_seed(0)
    model = Net("plain")
    inputs = recompute.watch(model)
    model(torch.randn(4, 8)).sum().backward()
    heads = []
    model.head.register_forward_hook(lambda *_: heads.append(1))
    blocks = recompute.check(model, inputs)
    assert heads == [] and all(b.recomputable for b in blocks)
