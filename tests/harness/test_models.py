"""hetero.harness.models: several models of one script seen as one, and the names a script gives its objects."""

import os

import pytest
import torch
from torch import nn

from hetero.harness.models import Models, combine, names, part_name, part_of, roots

HERE = os.path.abspath(__file__)  # the "script" whose frames are read: this test's own


def test_one_model_is_itself_and_several_are_one_model_named_by_part():
    gen, disc = nn.Linear(2, 3), nn.Sequential(nn.Linear(3, 1))
    assert combine({"gen": gen}) is gen and roots(gen) == [gen]
    both = combine({"netG": gen, "netD": disc})
    assert isinstance(both, Models) and roots(both) == [gen, disc]
    assert [n for n, _ in both.named_parameters()] == ["netG.weight", "netG.bias", "netD.0.weight", "netD.0.bias"]
    assert (part_of(both, "netD.0"), part_of(gen, "netD.0")) == ("netD", None)
    assert (part_name(both, disc), part_name(gen, gen)) == ("netD", "Linear")
    with pytest.raises(TypeError, match="not called"):
        both(torch.zeros(1, 2))


def test_objects_are_named_by_the_script_variable_that_holds_them_else_by_class():
    encoder, decoder = nn.Linear(2, 2), nn.Linear(2, 2)
    stray = [nn.Linear(2, 2), nn.Linear(2, 2)]  # in a list: no variable of its own
    assert names([decoder, encoder, *stray], HERE) == ["decoder", "encoder", "Linear", "Linear_1"]
    assert names([encoder], "/elsewhere/train.py") == ["Linear"]


def test_a_wrapped_model_is_named_by_its_wrappers_variable_when_unwrapped():
    wrapped = nn.Sequential(nn.Linear(2, 2))
    unwrap = lambda m: m[0] if isinstance(m, nn.Sequential) else m  # noqa: E731
    assert names([wrapped[0]], HERE, unwrap=unwrap) == ["wrapped"]
    assert names([wrapped[0]], HERE) == ["Linear"]
