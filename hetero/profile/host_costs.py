"""What the runtime's host-side work costs on this machine, per unit: a module's pair of Python hooks, a saved
tensor's trip through Python pack and unpack hooks, and on a GPU a CUDA event handed from one stream to another.
Each is the median difference between the same tiny call with and without that work.
"""

from __future__ import annotations

import torch
from torch import nn

from hetero.profile.timing import median_time


def hook_pair_s() -> float:
    """A forward pre-hook and a forward hook, both Python, around one module call."""
    module, x = nn.Identity(), torch.ones(1)
    bare = median_time(lambda: module(x), repeats=9)
    handles = [module.register_forward_pre_hook(lambda m, args: None),
               module.register_forward_hook(lambda m, args, out: None)]
    try:
        hooked = median_time(lambda: module(x), repeats=9)
    finally:
        for h in handles:
            h.remove()
    return max(0.0, hooked - bare)


def saved_tensor_s() -> float:
    """One saved tensor packed into a Python record in forward and unpacked from it in backward."""
    w = torch.ones(4, requires_grad=True)

    def step() -> None:
        (w * w).sum().backward()  # mul saves both operands: two tensors

    bare = median_time(step, repeats=9)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (t,), lambda record: record[0]):
        hooked = median_time(step, repeats=9)
    return max(0.0, hooked - bare) / 2


def event_s(device: torch.device) -> float:
    """Recording a CUDA event on the current stream and making a side stream wait for it."""
    side, event = torch.cuda.Stream(device), torch.cuda.Event()

    def hand_off() -> None:
        event.record(torch.cuda.current_stream(device))
        side.wait_event(event)

    return median_time(hand_off, repeats=9)
