"""NVMe-spilled optimizer states: the runtime's schedule (its trace: spans of the state files' reads and writes) and
the simulator's (its recorded spans) for the same placement follow the same rules: reads begin after backward,
inside step(); tensors go in parameter order; a tensor's states are written after they were read (and updated);
and with two staging slots, the tensor after next is read only once this one was written out."""

from __future__ import annotations

from time import perf_counter

import torch
import torch.nn.functional as F
from torch import nn

from hetero.plan import axdimm
from hetero.plan.model import Choices, Costs, Curve, LayerCosts
from hetero.plan.simulate import simulate
from hetero.run import spans
from hetero.run.runtime import Runtime
from tests.run.plans import optimizer_plan

WIDTH, LAYERS, SPILLED = 64, 5, 4
MS = 1e-3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def check(events: dict[str, dict[str, tuple[float, float]]], names: list[str], backward_end: float) -> None:
    """events: per tensor (in parameter order), the (start, end) of its read and of its write."""
    reads = [events[n]["read"] for n in names]
    writes = [events[n]["write"] for n in names]
    assert all(start >= backward_end for start, _ in reads)  # inside step(), after backward
    assert [r[0] for r in reads] == sorted(r[0] for r in reads)  # in parameter order
    assert [w[0] for w in writes] == sorted(w[0] for w in writes)
    assert all(w[0] >= r[1] for r, w in zip(reads, writes))
    assert all(reads[k + 2][0] >= writes[k][1] for k in range(len(names) - 2))  # two slots


def runtime_events(tmp_path) -> tuple[dict, list[str], float]:
    net = model()
    names = [f"{k}.weight" for k in range(SPILLED)]
    sink = spans.Sink()
    with Runtime(optimizer_plan(net, nvme=tuple(names), nvme_path=str(tmp_path)), script=__file__):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        spans.active, sink.recording = sink, True
        try:
            F.mse_loss(net(torch.randn(8, WIDTH)), torch.zeros(8, WIDTH)).backward()
            backward_end = perf_counter()
            opt.step()
        finally:
            spans.active = None
    events: dict[str, dict[str, tuple[float, float]]] = {n: {} for n in names}
    for _, name, start, end, _ in sink.spans:
        what, _, key = name.partition(" ")
        tensor = key.rsplit(".", 2)[0]  # "0.weight.0.m" (piece 0) -> "0.weight"; p, m and v move together
        if what in ("read", "write") and tensor in events and key.rsplit(".", 1)[1] in "pmv":
            before = events[tensor].get(what, (start, end))
            events[tensor][what] = (min(before[0], start), max(before[1], end))
    return events, names, backward_end


def simulated_events() -> tuple[dict, list[str], float]:
    net = model()
    plan = optimizer_plan(net, nvme=tuple(f"{k}.weight" for k in range(SPILLED)))
    layers = [LayerCosts(name=str(k), params_bytes=WIDTH * WIDTH * 4, num_params=WIDTH * WIDTH, saved_bytes=0,
                         fp_s=1 * MS, bp_s=2 * MS, fp_dha_s=None, bp_dha_s=None, bp_grad_host_s=None, copy_s=0.0,
                         grad_copy_s=0.0, fp_gap_s=0.0, bp_gap_s=0.0) for k in range(LAYERS)]
    params = [axdimm.Param(name=f"{k}.weight", layer=k, num_params=WIDTH * WIDTH) for k in range(LAYERS)]
    rates = axdimm.Rates(adam_params_per_s=1e7, lanes=["ch0", "ch1"], nvme_read=Curve.linear(1e8),
                         nvme_write=Curve.linear(1e8))
    costs = Costs(layers=layers, bp_order=list(range(LAYERS))[::-1], tail_s=0.0, micro_batches=1, has_gpu=False,
                  evict=None, prefetch=None)
    ch = Choices(modes=["gfgb"] * LAYERS, grads=["gpu"] * LAYERS, evict_bytes=[0] * LAYERS, trigger=[None] * LAYERS,
                 prefetch_at_s=[0.0] * LAYERS, updates=axdimm.updates(params, plan.optimizer.states, LAYERS, rates),
                 lanes=rates.lanes, overlap_backward=True, grads_to_host=False, params_on_gpu=False)
    result = simulate(costs, ch, record=True)
    names = [f"{k}.weight" for k in range(SPILLED)]
    events: dict[str, dict[str, tuple[float, float]]] = {n: {} for n in names}
    for s in result.spans:
        what = {"nvme read": "read", "nvme write": "write"}.get(s.lane)
        if what:
            events[f"{s.name.rsplit(' ', 1)[1]}.weight"][what] = (s.start_s, s.end_s)
    return events, names, max(result.bp_end_s)


def test_runtime_and_simulator_stage_spilled_states_alike(tmp_path):
    check(*simulated_events())
    check(*runtime_events(tmp_path))
