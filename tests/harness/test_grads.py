"""Every way a script can change gradients between backward and step is seen as an edit; reading them is not."""

import pytest
import torch
from torch import nn

from hetero.harness.grads import GradEdits, after_closure, closure_of


def _clip_total_norm(params):
    if not hasattr(nn.utils, "get_total_norm"):  # torch < 2.6
        pytest.skip("torch.nn.utils.get_total_norm is new in torch 2.6")
    nn.utils.clip_grads_with_norm_(params, 0.01, nn.utils.get_total_norm([p.grad for p in params]))


def _set(params):
    for p in params:
        p.grad = p.grad * 0.5


EDITS = {
    "clip_grad_norm_": lambda ps: nn.utils.clip_grad_norm_(ps, 0.01),
    "clip_grad_value_": lambda ps: nn.utils.clip_grad_value_(ps, 0.001),
    "get_total_norm + clip_grads_with_norm_": _clip_total_norm,
    "foreach": lambda ps: torch._foreach_mul_([p.grad for p in ps], 0.5),
    "in place": lambda ps: [p.grad.mul_(0.5) for p in ps],
    "replaced": _set,
    "set to None": lambda ps: [setattr(p, "grad", None) for p in ps],
}


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, list(model.parameters())


def _backward(model):
    model(torch.randn(3, 4)).square().sum().backward()


@pytest.mark.parametrize("how", EDITS)
def test_an_edit_between_backward_and_step_is_seen_whatever_api_made_it(how):
    model, params = _trained()
    edits = GradEdits(lambda: params)
    try:
        _backward(model)
        assert edits.edited(params) == []
        EDITS[how](params)
        assert len(edits.edited(params)) == len(params)
        _backward(model)  # the next backward marks them anew
        assert edits.edited(params) == []
    finally:
        edits.close()


def test_reading_gradients_is_no_edit_and_a_parameter_never_marked_is_not_judged():
    model, params = _trained()
    edits = GradEdits(lambda: params[:2], by_value=True)
    try:
        _backward(model)
        torch.stack([p.grad.norm() for p in params]).sum().item()
        assert edits.edited(params[:2]) == []
        params[2].grad.mul_(0.5)
        assert edits.edited(params) == []
    finally:
        edits.close()


def test_gradscaler_unscale_and_writes_through_data_are_seen_though_the_version_stays():
    model, params = _trained()
    optimizer = torch.optim.AdamW(params)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    edits = GradEdits(lambda: params, by_value=True)
    try:
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        scaler.unscale_(optimizer)
        assert len(edits.edited(params)) == len(params)
        _backward(model)
        edits.by_value = True
        _backward(model)  # marks with values again
        for p in params:
            p.grad.data.mul_(0.5)
        assert len(edits.edited(params)) == len(params)
        _backward(model)  # values are compared in the first step only: a version-silent write goes unseen later
        for p in params:
            p.grad.data.mul_(0.5)
        assert edits.edited(params) == []
    finally:
        edits.close()


def test_a_closure_is_found_in_step_arguments_and_runs_what_follows_it():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))])
    calls = []

    def closure():
        calls.append("closure")
        return 1.0

    for args, kwargs in (((optimizer, closure), {}), ((optimizer,), {"closure": closure})):
        assert closure_of(args, kwargs) is closure
        args, kwargs = after_closure(args, kwargs, lambda: calls.append("then"))
        assert closure_of(args, kwargs)() == 1.0
    assert calls == ["closure", "then"] * 2
    assert closure_of((optimizer,), {}) is None
