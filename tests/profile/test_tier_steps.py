"""The disk timed as the runtime's tiering drives it, beside a script's own training steps."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from hetero.plan.policy import POLICY
from hetero.profile import tier_steps
from hetero.profile.profiler import ProfileOptions, measure_script
from hetero.run import process_memory, spans
from hetero.schema.plan import ActivationPlan
from hetero.schema.profile import Layer
from tests.profile import scripts
from tests.waits import until

WIDE = """
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)  # warm-up, measured, returned-memory and disk steps
args = parser.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 4))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(args.steps):
    opt.zero_grad()
    x, y = torch.randn(128, 64), torch.randint(4, (128,))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""


def settled(steps: tier_steps.TierSteps, model: nn.Module) -> None:
    """Make the disk's trips happen as on a model big enough for them, whatever the machine's load: backward starts
    once the writer has evicted every saved tensor, and each layer's backward once the reader has brought back what
    its start asked for. A loaded machine may instead run backward first and fetch each tensor inline ("late
    fetch": no prefetch measured) or call its eviction off (nothing written): nothing to time."""
    mover = steps.tiering.mover

    def backward_waits_for_the_writer(module, args, out) -> None:
        out.register_hook(lambda grad: until(mover.writer.idle))

    model.register_forward_hook(backward_waits_for_the_writer)
    steps.tiering.on_unpack(lambda layer: until(mover.reader.idle))


class Settled(tier_steps.TierSteps):
    """TierSteps that `settled` each model it starts on."""

    def bind(self, model: nn.Module) -> None:
        super().bind(model)
        settled(self, model)


def _layer(name: str, storages: list[int]) -> Layer:
    return Layer(name=name, type="Linear", num_params=0, params={}, fp_s=1e-3, bp_s=1e-3, fp_dha_s=None,
                 bp_dha_s=None, bp_grad_host_s=None, saved_bytes=sum(storages), saved_storages_bytes=storages,
                 fp_end_s=0.0, bp_start_s=0.0)


def test_every_layer_with_a_movable_storage_evicts_all_and_comes_back_as_the_next_ones_backward_starts():
    layers = [_layer("a", [2**20, 4]), _layer("b", [1024]), _layer("c", [2**17]), _layer("d", [2**22])]
    chosen = tier_steps.schedule(layers)
    assert [(e.layer, e.evict_bytes, e.prefetch_after) for e in chosen] == [("a", 2**20 + 4, "b"),
                                                                           ("c", 2**17, "d")]  # d: the last


def test_a_read_counts_the_delete_of_its_file_and_sizes_come_from_the_recorded_spans():
    recorded = [("evict", "evict a", 0.0, 0.002, {"bytes": 2**20}), ("evict", "evict a", 1.0, 1.004, {"bytes": 2**20}),
                ("evict", "evict b", 0.0, 0.001, {"bytes": 2**17}),
                ("prefetch", "prefetch a", 2.0, 2.003, {"bytes": 2**20}),
                ("prefetch", "prefetch b", 2.0, 2.001, {"bytes": 2**17}),
                ("evict", "delete a", 3.0, 3.0005, {"bytes": 2**20}), ("compute", "fp a", 0.0, 1.0, {})]
    read, write = tier_steps.curves(recorded)
    assert [(p.size_bytes, p.time_s) for p in write] == [(2**17, 0.001), (2**20, 0.003)]  # the median of 2 and 4
    assert [(p.size_bytes, p.time_s) for p in read] == [(2**17, 0.0015), (2**20, 0.0035)]  # b: the median delete
    assert tier_steps.curves([("compute", "fp a", 0.0, 1.0, {})]) is None


def test_timed_steps_train_exactly_as_plain_steps_and_leave_no_files(tmp_path):
    def train(steps=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 4))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        if steps is not None:
            steps.bind(model)
            settled(steps, model)
        losses = []
        for _ in range(tier_steps.STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(model(torch.randn(128, 64)), torch.randint(4, (128,)))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if steps is not None:
                steps.step_ended()
        return losses, model

    layers = [_layer("0", [128 * 64 * 4]), _layer("2", [128 * 256 * 4]), _layer("3", [128 * 256 * 4])]
    steps = tier_steps.TierSteps(layers, str(tmp_path), "nvme0", clean_step_s=0.0)
    try:
        losses, model = train(steps)
    finally:
        steps.close()
    plain_losses, plain = train()
    torch.testing.assert_close(losses, plain_losses, rtol=0, atol=0)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    disk = steps.measured()
    assert {p.size_bytes for p in disk.write} <= {128 * 64 * 4, 128 * 256 * 4} and all(p.time_s > 0 for p in disk.read)
    assert disk.stretch > 0  # against steps of no time at all, every timed second is lost to the workers
    assert spans.active is None and list(tmp_path.iterdir()) == []


def test_the_profile_times_the_disk_beside_the_scripts_training_when_it_runs_long_enough(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_steps, "TierSteps", Settled)
    path = scripts.write(tmp_path, WIDE)
    disk = tmp_path / "disk"
    disk.mkdir()
    long = measure_script(path, [], ProfileOptions(steps=2, warmup=1, nvme_dir=str(disk)))
    assert {p.size_bytes for p in long.disk_beside.write} <= {128 * 64 * 4, 128 * 256 * 4}
    assert long.disk_beside.stretch >= 0
    assert list(disk.iterdir()) == []
    short = measure_script(path, ["--steps", "3"], ProfileOptions(steps=2, warmup=1, nvme_dir=str(disk)))
    assert short.disk_beside is None and len(short.layers) == len(long.layers)  # measured, timed beside a GEMM loop


def test_the_disk_is_timed_beside_training_only_where_the_budget_leaves_room_for_the_store(monkeypatch):
    MiB = 2**20
    buffers = ActivationPlan.STORE_BYTES
    monkeypatch.setattr(process_memory, "dram_peak_bytes", lambda: 400 * MiB)
    assert tier_steps.room_beside(None)  # no budget
    assert tier_steps.room_beside((2 * 400 * MiB, "the memory cgroup"))
    budget = 512 * MiB
    monkeypatch.setattr(process_memory, "dram_peak_bytes", lambda: POLICY.room_of(budget) - buffers + 1)
    assert not tier_steps.room_beside((budget, "the 512MiB memory cgroup"))
    monkeypatch.setattr(process_memory, "dram_peak_bytes", lambda: POLICY.room_of(budget) - buffers)
    assert tier_steps.room_beside((budget, "the 512MiB memory cgroup"))
