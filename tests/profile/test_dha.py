"""The DHA measurements of `hetero profile`: each layer replayed alone in each mode (on the CPU stand-in here, so
the replay, the placement and the restoration are checked everywhere; the times mean something only on a GPU)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetero.harness.layer_timing import CpuClock
from hetero.harness.layers import select_layers
from hetero.profile.dha import FIELDS, RootInputs, measure_layers, unmeasured
from hetero.schema.profile import Layer
from tests.conftest import REPO
from tests.standin import StandInDevice


class Fragile(nn.Linear):
    """A layer that only works inside its parent's forward (it reads state the parent sets up)."""

    inside = False

    def forward(self, x):
        if not self.inside:
            raise RuntimeError("called outside its parent")
        return super().forward(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.fragile = Fragile(8, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, idx):
        self.fragile.inside = True
        try:
            x = self.fragile(self.norm(self.emb(idx)))
        finally:
            self.fragile.inside = False
        return self.head(F.gelu(x))


def layers_of(model: nn.Module) -> list[Layer]:
    return [Layer(name=s.name, type=type(s.module).__name__, num_params=sum(p.numel() for p in s.params.values()),
                  params={k: p.numel() * 4 for k, p in s.params.items()}, fp_s=1e-4, bp_s=2e-4, fp_dha_s=None,
                  bp_dha_s=None, bp_grad_host_s=None, saved_bytes=0, fp_end_s=1e-3, bp_start_s=2e-3)
            for s in select_layers(model, "module")]


def test_each_layer_is_replayed_in_every_mode_and_the_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = Net()
    inputs = RootInputs(model)
    idx = torch.randint(16, (4, 5))
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    with torch.no_grad():
        model(torch.randint(16, (1, 2)))  # an evaluation call is not a training call: not kept
    assert inputs.call[0][0] is idx
    storages = [p.data_ptr() for p in model.parameters()]
    before = model(idx).detach()

    out = measure_layers(model, inputs, layers_of(model), "module", StandInDevice(), CpuClock())
    by_name = {x.name: x for x in out}
    for name in ("emb", "norm", "head"):
        x = by_name[name]
        assert x.fp_dha_s >= x.fp_s and x.bp_dha_s >= x.bp_s and x.bp_grad_host_s >= x.bp_s, x
    assert by_name["fragile"].fp_dha_s is None
    assert set(unmeasured(out)) == {f"layers.fragile.{f}" for f in FIELDS}

    assert [p.data_ptr() for p in model.parameters()] == storages
    assert all(p.grad is None for p in model.parameters()) and "forward" not in model.head.__dict__
    assert torch.equal(model(idx), before)
    assert not model._forward_pre_hooks  # the replay's hooks are gone


def test_nothing_is_replayed_without_a_training_call():
    model = Net()
    inputs = RootInputs(model)
    layers = layers_of(model)
    assert measure_layers(model, inputs, layers, "module", StandInDevice(), CpuClock()) is layers


@pytest.mark.gpu
def test_gpu_profile_measures_dha(tmp_path):
    from hetero.profile.profiler import ProfileOptions, profile_script

    args = ["--device", "cuda", "--n-layer", "2", "--steps", "50"]
    profile = profile_script(str(REPO / "examples/train_gpt.py"), args,
                             ProfileOptions(steps=3, warmup=2, nvme_dir=str(tmp_path)))
    gpu = profile.machine.gpu
    assert all(math.isfinite(x) and x > 0 for x in (gpu.dha_read_bytes_per_s, gpu.dha_write_bytes_per_s)), gpu
    for layer in profile.layers:
        assert layer.fp_dha_s >= layer.fp_s and layer.bp_dha_s >= layer.bp_s, layer
        assert layer.bp_grad_host_s >= layer.bp_s, layer
    assert not any(key.endswith(FIELDS) for key in profile.unmeasured), profile.unmeasured
