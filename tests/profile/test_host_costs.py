"""The runtime's host-side unit costs are measured on the machine (hetero.profile.host_costs): the work itself, with
and without, so a figure is positive and finite (its size is the machine's business, timed in bench/)."""

import math

import pytest

from hetero.profile import host_costs


@pytest.mark.parametrize("measure", [host_costs.hook_pair_s, host_costs.saved_tensor_s])
def test_each_unit_cost_is_a_measured_nonnegative_time(measure):
    value = measure()
    assert math.isfinite(value) and value >= 0


def test_the_hooks_it_adds_are_gone_afterwards():
    import torch

    host_costs.hook_pair_s()
    host_costs.saved_tensor_s()
    w = torch.ones(2, requires_grad=True)
    (w * w).sum().backward()  # no saved-tensor hooks left behind: a plain backward works
    assert torch.equal(w.grad, 2 * w.detach())
