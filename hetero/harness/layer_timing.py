"""Per-layer times and saved-activation bytes of training micro-batches, measured with hooks only.

Forward: module pre/post hooks give each layer's own time (nested layers subtracted) and its end. Saved tensors: a
`saved_tensors_hooks` pair attributes each storage autograd saves (parameters excluded) to the layer running, or
between layers to the last one that ended; a storage saved by several layers belongs to the last. Backward: the
first unpack of a layer's saved tensors is its start (TierTrain's ts^B); the parameters' gradient hooks mark its
end. The clock hands out tokens (perf_counter values or CUDA events), resolved to seconds after the last step.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from hetero.harness import hooks, watch
from hetero.harness.layers import LayerSpec, adopt_unseen, before_backward, sharded, storages
from hetero.harness.models import roots
from hetero.schema.profile import Layer
from hetero.units import measured


class CpuClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def finish(self) -> None:
        pass


class CudaClock:
    """CUDA events recorded in stream order; read once, after the last step (no sync inside a step)."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def finish(self) -> None:
        torch.cuda.synchronize()


class Interval(NamedTuple):
    """One layer's forward, between two clock tokens; `depth` is how many layers enclose it."""

    layer: int
    start: Any
    end: Any
    depth: int


@dataclass(slots=True)
class PassTokens:
    """Clock tokens of one micro-batch's forward and backward; layer indices: positions in the profiler's layer list."""

    start: Any
    root: int = 0  # which of the model's roots (hetero.harness.models) made it
    forward_end: Any = None
    intervals: list[Interval] = field(default_factory=list)  # in end order
    fp_end: dict[int, Any] = field(default_factory=dict)
    grad_ready: dict[int, Any] = field(default_factory=dict)
    first_unpack: dict[int, Any] = field(default_factory=dict)
    saved_bytes: Counter = field(default_factory=Counter)
    owner: dict[int, int] = field(default_factory=dict)  # storage -> layer that saved it last
    sizes: dict[int, int] = field(default_factory=dict)  # storage -> its bytes
    backward_end: Any = None
    order: list[int] = field(default_factory=list)  # layers in the order their forward started


COMPILED = ("the model is compiled (torch.compile): hetero's per-layer hooks would be traced into its graph, so "
            "layers are not timed and their saved activations not measured")


class LayerProfiler:
    """Hooks on one model; every forward with grad enabled while attached is one micro-batch (PassTokens). Of several
    models, every call of each is one, and a backward ends the last one of the model whose parameters it reaches.
    `compiled`: only the parameters' gradient hooks count the micro-batches (other hooks would be traced into the
    graph), and every layer is reported with zero times and bytes (`COMPILED`)."""

    def __init__(self, model: nn.Module, layers: list[LayerSpec], clock: CpuClock | CudaClock,
                 saved_tensors: bool = True, compiled: bool = False):
        self.model, self.layers, self.clock, self.compiled = model, layers, clock, compiled
        self.roots = roots(model)
        self.root_of = {id(p): k for k, root in enumerate(self.roots) for p in root.parameters()}
        self.first_param = next((p for p in model.parameters() if p.requires_grad), None)
        self.index = {id(layer.module): i for i, layer in enumerate(layers)}
        self.own_storages = storages(model.parameters())
        self.sharded = sharded(model)  # FSDP2: parameters' storages are read again at each layer's start
        self.param_storages = set(self.own_storages)
        self.micro_batches: list[PassTokens] = []
        self.current: PassTokens | None = None  # the micro-batch whose forward is running
        self.last_forward: PassTokens | None = None  # the one whose forward ended last
        self.last_of_root: dict[int, PassTokens] = {}  # by root: the one whose backward runs next
        self.pending: list[PassTokens] = []  # forwards ended whose backward call has not returned
        self.backward_calls = 0  # that returned while attached (0: not counted, a compiled model)
        self.stack: list[list] = []  # [layer, start token, depth, last nested layer ended] of layers running
        self.last_ended = -2  # -2: no layer yet (tensors saved before the first layer go to it)
        # off where another owner of the saved-tensor hooks must see every tensor: backward starts then come from
        # the outputs' gradients alone
        self.saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) if saved_tensors \
            else contextlib.nullcontext()
        self.hook_s = 0.0  # time spent inside these hooks: the profiler's own cost
        self.handles: list = []

    def attach(self) -> None:
        if self.compiled:
            self.handles = [self.first_param.register_post_accumulate_grad_hook(self._backward_counted)]
            return
        self.handles = [handle for root in self.roots for handle in (
            hooks.forward_pre(root, self._forward_start), hooks.forward(root, self._forward_end, always_call=True))]
        for layer in self.layers:
            self.handles += [hooks.forward_pre(layer.module, self._layer_start),
                             hooks.forward(layer.module, self._layer_end)]
        self.handles += [p.register_post_accumulate_grad_hook(self._grad_accumulated)
                         for p in self.model.parameters() if p.requires_grad]
        self.handles.append(watch.backward_calls(self._backward_returned))

    def detach(self) -> None:
        self.handles = hooks.removed(self.handles)

    def _forward_start(self, module, args) -> None:
        if not torch.is_grad_enabled() or self.current is not None:
            return  # evaluation forwards are not training micro-batches; a model called inside another is a layer
        t = time.perf_counter()
        root = next(k for k, r in enumerate(self.roots) if r is module)
        self.current = PassTokens(start=self.clock.mark(), root=root)
        self.micro_batches.append(self.current)
        self.stack, self.last_ended = [], -2
        if self.sharded:
            self.param_storages = set(self.own_storages)
        self.saved_hooks.__enter__()
        self.hook_s += time.perf_counter() - t

    def _forward_end(self, module, args, output) -> None:
        if self.current is None or self.roots[self.current.root] is not module:
            return
        self.saved_hooks.__exit__(None, None, None)
        self.current.forward_end = self.clock.mark()
        self.pending.append(self.current)
        self.last_forward = self.last_of_root[self.current.root] = self.current
        self.current = None

    def _layer_start(self, module, args) -> None:
        if (mb := self.current) is None:
            return
        t = time.perf_counter()
        i = self.index[id(module)]
        if self.sharded:  # FSDP2 has just unsharded the layer's parameters into storages of their own
            self.param_storages |= storages(module.parameters(recurse=False))
        if i not in mb.order:
            mb.order.append(i)
        self.stack.append([i, self.clock.mark(), len(self.stack), None])
        self.hook_s += time.perf_counter() - t

    def _layer_end(self, module, args, output) -> None:
        mb = self.current
        if mb is None or not self.stack:
            return
        t = time.perf_counter()
        i, start, depth, _ = self.stack.pop()
        end = self.clock.mark()
        mb.intervals.append(Interval(i, start, end, depth))
        mb.fp_end[i] = end
        self.last_ended = i
        if self.stack:
            self.stack[-1][3] = i
        before_backward(output, self._grad_ready_hook(mb, i))
        self.hook_s += time.perf_counter() - t

    # -- saved tensors and backward ----------------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor) -> tuple:
        t = time.perf_counter()
        mb = self.current
        storage, nbytes = _storage(tensor)
        if mb is None or storage in self.param_storages:
            layer = -1
        else:
            top = self.stack[-1] if self.stack else None
            layer = self.last_ended if top is None else top[0] if top[3] is None else top[3]
            # A storage saved by several layers belongs to the last: its backward is the first to need it back.
            previous = mb.owner.get(storage)
            if previous != layer:
                if previous is not None:
                    mb.saved_bytes[previous] -= nbytes
                mb.owner[storage], mb.sizes[storage] = layer, nbytes
                mb.saved_bytes[layer] += nbytes
        self.hook_s += time.perf_counter() - t
        return mb, layer, tensor

    def _unpack(self, packed: tuple) -> torch.Tensor:
        mb, layer, tensor = packed
        if layer >= 0 and layer not in mb.first_unpack:
            mb.first_unpack[layer] = self.clock.mark()
        return tensor

    def _grad_ready_hook(self, mb: PassTokens, layer: int):
        def hook(grad_outputs):
            mb.grad_ready.setdefault(layer, self.clock.mark())
        return hook

    def _grad_accumulated(self, param: nn.Parameter) -> None:
        if (last := self.last_of_root.get(self.root_of.get(id(param), 0))) is not None:
            last.backward_end = self.clock.mark()

    def _backward_returned(self) -> None:
        """A backward call returned: it ended every micro-batch it reached whose end no gradient hook marked (FSDP2
        accumulates into unsharded parameters and hands the shards their gradients itself)."""
        self.backward_calls += 1
        reached = [mb for mb in self.pending if mb.grad_ready or mb.first_unpack]
        self.pending = [mb for mb in self.pending if not (mb.grad_ready or mb.first_unpack)]
        if any(mb.backward_end is None for mb in reached):
            mark = self.clock.mark()
            for mb in reached:
                mb.backward_end = mb.backward_end or mark

    def _backward_counted(self, param: nn.Parameter) -> None:
        mark = self.clock.mark()
        self.micro_batches.append(PassTokens(start=mark, forward_end=mark, backward_end=mark))


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the memory a saved tensor keeps alive."""
    try:
        s = tensor.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without plain storage (e.g. some subclasses)
        return id(tensor), tensor.numel() * tensor.element_size()


# -- from tokens to a profile's layers -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Summary:
    layers: list[Layer]  # forward order
    forward_s: float  # mean forward time of a micro-batch
    backward_s: float  # mean backward time of a micro-batch
    micro_batches: int


def summarize(profiler: LayerProfiler) -> Summary:
    """Layers in forward order, each quantity the mean over the recorded micro-batches. A layer whose module never
    ran (e.g. `nn.MultiheadAttention`'s `out_proj`, used through `F.linear`) is placed by `adopt_unseen`."""
    profiler.clock.finish()
    if profiler.compiled:
        return _untimed(profiler)
    complete = [mb for mb in profiler.micro_batches if mb.backward_end]
    per_mb = [resolve(mb, profiler.clock, len(profiler.layers)) for mb in complete]
    assert per_mb, "no complete micro-batch was recorded"
    ran = [[r for mb, r in zip(complete, per_mb) if i in mb.order] or per_mb for i in range(len(profiler.layers))]

    def mean(key: str, i: int | None = None) -> float:  # a layer's: over the micro-batches it ran in
        passes = per_mb if i is None else ran[i]
        return sum(getattr(r, key) if i is None else getattr(r, key)[i] for r in passes) / len(passes)

    layers = []
    first_order = list(dict.fromkeys(i for mb in complete for i in mb.order))  # several models: each one's layers
    order, params, timed_as = adopt_unseen(profiler.layers, first_order)
    for i in order:
        spec, t = profiler.layers[i], timed_as.get(i, i)
        layers.append(Layer(
            name=spec.name, type=type(spec.module).__name__, num_params=sum(p.numel() for p in params[i].values()),
            params={k: p.numel() * p.element_size() for k, p in params[i].items()},
            fp_s=measured(mean("fp", i)) if t == i else 0.0, bp_s=measured(mean("bp", i)) if t == i else 0.0,
            fp_dha_s=None, bp_dha_s=None, bp_grad_host_s=None, saved_bytes=round(mean("saved", i)),
            saved_storages_bytes=ran[i][-1].storages[i], fp_end_s=measured(mean("fp_end", t)),
            bp_start_s=measured(mean("bp_start", t))))
    return Summary(layers, mean("forward"), mean("backward"), len(per_mb))


def _untimed(profiler: LayerProfiler) -> Summary:
    """Every layer of a compiled model in registration order, with its parameters and nothing measured."""
    layers = [Layer(name=spec.name, type=type(spec.module).__name__,
                    num_params=sum(p.numel() for p in spec.params.values()),
                    params={k: p.numel() * p.element_size() for k, p in spec.params.items()},
                    fp_s=0.0, bp_s=0.0, fp_dha_s=None, bp_dha_s=None, bp_grad_host_s=None, saved_bytes=0,
                    saved_storages_bytes=[], fp_end_s=0.0, bp_start_s=0.0) for spec in profiler.layers]
    return Summary(layers, 0.0, 0.0, len(profiler.micro_batches))


@dataclass(frozen=True, slots=True)
class PassTimes:
    """One micro-batch in seconds from its forward start; per-layer quantities by layer index."""

    fp: dict[int, float]  # each layer's own forward time (nested layers subtracted)
    fp_end: dict[int, float]
    bp_start: dict[int, float]  # TierTrain's ts^B: its saved tensors must be back
    bp: dict[int, float]
    saved: dict[int, int]  # saved-activation bytes
    storages: dict[int, list[int]]  # saved storage sizes, largest first
    forward: float  # forward end
    backward: float  # backward duration


def resolve(mb: PassTokens, clock, n: int) -> PassTimes:
    """One micro-batch in seconds from its forward start."""
    sec = lambda token: clock.seconds(mb.start, token)  # noqa: E731
    fp = dict.fromkeys(range(n), 0.0)
    open_children: dict[int, float] = {}  # depth -> time spent by finished layers nested at that depth
    for i, start, end, depth in mb.intervals:  # in end order: children end before their parents
        duration = clock.seconds(start, end)
        fp[i] += duration - open_children.pop(depth + 1, 0.0)
        open_children[depth] = open_children.get(depth, 0.0) + duration
    end = sec(mb.backward_end)
    bp_start = {i: sec(mb.first_unpack.get(i, mb.grad_ready.get(i, mb.backward_end))) for i in range(n)}
    starts = sorted(set(bp_start.values()) | {end})
    following = {s: next((t for t in starts if t > s), end) for s in starts}
    return PassTimes(
        fp=fp, fp_end={i: sec(mb.fp_end[i]) if i in mb.fp_end else 0.0 for i in range(n)},
        bp_start=bp_start, bp={i: following[bp_start[i]] - bp_start[i] for i in range(n)},
        saved={i: mb.saved_bytes[i] + (mb.saved_bytes[-2] if i == (mb.order or [0])[0] else 0) for i in range(n)},
        storages=_storages(mb, n), forward=sec(mb.forward_end),
        backward=end - min(bp_start.values(), default=end))


def _storages(mb: PassTokens, n: int) -> dict[int, list[int]]:
    """Each layer's saved storage sizes, largest first; those saved before the first layer are the first's."""
    out: dict[int, list[int]] = {i: [] for i in range(n)}
    first = (mb.order or [0])[0]
    for storage, layer in mb.owner.items():
        out[first if layer == -2 else layer].append(mb.sizes[storage])
    return {i: sorted(sizes, reverse=True) for i, sizes in out.items()}
