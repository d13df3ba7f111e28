from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hetero.errors import HeteroError
from hetero.kernels.adam import AdamKernel, Hyperparameters, adam_reference

STEPS = 20
CONFIGS = {
    "adamw": {"cls": torch.optim.AdamW, "weight_decay": 0.05, "maximize": False},
    "adam-l2": {"cls": torch.optim.Adam, "weight_decay": 0.1, "maximize": False},
    "adam-plain": {"cls": torch.optim.Adam, "weight_decay": 0.0, "maximize": False},
    "adamw-maximize": {"cls": torch.optim.AdamW, "weight_decay": 0.01, "maximize": True},
}


def _lr(step: int) -> float:
    return 1e-2 * 0.8**step  # changes every step, as a scheduler would


def _grads(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, generator=gen) for _ in range(STEPS)]


def _run_torch(cls: type, start: torch.Tensor, grads: list[torch.Tensor], **kw) -> torch.Tensor:
    p = torch.nn.Parameter(start.clone())
    opt = cls([p], lr=_lr(1), betas=(0.8, 0.99), eps=1e-6, foreach=False, **kw)
    for step, g in enumerate(grads, start=1):
        opt.param_groups[0]["lr"] = _lr(step)
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _run_ours(update, start: torch.Tensor, grads: list[torch.Tensor], hp: Hyperparameters):
    param, m, v, g = start.clone(), torch.zeros_like(start), torch.zeros_like(start), torch.empty_like(start)
    for step, grad in enumerate(grads, start=1):
        g.copy_(grad)
        update(param, g, m, v, hyperparameters=dataclasses.replace(hp, lr=_lr(step)), step=step)
    return param, m, v


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_matches_reference_and_torch_over_20_steps(name):
    cfg = CONFIGS[name]
    start = torch.randn(1003, generator=torch.Generator().manual_seed(0))  # odd size: exercises the vector tail
    grads = _grads(start.numel())
    hp = Hyperparameters(betas=(0.8, 0.99), eps=1e-6, weight_decay=cfg["weight_decay"],
                         decoupled_weight_decay=cfg["cls"] is torch.optim.AdamW, maximize=cfg["maximize"])
    fast, m_fast, v_fast = _run_ours(AdamKernel(), start, grads, hp)
    ref, m_ref, v_ref = _run_ours(adam_reference, start, grads, hp)
    expected = _run_torch(cfg["cls"], start, grads, weight_decay=cfg["weight_decay"], maximize=cfg["maximize"])
    torch.testing.assert_close(fast, ref)
    torch.testing.assert_close(m_fast, m_ref)
    torch.testing.assert_close(v_fast, v_ref)
    torch.testing.assert_close(ref, expected)
    torch.testing.assert_close(fast, expected)
    assert not torch.equal(fast, start)


def test_views_of_a_flat_buffer_update_in_place_and_leave_the_rest_alone():
    sizes, gap = [300, 7, 512], 5
    total = sum(sizes) + gap * len(sizes)
    flat = {name: torch.full((total,), 123.0) for name in ("param", "grad", "m", "v")}
    starts = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)]
    grads = [_grads(n) for n in sizes]
    slices, offset = [], gap
    for start, n in zip(starts, sizes):
        slices.append(slice(offset, offset + n))
        flat["param"][offset:offset + n] = start
        flat["m"][offset:offset + n] = 0
        flat["v"][offset:offset + n] = 0
        offset += n + gap
    kernel = AdamKernel()
    hp = Hyperparameters(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, decoupled_weight_decay=True)
    data_before = flat["param"].data_ptr()
    for step in range(1, STEPS + 1):
        for sl, g in zip(slices, grads):
            flat["grad"][sl] = g[step - 1]
            views = [flat[k][sl].view(-1) for k in ("param", "grad", "m", "v")]
            kernel(*views, hyperparameters=dataclasses.replace(hp, lr=_lr(step)), step=step)
    assert flat["param"].data_ptr() == data_before
    for sl, start, g in zip(slices, starts, grads):
        expected = _run_torch(torch.optim.AdamW, start, g, weight_decay=0.01)
        torch.testing.assert_close(flat["param"][sl], expected)
    untouched = torch.ones(total, dtype=torch.bool)
    for sl in slices:
        untouched[sl] = False
    for name in ("param", "m", "v"):
        assert torch.all(flat[name][untouched] == 123.0), name


def test_a_step_allocates_no_memory():
    buffers = [torch.randn(100_000) for _ in range(4)]
    kernel, hp = AdamKernel(), Hyperparameters(weight_decay=0.01, decoupled_weight_decay=True)
    kernel(*buffers, hyperparameters=hp, step=1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for step in range(2, 6):
            kernel(*buffers, hyperparameters=dataclasses.replace(hp, lr=hp.lr / step), step=step)
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())
    assert allocated <= 4 * 16  # torch's functional API makes a scalar per call; nothing of a buffer's size
    # the profiler does see allocations: the reference allocates its temporaries
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        adam_reference(*buffers, hyperparameters=hp, step=6)
    assert sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages()) >= 100_000 * 4


def test_from_param_group_reads_torch_groups():
    p = torch.nn.Parameter(torch.zeros(2))
    adamw = Hyperparameters.from_param_group(torch.optim.AdamW([p], lr=3e-4, maximize=True).param_groups[0])
    assert adamw == Hyperparameters(lr=3e-4, weight_decay=0.01, decoupled_weight_decay=True, maximize=True)
    adam = Hyperparameters.from_param_group(torch.optim.Adam([p], betas=(0.5, 0.6)).param_groups[0])
    assert adam.betas == (0.5, 0.6) and not adam.decoupled_weight_decay and adam.weight_decay == 0
    with pytest.raises(HeteroError, match="amsgrad"):
        Hyperparameters.from_param_group(torch.optim.Adam([p], amsgrad=True).param_groups[0])


@pytest.mark.parametrize("bad, field", [
    ({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.9)}, "beta1"), ({"betas": (0.9, -0.1)}, "beta2"),
    ({"eps": -1e-8}, "eps"), ({"weight_decay": -0.1}, "weight_decay"),
])
def test_invalid_hyperparameters_name_the_bad_value(bad, field):
    with pytest.raises(HeteroError, match=f"invalid Adam {field}"):
        Hyperparameters(**bad)


def test_mismatched_buffers_are_clear_errors():
    kernel, hp = AdamKernel(), Hyperparameters()
    ok = [torch.zeros(8) for _ in range(4)]
    with pytest.raises(HeteroError, match=r"exp_avg has shape \(7,\)"):
        kernel(ok[0], ok[1], torch.zeros(7), ok[3], hyperparameters=hp, step=1)
    with pytest.raises(HeteroError, match="grad is torch.bfloat16"):
        kernel(ok[0], torch.zeros(8, dtype=torch.bfloat16), ok[2], ok[3], hyperparameters=hp, step=1)
    with pytest.raises(HeteroError, match="step 0"):
        kernel(*ok, hyperparameters=hp, step=0)
