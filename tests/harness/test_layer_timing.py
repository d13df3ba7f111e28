"""The layer profiler against what we know independently about a small model."""

import sys

import pytest
import torch

from hetero.harness.layers import select_layers
from hetero.profile.profiler import ProfileOptions, measure_script
from tests.profile import scripts


def independent_saved_storages(model, x, y) -> list[int]:
    """Sizes of what autograd keeps for one forward, counted with our own hooks: distinct storages, parameters
    excluded, largest first."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sorted(seen.values(), reverse=True)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = scripts.write(tmp_path_factory.mktemp("s"), scripts.LOOP)
    return measure_script(path, [], ProfileOptions(steps=3, warmup=1))


def test_layers_are_the_parameter_owners_in_forward_order(measured):
    assert [layer.name for layer in measured.layers] == ["body.0", "body.2", "norm", "head"]
    assert [layer.type for layer in measured.layers] == ["Linear", "Linear", "LayerNorm", "Linear"]


def test_parameter_bytes_are_exact(measured):
    width = 32
    expected = {"body.0": (16 * width + width) * 4, "body.2": (width * width + width) * 4,
                "norm": 2 * width * 4, "head": (width * 4 + 4) * 4}
    assert {layer.name: layer.params_bytes for layer in measured.layers} == expected
    assert measured.layers[0].params == {"weight": 16 * width * 4, "bias": width * 4}
    assert measured.model.num_params == sum(expected.values()) // 4


def test_saved_bytes_equal_an_independent_count(measured, tmp_path):
    sys.path.insert(0, str(tmp_path))
    namespace: dict = {}
    exec(compile(scripts.HEADER, "net", "exec"), namespace)
    model = namespace["Net"]()
    storages = independent_saved_storages(model, torch.randn(8, 16), torch.randint(4, (8,)))
    assert sum(layer.saved_bytes for layer in measured.layers) == sum(storages)
    assert all(layer.saved_bytes > 0 for layer in measured.layers)
    # Each layer's storages add up to its bytes, largest first, and together they are the independent count.
    for layer in measured.layers:
        assert sum(layer.saved_storages_bytes) == layer.saved_bytes
        assert layer.saved_storages_bytes == sorted(layer.saved_storages_bytes, reverse=True)
    assert sorted((s for x in measured.layers for s in x.saved_storages_bytes), reverse=True) == storages


def test_every_time_is_positive_and_idle_time_shrinks_towards_the_last_layer(measured):
    for layer in measured.layers:
        assert layer.fp_s > 0 and layer.bp_s > 0 and layer.fp_end_s > 0 and layer.bp_start_s > 0, layer
    idle = [layer.bp_start_s - layer.fp_end_s for layer in measured.layers]
    assert all(a > b > 0 for a, b in zip(idle, idle[1:])), idle
    t = measured.training
    assert t.iteration_s > t.forward_s > 0 and t.backward_s > 0 and t.optimizer_step_s > 0
    assert (t.steps_measured, t.warmup_steps, t.optimizer) == (3, 1, "adamw")


def test_gradient_accumulation_and_clipping_are_detected(tmp_path):
    path = scripts.write(tmp_path, scripts.LOOP)
    plain = measure_script(path, [], ProfileOptions(steps=2, warmup=1)).training
    assert (plain.grad_accumulation, plain.edits_grads) == (1, False)
    accum = measure_script(path, ["--accum", "4", "--clip", "1.0"], ProfileOptions(steps=2, warmup=1)).training
    assert (accum.grad_accumulation, accum.edits_grads) == (4, True)
    assert torch.nn.utils.clip_grad_norm_.__name__ == "clip_grad_norm_"  # the watch is undone afterwards


def test_block_granularity_measures_repeated_blocks():
    gpt = _gpt()
    model = gpt.GPT(vocab=64, block_size=8, n_layer=3, n_embd=16, n_head=2)
    layers = select_layers(model, "block")
    assert [layer.name for layer in layers] == ["wte", "wpe", "h.0", "h.1", "h.2", "ln_f", "lm_head"]
    assert sum(p.numel() for layer in layers for p in layer.params.values()) == \
        sum(p.numel() for p in model.parameters())
    assert layers[-1].params == {}  # lm_head's weight is tied to wte's, counted once


def _gpt():
    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "examples"))
    import train_gpt

    return train_gpt


def test_parameters_used_functionally_belong_to_a_layer_that_ran(tmp_path):
    """`enc.out` runs inside its parent (a layer: it owns `enc.scale`); `head.o` has no parent layer: it becomes a
    layer of its own, timed as its nearest sibling by name."""
    path = scripts.write(tmp_path, """
        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = nn.Parameter(torch.ones(16))
                self.out = nn.Linear(16, 16)
            def forward(self, x):
                return F.linear(x * self.scale, self.out.weight, self.out.bias)
        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 4)
            def forward(self, x):
                return F.linear(self.q(x), self.o.weight)
        model = nn.Sequential(Encoder(), Head())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            F.cross_entropy(model(torch.randn(8, 16)), torch.randint(4, (8,))).backward(); opt.step(); opt.zero_grad()
    """)
    layers = measure_script(path, [], ProfileOptions(steps=2, warmup=1)).layers
    assert [x.name for x in layers] == ["0", "1.q", "1.o"]
    assert layers[0].param_names() == ["0.scale", "0.out.weight", "0.out.bias"]
    assert layers[2].param_names() == ["1.o.weight", "1.o.bias"]
    assert (layers[2].fp_s, layers[2].fp_end_s, layers[2].bp_start_s) == (0.0, layers[1].fp_end_s, layers[1].bp_start_s)
    assert sum(x.num_params for x in layers) == 16 + 16 * 17 + 16 * 17 + 4 * 17


def test_what_a_running_layers_own_ops_save_between_its_children_goes_to_the_last_child_that_ended():
    """A root module owning a parameter of its own is a layer running through the whole forward: what the ops of a
    block save between its linears (an activation, a product) belongs to the linear before them, as it would at
    the top level, not to the root, whose backward comes last."""
    from torch import nn

    from hetero.harness.layer_timing import CpuClock, LayerProfiler, summarize

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.down(torch.sigmoid(self.gate(x)) * self.up(x))  # sigmoid and * save outside any layer

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))  # the root owns a parameter: it is a layer
            self.blocks = nn.ModuleList(Gated() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x * self.scale)
            return x

    torch.manual_seed(0)
    model, x = Root(), torch.randn(4, 8)
    profiler = LayerProfiler(model, select_layers(model, "module"), CpuClock())
    profiler.attach()
    model(x).sum().backward()
    profiler.detach()
    layers = {layer.name: layer for layer in summarize(profiler).layers}
    total = sum(independent_saved_storages(model, x, None))
    assert sum(layer.saved_bytes for layer in layers.values()) == total
    # sigmoid's output and up's output (16 floats x 4 rows each) go to `up`, the last child ended before them
    assert layers["blocks.0.up"].saved_bytes >= 2 * 4 * 16 * 4
    assert layers["(model)"].saved_bytes <= 2 * 4 * 8 * 4  # only what it saves before a child ran: x * scale
