"""Routed gradient synchronization: which path each byte takes, and DDP's own gradients and parameters after training
with 2 and 3 gloo processes on loopback."""

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from hetero.harness.capture import fingerprint
from hetero.harness.script import StopScript
from hetero.run.routing import (
    BANDWIDTH,
    LATENCY,
    PRIORITY,
    GradientRouting,
    Message,
    drift,
    first_layers,
    messages,
    ring_through,
    union_s,
)
from hetero.run.runtime import Runtime
from hetero.schema.plan import Budget, Plan, Predicted, RoutingPlan, Source
from tests.figures import figures

KiB = 1024
STEPS = 5


def summarized(line: str) -> tuple[list[str], dict[str, tuple[str, int]]]:
    """GradientRouting's summary line in numbers: its steps and ranks, and per path the bytes and messages a step."""
    head, _, paths = line.partition(";")
    return figures(head), {path: (size, int(n)) for path, size, n in re.findall(r"(\w+) (\S+) in (\d+)", paths)}


def routed_plan(model: nn.Module, *, threshold: int = KiB, latency_peer: int = 1, bandwidth_peer: int = 1,
                shard: int = 4 * KiB, dual_sync: int = 8448, profile: str = "profile.yaml") -> Plan:
    routing = RoutingPlan(threshold_bytes=threshold, latency_peer=latency_peer, bandwidth_peer=bandwidth_peer,
                          shard_bytes=shard, dual_sync_bytes=dual_sync)
    return Plan(source=Source(profile=profile, profile_sha256="0" * 64, model_fingerprint=fingerprint(model)),
                budget=Budget(gpu_memory_bytes=None, dram_budget_bytes=None, reserve=1.0), layers=[], optimizer=None,
                activations=None, routing=routing, predicted=Predicted(iteration_s=0.0, peak_bytes={}),
                omitted={"layers": "test", "optimizer": "test", "activations": "test"})


def test_small_tensors_are_packed_large_ones_sharded_and_the_first_layers_go_first():
    # (start, numel, first layer) in buffer order; 4-byte elements, threshold 64 B (16), shard 128 B (32)
    layout = [(0, 10, False), (10, 70, False), (80, 8, False), (88, 40, True), (128, 4, True), (132, 9, False)]
    assert messages(layout, 4, 64, 128) == [
        Message(PRIORITY, ((88, 120),)), Message(PRIORITY, ((120, 132),)),  # one range, cut at the shard size
        Message(LATENCY, ((0, 10),)), Message(LATENCY, ((80, 88),)), Message(LATENCY, ((132, 141),)),
        Message(BANDWIDTH, ((10, 42),)), Message(BANDWIDTH, ((42, 74),)), Message(BANDWIDTH, ((74, 80),)),
    ]
    packed = messages([(0, 3, False), (10, 5, False), (20, 6, False), (30, 16, False)], 4, 64, 128)
    assert [m.pieces for m in packed] == [((0, 3), (10, 15), (20, 26)), ((30, 46),)]
    assert all(m.numel * 4 <= 64 for m in packed)


def test_a_zero_threshold_sends_everything_on_the_bandwidth_path():
    out = messages([(0, 2, False), (2, 100, False)], 4, 0, 200)
    assert out == [Message(BANDWIDTH, ((0, 50),)), Message(BANDWIDTH, ((50, 100),)), Message(BANDWIDTH, ((100, 102),))]


def test_first_layers_are_whole_tensors_in_first_use_order():
    a, b, c = nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(10))
    assert first_layers([b, a, c], 40) == {id(b)}  # 40 bytes each
    assert first_layers([b, a, c], 41) == {id(b), id(a)}  # the tensor that crosses the limit is taken whole
    assert first_layers([b, a, c], 0) == set()


def test_rings_start_with_rank_0_then_the_peer():
    assert ring_through(2, 4) == [0, 2, 1, 3]
    assert ring_through(0, 3) == [0, 1, 2]
    assert ring_through(1, 2) == [0, 1]


def test_sync_time_counts_overlapping_collectives_once():
    assert union_s([(0.0, 1.0), (0.5, 2.0), (3.0, 3.5), (3.1, 3.2)]) == pytest.approx(2.5)


def test_drift_from_the_prediction_warns():
    (close,) = drift(0.010, 4, 0.009)  # the median sync time, of how many steps, against the plan's
    assert close.startswith("routing: sync ") and figures(close) == ["10ms", "4", "1.11x", "9ms"]
    far, warning = drift(0.030, 4, 0.010)
    assert figures(far) == ["30ms", "4", "3.00x", "10ms"]
    assert warning.startswith("warning: ") and "3.00x" in warning and "hetero profile" in warning
    (alone,) = drift(0.010, 4, None)  # no prediction: nothing to compare with
    assert figures(alone) == ["10ms", "4"]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_plan_naming_a_rank_that_does_not_exist_is_refused(one_rank):
    model = make_model()
    with Runtime(routed_plan(model, bandwidth_peer=1), script=__file__), pytest.raises(StopScript) as stop:
        DDP(model)
    assert stop.value.error.exit_code == 4
    message = stop.value.error.message  # the field, the rank it names, the ranks this run has (0 to 0)
    assert "routing.latency_peer" in message and figures(message) == ["1", "1", "0", "0"]
    assert "--nproc-per-node" in stop.value.error.hint


class Net(nn.Module):
    """Registered out of forward order; weights above the 1 KiB threshold, biases and the norm below it."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(64, 8)  # 2 KiB weight: one shard
        self.mid = nn.Linear(64, 64)  # 16 KiB weight: four 4 KiB shards
        self.norm = nn.LayerNorm(64)
        self.inp = nn.Linear(32, 64)  # 8 KiB weight + 256 B bias: the first 8448 bytes of the forward

    def forward(self, x):
        return self.out(F.gelu(self.mid(self.norm(self.inp(x)))))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def train(model: nn.Module, rank: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data: averaging matters
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(16, 32, generator=g)), torch.randint(8, (16,), generator=g)).backward()
        opt.step()


def _worker(rank: int, world: int, peers: tuple[int, int], rdzv: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    reference, routed = make_model(), make_model()
    train(DDP(reference, bucket_cap_mb=0.01), rank)  # small buckets: the hook sees several per step
    with Runtime(routed_plan(routed, latency_peer=peers[0], bandwidth_peer=peers[1]), script=__file__) as runtime:
        train(DDP(routed, bucket_cap_mb=0.01), rank)
    routing = next(m for m in runtime.mechanisms if isinstance(m, GradientRouting))
    torch.save({"reference": _state(reference), "routed": _state(routed), "moved": routing.syncs[0].moved,
                "summary": runtime.summary()}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _state(model: nn.Module) -> dict:
    return {name: (p.detach().clone(), p.grad.clone()) for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, peers", [(2, (1, 1)), (3, (2, 1))])  # 3: the two rings differ, [0, 2, 1], [0, 1, 2]
def test_routed_ranks_train_as_plain_ddp(tmp_path, world, peers):
    mp.spawn(_worker, args=(world, peers, str(tmp_path / "rdzv"), str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for result in results:
        for name, (param, grad) in result["reference"].items():
            routed_param, routed_grad = result["routed"][name]
            assert_close(routed_grad, grad, msg=f"gradient of {name}")
            assert_close(routed_param, param, msg=f"{name}")
        # per step, in DDP's two buckets [out, mid] and [norm, inp]: inp's weight and bias first, in 4 KiB shards;
        # the small tensors packed, one message per bucket; the other weights sharded
        assert result["moved"] == {PRIORITY: [8192 + 256, 3], LATENCY: [4 * (8 + 64 + 64 + 64), 2],
                                   BANDWIDTH: [16384 + 2048, 4 + 1]}
        assert summarized(result["summary"][0]) == (["5", str(world)], {PRIORITY: ("8.25KiB", 3),
                                                                        LATENCY: ("800B", 2), BANDWIDTH: ("18KiB", 5)})
    for other in results[1:]:
        for name, (param, _) in results[0]["routed"].items():
            assert torch.equal(other["routed"][name][0], param), name  # the ranks stay in step, bit for bit
