"""What Direct Host Access costs on this machine, for the planner: the link's DHA read and write bandwidth, and per
layer MemFerry's T_FP^H and T_BP^H (parameters in pinned host memory) and GO-MemFerry's T_GBP (gradients written
to host memory).

After the script stopped, the model's last training call is replayed once to record every layer's inputs, and each
layer runs alone through the runtime's own code in each mode. Each DHA time is the profiler's own T_FP or T_BP plus
the slowdown measured here, so nested layers cancel out.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hetero.harness import hooks
from hetero.harness.layer_timing import CpuClock, CudaClock
from hetero.harness.layers import LayerSpec, select_layers, tensors
from hetero.kernels.dha import CudaDevice, Device, carve, map_host, offsets, pinned_host
from hetero.profile.instruments import Instrument
from hetero.run.grad_offload import HostGrads
from hetero.schema.profile import Layer
from hetero.units import measured

MiB = 2**20
REPEATS = 5
NOT_REPLAYED = "the layer could not be run alone with the inputs recorded from a replayed forward"
FIELDS = ("fp_dha", "bp_dha", "bp_grad_host")


def bandwidth(device: torch.device, nbytes: int = 256 * MiB, repeats: int = REPEATS) -> tuple[float, float]:
    """Bytes/s of a kernel reading pinned host memory through a DHA view into GPU memory, and writing it back."""
    host = pinned_host(nbytes)
    host.view(torch.float32).copy_(torch.rand(nbytes // 4))
    view = map_host(host, device).view(torch.float32)
    dev = torch.empty(nbytes // 4, device=device)
    read = cuda_median_s(lambda: torch.neg(view, out=dev), repeats)
    write = cuda_median_s(lambda: torch.neg(dev, out=view), repeats)
    return nbytes / read, nbytes / write


def cuda_median_s(fn, repeats: int) -> float:
    """Median seconds of `fn`'s GPU work on the current stream over `repeats` runs, after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class RootInputs(Instrument):
    """The model's latest training call, kept to replay one forward once the script has stopped."""

    def __init__(self, model: nn.Module):
        self.call: tuple[tuple, dict] | None = None
        self.handle = hooks.forward_pre(model, self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs) -> None:
        if torch.is_grad_enabled():
            self.call = (args, kwargs)

    def close(self) -> None:
        self.handle.remove()


def measure_layers(model: nn.Module, inputs: RootInputs, layers: list[Layer], granularity: str,
                   device: Device | None = None, clock: CpuClock | CudaClock | None = None) -> list[Layer]:
    """`layers` with their DHA fields measured; a layer that cannot be run alone keeps them null."""
    inputs.close()
    if inputs.call is None:
        return layers
    device = device or CudaDevice()
    clock = clock or CudaClock()
    model.zero_grad(set_to_none=True)  # the script's last gradients would only take memory
    specs = {s.name: s for s in select_layers(model, granularity)}
    calls = _layer_inputs(model, inputs.call, specs)
    out = []
    for layer in layers:
        if not layer.params_bytes:  # nothing of its own to read from host memory or to write a gradient for
            out.append(replace(layer, fp_dha_s=layer.fp_s, bp_dha_s=layer.bp_s, bp_grad_host_s=layer.bp_s))
            continue
        spec, call = specs.get(layer.name), calls.get(layer.name)
        times = _times(spec, call, device, clock) if spec is not None and call is not None and spec.params else None
        out.append(layer if times is None else replace(
            layer, fp_dha_s=measured(layer.fp_s + times["fp_dha"]), bp_dha_s=measured(layer.bp_s + times["bp_dha"]),
            bp_grad_host_s=measured(layer.bp_s + times["bp_grad_host"])))
    return out


def unmeasured(layers: list[Layer]) -> dict[str, str]:
    """Why a layer's DHA fields are null, by path."""
    return {f"layers.{x.name}.{f}": NOT_REPLAYED for x in layers if x.fp_dha_s is None for f in FIELDS}


def _layer_inputs(model: nn.Module, call: tuple[tuple, dict], specs: dict[str, LayerSpec]) -> dict[str, tuple]:
    """Each layer's first call in one replayed forward: its arguments as leaves, requiring grad as they did."""
    seen: dict[str, tuple] = {}

    def record(name: str, module, args, kwargs) -> None:
        if name not in seen:
            seen[name] = (_leaves(args), _leaves(kwargs))

    handles = [s.module.register_forward_pre_hook(lambda m, a, k, n=name: record(n, m, a, k), with_kwargs=True)
               for name, s in specs.items()]
    try:
        with contextlib.suppress(Exception):  # a model that cannot be replayed keeps null DHA fields
            model(*call[0], **call[1])
    finally:
        hooks.removed(handles)
    return seen


def _leaves(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        return leaf.requires_grad_() if value.requires_grad and leaf.is_floating_point() else leaf
    if isinstance(value, (tuple, list)):
        return type(value)(_leaves(v) for v in value)
    if isinstance(value, dict):
        return {k: _leaves(v) for k, v in value.items()}
    return value


def _times(spec: LayerSpec, call: tuple, device: Device, clock) -> dict[str, float] | None:
    """Slowdowns of the layer with its parameters read from host memory, and with its gradients written there."""
    params = list(spec.params.values())
    try:
        f_gpu, b_gpu = _run(spec.module, call, params, clock)
        with _on_host(device, params):
            f_dha, b_dha = _run(spec.module, call, params, clock)
        grads = HostGrads(device, list(spec.params.items()), spec.module)
        try:
            _, b_host = _run(spec.module, call, params, clock)
        finally:
            grads.close()
    except Exception:  # e.g. a forward that needs state only the whole model sets up
        return None
    return {"fp_dha": max(0.0, f_dha - f_gpu), "bp_dha": max(0.0, b_dha - b_gpu),
            "bp_grad_host": max(0.0, b_host - b_gpu)}


def _run(module: nn.Module, call: tuple, params: list[nn.Parameter], clock, repeats: int = REPEATS
         ) -> tuple[float, float]:
    """Median forward and backward time of the layer alone; the first run warms up."""
    args, kwargs = call
    leaves = [t for t in tensors([args, kwargs]) if t.requires_grad]
    marks = []
    for _ in range(repeats + 1):
        for t in leaves + params:
            t.grad = None
        start = clock.mark()
        out = [t for t in tensors(module(*args, **kwargs)) if t.requires_grad]
        mid = clock.mark()
        if out:
            torch.autograd.backward(out, [torch.randn_like(t) for t in out])
        marks.append((start, mid, clock.mark()))
    clock.finish()
    forward = statistics.median(clock.seconds(s, m) for s, m, _ in marks[1:])
    backward = statistics.median(clock.seconds(m, e) for _, m, e in marks[1:])
    for t in leaves + params:
        t.grad = None
    return forward, backward


@contextlib.contextmanager
def _on_host(device: Device, params: list[nn.Parameter]) -> Iterator[None]:
    """The parameters as DHA views of a pinned copy for the duration; their own storage afterwards."""
    where, total = offsets([p.numel() * p.element_size() for p in params])
    host = device.pinned(total)
    originals = [p.data for p in params]
    with torch.no_grad():
        for p, offset in zip(params, where):
            carve(host, offset, p).copy_(p.detach())
    alias = device.alias(host)
    try:
        for p, offset in zip(params, where):
            p.data = carve(alias, offset, p)
        yield
    finally:
        for p, original in zip(params, originals):
            p.data = original
