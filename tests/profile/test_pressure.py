"""Under a budget its forward would not keep, the profile recomputes the model's blocks from where the process
nears the budget: every block in the first forward, then, from what that forward added beyond its blocks, the ones
that keep the budget run as written, for good; the others' layers are given what a measured twin's saved."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero.profile import pressure
from hetero.schema.profile import Layer

MiB = 2**20


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def layer(name: str, saved: int) -> Layer:
    return Layer(name=name, type="Linear", num_params=72, params={"weight": 256, "bias": 32}, fp_s=1e-3, bp_s=2e-3,
                 fp_dha_s=None, bp_dha_s=None, bp_grad_host_s=None, saved_bytes=saved,
                 saved_storages_bytes=[saved] if saved else [], fp_end_s=1e-3, bp_start_s=5e-3)


def test_blocks_run_as_written_while_they_keep_the_budget_and_the_rest_are_filled_from_a_twin(monkeypatch):
    readings = iter([100, 101, 102, 103,  # the first forward: every block recomputed, whatever is held
                     100, 150, 200, 250])  # the second: each block as written keeps 50 MiB
    monkeypatch.setattr(pressure.process_memory, "resident_bytes", lambda: next(readings) * MiB)
    monkeypatch.setattr(pressure.process_memory, "dram_peak_bytes", lambda: 200 * MiB)
    watch = pressure.UnderPressure(400 * MiB)
    torch.manual_seed(0)
    model = Net()
    try:
        for _ in range(3):  # the third forward reads nothing: its blocks keep the second's decisions
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        with torch.no_grad():
            model(torch.randn(4, 8))  # evaluation: as written, nothing counted
    finally:
        watch.close()
    # the mark: the budget less 3% headroom less what the first forward added beyond its blocks (200 - 100 MiB)
    assert watch.mark == int(400 * MiB * 0.97) - 100 * MiB
    assert watch.decided == {"blocks.0": True, "blocks.1": True, "blocks.2": True, "blocks.3": False}
    assert watch.engaged == {"blocks.3": 2}  # the second and third forwards
    assert "forward" not in model.blocks[0].__dict__  # closed: the class's forward again
    watch.inputs["blocks.3"] = 1000
    layers = [layer("blocks.0.fc", 5000), layer("blocks.3.fc", 0), layer("head", 700)]
    filled, added = watch.fill(layers, output_bytes=0, grads_gone=False)
    # plain's peak: every saved tensor and the head's gradients (10700 + 288); recomputing blocks.3 tops out at its
    # rebuild, blocks.0's 5000 still held (5000 + 1000 kept + 4000 rebuilt + 576 of gradients)
    assert [x.saved_bytes for x in filled] == [5000, 5000, 700] and added == 10988 - 10576
    assert watch.described(added).startswith("1 of 4 blocks recomputed while the process held more than")


def test_where_no_block_of_its_class_ran_as_written_its_saved_tensors_are_counted_without_being_kept(monkeypatch):
    monkeypatch.setattr(pressure.process_memory, "resident_bytes", lambda: 900 * MiB)  # over the mark throughout
    monkeypatch.setattr(pressure.process_memory, "dram_peak_bytes", lambda: 950 * MiB)
    watch = pressure.UnderPressure(400 * MiB)
    torch.manual_seed(0)
    model = Net()
    try:
        for _ in range(2):
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        assert set(watch.engaged) == {f"blocks.{k}" for k in range(4)}
        state = torch.get_rng_state()
        layers = [layer(f"blocks.{k}.fc", 0) for k in range(4)] + [layer("head", 700)]
        watch.inputs = dict.fromkeys(watch.engaged, 100)
        filled, added = watch.fill(layers, output_bytes=0, grads_gone=False)
        _, added_gone = watch.fill(layers, output_bytes=0, grads_gone=True)
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        watch.close()
    # Linear saves its input (4 x 8 fp32) and GELU the Linear's output: two storages of 128 bytes each
    assert [x.saved_storages_bytes for x in filled[:4]] == [[128, 128]] * 4
    # every block recomputed: the optimizer's step (5 layers' gradients, Adam's temporaries) is the peak
    assert [x.saved_bytes for x in filled] == [256] * 4 + [700] and added == (1024 + 700 + 288) - (5 * 288 + 2 * 256)
    # with the gradients on NVMe as they are made (the profile's own optimizer there), backward's start is the peak
    # either way: the four blocks' savings beyond their inputs
    assert added_gone == (1024 + 700) - (4 * 100 + 700)


class Freeing(nn.Module):
    """Each step's input is saved, then freed once the next step has it: the next allocation takes its address."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        for _ in range(4):
            x = torch.tanh(self.fc(x)).clone()
        return x


def test_what_a_block_saves_counts_each_storage_saved_once_even_where_a_freed_ones_address_is_taken_again():
    block, x = Freeing(), torch.randn(32, 64, requires_grad=True)
    watched = pressure.UnderPressure(1 << 30)
    watched.modules = {"b": block}
    try:
        counted = watched.saved_by_layer("b", (x,), {})
    finally:
        watched.close()  # its global pre-hook would otherwise recompute the next test's model's blocks
    kept, truth = [], {}
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def keep(t):  # every saved tensor held: no address is taken twice
        kept.append(t)
        if t.untyped_storage().data_ptr() not in params:
            truth[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        block(x)
    assert sum(map(sum, counted.values())) == sum(truth.values()) == 8 * 32 * 64 * 4  # 4 inputs, 4 tanh outputs
