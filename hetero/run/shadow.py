"""The shadow model (MemFerry §IV-C): every parameter's storage where its layer's plan `mode` says, switched at the
right moments so that the model's own code computes on it unchanged.

Storage per mode. Every placed parameter has a pinned host copy, the CPU model the optimizer writes (hetero.run.
states). `dha`: the data is a zero-copy device view of that host copy (hetero.kernels.dha). `gfgb`: the data is a device
buffer, refilled from the host copy every step on the copy stream. `dfgb`: the data is the host view for the forward;
a device buffer is filled after the layer's forward and the backward reads it. What autograd saved in the forward (a
Linear saves `weight.t()`) goes through the saved-tensor hooks (hetero.harness.saved_tensors): a view of a DFGB layer's
host view is saved as a record (layer, dtype, shape, strides, offset) and comes back as the same view of the device
copy (waiting for it), or of the host view where no copy was made. The parameters' `data` is rebound to the device
copy when the layer's backward starts (or its first saved view comes back), and back at the step boundary.

Copy stream and events (§IV-B, Fig. 6). After `optimizer.step()` the copy stream waits for the compute stream, then
copies the GFGB layers in forward order, each followed by its own event that only that layer's forward waits for. At
the end of the model's forward the DFGB layers are copied in backward order, each after an event marking its
forward's end, and the layer's backward waits for its copy. Later micro-batches of a step keep the device copy.

The step boundary. Before the step the compute stream waits for the copy stream; the host waits for neither, since
each update waits for its gradients' ready event, which follows every kernel reading the layer's host copy
(hetero.run.states). Where updates overlap backward, step() writes host copies on its thread, so the host waits for
the copy stream first. In `step()` every placed parameter (and host gradient, hetero.run.grad_offload) is a device
view of pinned host memory, where the optimizer finds its host bytes (`Device.host_view`). A parameter never changes
device: `p.data = x` across devices resets its gradient accumulator, where DDP's reducer hooks live. After the step
the GFGB parameters point at their device buffers again and their copies are issued; nothing synchronizes the device
inside a step. Until the next forward GFGB weights are in flight: `state_dict()` waits for them, other readers must
synchronize first.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hetero.errors import INVALID_FILE, HeteroError
from hetero.harness import hooks
from hetero.harness.capture import calling
from hetero.harness.layers import before_backward
from hetero.harness.saved_tensors import SHADOW, chain
from hetero.kernels import dha
from hetero.kernels.dha import Device, carve, offsets
from hetero.run.grad_offload import HostGrads
from hetero.run.mechanism import Mechanism
from hetero.run.shadow_layout import LayerStorage, schedule
from hetero.run.torch_optim import ids, updates_any
from hetero.schema.plan import LayerMode, LayerPlan, Plan
from hetero.schema.profile import ROOT_LAYER
from hetero.units import SIZE


@dataclass(frozen=True, slots=True)
class ShadowConfig:
    """The plan's `layers` section, and where the optimizer updates the weights they place."""

    layers: list[LayerPlan]
    updated_on: str  # the optimizer section's device; `gpu` also for the script's own optimizer
    overlap: bool = False  # its updates overlap backward

    @classmethod
    def of(cls, plan: Plan) -> ShadowConfig | None:
        """None: the plan has no layers section."""
        if not plan.layers:
            return None
        opt = plan.optimizer
        return cls(plan.layers, opt.device if opt is not None else "gpu", opt is not None and opt.overlap_backward)


def shadow_model(config: ShadowConfig) -> ShadowModel | None:
    """The mechanism for the plan's `layers` section: none when every layer stays on the GPU (gfgb, grad gpu)
    under an optimizer that updates there."""
    if config.updated_on == "gpu":
        moved = [e for e in config.layers if not e.runs_plain()]
        if not moved:
            return None
        dha.devices.check()  # the refusal below is for a GPU machine; elsewhere, that there is none comes first
        raise HeteroError(f"layer {moved[0].name} is `mode: {moved[0].mode}, grad: {moved[0].grad}`, but the optimizer "
                          "updates on the GPU: DHA and host gradients need the master weights in host memory",
                          hint="set every layer to `mode: gfgb, grad: gpu`, or plan with --optimizer-device host",
                          exit_code=INVALID_FILE)
    dha.devices.check()  # a plan with layers needs a GPU; which one is known when the model is bound
    return ShadowModel(config.layers, config.overlap)


# -- the mechanism ------------------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class LayerState:
    """One layer's storages: flat bytes, each parameter a view at its offset (the paper's long parameter vector,
    per layer: one copy per layer, and one storage per layer to switch)."""

    spec: LayerStorage
    params: list[nn.Parameter]
    offsets: list[int]
    host: torch.Tensor  # pinned: the CPU model the optimizer writes
    alias: torch.Tensor  # device view of `host`: what dha and dfgb compute on, and every mode's data in step()
    gpu: torch.Tensor | None  # device buffer (gfgb, dfgb)
    ready: Any  # event: the layer's latest copy is done
    forward_end: Any  # event: its forward ended (dfgb)
    copied: bool = False  # dfgb: copied this step
    on_gpu: bool = False  # dfgb: the parameters point at the device copy

    def compute(self) -> torch.Tensor:
        return self.gpu if self.spec.mode == LayerMode.GFGB else self.alias

    def point(self, flat: torch.Tensor) -> None:
        for p, offset in zip(self.params, self.offsets):
            p.data = carve(flat, offset, p)


@dataclass(eq=False, slots=True)
class ParamView:
    """What autograd keeps of a saved view of a DFGB layer's parameters (see the module's docstring)."""

    layer: LayerState
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # in elements of `dtype`, from the start of the layer's flat storage


def place(device: Device, spec: LayerStorage, params: list[nn.Parameter]) -> LayerState:
    """Move a layer's parameters to their storages (once, at bind: synchronous)."""
    where, total = offsets([p.numel() * p.element_size() for p in params])
    host = device.pinned(total)
    with torch.no_grad():
        for p, offset in zip(params, where):
            carve(host, offset, p).copy_(p.detach())
        gpu = device.buffer(total) if spec.mode != LayerMode.DHA else None
        if gpu is not None:
            gpu.copy_(host)
    st = LayerState(spec, params, where, host, device.alias(host), gpu,
                    device.event(f"ready {spec.name}"), device.event(f"forward {spec.name}"))
    st.point(st.compute())
    return st


class ShadowModel(Mechanism):
    """The plan's `layers` section, carried out on a device (the GPU, or the CPU stand-in in tests)."""

    def __init__(self, layers: list[LayerPlan], overlap: bool = False):
        self.entries = layers
        self.overlap = overlap  # the updates overlap backward: step() writes host copies on its thread
        self.device: Device | None = None  # the model's own GPU, opened at bind
        self.layers: list[LayerState] = []
        self.grads: HostGrads | None = None
        self.pending: list[LayerState] = []  # DFGB layers whose forward ran and whose copy is not issued yet
        self.copied = self.boundary = None  # events: after the last copy issued; the step boundary
        self.ids: set[int] = set()
        self.views: dict[int, LayerState] = {}  # DFGB layers by the address of their host view's storage
        self.handles: list = []

    def install(self, patches, need_model) -> None:
        self.handles += [register_optimizer_step_pre_hook(self._before_step),
                         register_optimizer_step_post_hook(self._after_step)]

    def bind(self, model: nn.Module) -> None:
        if self.layers:
            return
        modules, params = dict(model.named_modules()), dict(model.named_parameters())
        sched = schedule(self.entries, list(modules), list(params))
        # Here, not when the runtime was made: a torchrun worker picks its GPU (set_device, model.to) in between.
        self.device = dha.devices.for_model(model)
        self.copied, self.boundary = self.device.event("copies"), self.device.event("step")
        for spec in sched.layers:
            st = place(self.device, spec, [params[n] for n in spec.params])
            self.layers.append(st)
            self._hook(modules["" if spec.name == ROOT_LAYER else spec.name], st)
        self.ids = ids(p for st in self.layers for p in st.params)
        if sched.host_grads():
            self.grads = HostGrads(self.device, [(n, params[n]) for n in sched.host_grads()], model)
        self.handles += [hooks.forward(model, self._forward_done, always_call=True),
                         hooks.state_dict_pre(model, self._settle)]
        self.views = {st.alias.data_ptr(): st for st in self.layers
                      if st.spec.mode == LayerMode.DFGB and st.alias.numel()}
        if self.views:
            chain.join(self, SHADOW)
            self.handles.append(hooks.forward_pre(model, self._forward_start, prepend=True))
            if calling(model):  # bound at the model's first forward, whose pre-hooks have already run
                self._forward_start(model, ())

    def _hook(self, module: nn.Module, st: LayerState) -> None:
        if st.spec.mode == LayerMode.GFGB:
            self.handles.append(hooks.forward_pre(module, partial(self._await_copy, st)))
        elif st.spec.mode == LayerMode.DFGB:
            self.handles.append(hooks.forward(module, partial(self._layer_done, st)))

    # -- inside a step ------------------------------------------------------------------------------------------

    def _forward_start(self, model, args) -> None:
        if torch.is_grad_enabled():
            chain.open(self)

    def _await_copy(self, st: LayerState, module, args) -> None:
        self.device.compute_waits(st.ready)  # evaluation forwards too: the buffer may be in flight

    def _layer_done(self, st: LayerState, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        if not st.copied and st not in self.pending:
            self.device.record_compute(st.forward_end)
            self.pending.append(st)
        before_backward(output, partial(self._before_backward, st))

    def _forward_done(self, model, args, output) -> None:
        """The model's forward ended: copy the DFGB layers for their backward, latest forward first."""
        chain.close(self)
        for st in reversed(self.pending):
            self.device.copy_waits(st.forward_end)
            self.device.copy(st.gpu, st.host)
            self.device.record_copy(st.ready)
            st.copied = True
        if self.pending:
            self.device.record_copy(self.copied)
        self.pending.clear()

    def _before_backward(self, st: LayerState, grad_outputs) -> None:
        """The layer's backward starts (on the stream its nodes run on): wait for its copy, then compute on it."""
        if st.copied and not st.on_gpu:
            self.device.compute_waits(st.ready)
            st.point(st.gpu)
            st.on_gpu = True

    # -- saved views of DFGB parameters (hetero.harness.saved_tensors) --------------------------------------------

    def pack(self, tensor: torch.Tensor) -> ParamView | None:
        if tensor.layout != torch.strided or not (type(tensor) is torch.Tensor or isinstance(tensor, nn.Parameter)):
            return None
        st = self.views.get(tensor.untyped_storage().data_ptr())
        if st is None or tensor.device != st.alias.device:
            return None
        return ParamView(st, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(self, view: ParamView) -> torch.Tensor:
        """The view, of the device copy once it is there (a tied weight's user may come back before the layer's
        backward starts), else of the host view."""
        st = view.layer
        self._before_backward(st, None)
        flat = st.gpu if st.on_gpu else st.alias
        out = torch.empty(0, dtype=view.dtype, device=flat.device)
        return out.set_(flat.untyped_storage(), view.offset, view.size, view.stride)

    # -- the step boundary ----------------------------------------------------------------------------------------

    def _ours(self, optimizer) -> bool:
        return bool(self.layers) and updates_any(optimizer, self.ids)

    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self._ours(optimizer):
            return
        # The copies reading host copies come before any event recorded in step(); overlapped updates write host
        # copies with no such event before them, so the host waits for the copies first (the module's docstring).
        if self.overlap:
            self._settle()
        else:
            self.device.compute_waits(self.copied)
        for st in self.layers:
            if st.on_gpu or st.spec.mode == LayerMode.GFGB:
                st.point(st.alias)
            st.copied = st.on_gpu = False

    def _after_step(self, optimizer, args, kwargs) -> None:
        if not self._ours(optimizer):
            return
        self.device.record_compute(self.boundary)
        self.device.copy_waits(self.boundary)  # the last step's kernels are done with the device buffers
        for st in self.layers:
            if st.spec.mode == LayerMode.GFGB:
                st.point(st.gpu)
                self.device.copy(st.gpu, st.host)
                self.device.record_copy(st.ready)
        self.device.record_copy(self.copied)

    def _settle(self, *args) -> None:
        """The copies issued so far (which read the host copies and write the device buffers) are done."""
        self.device.synchronize(self.copied)

    def close(self) -> None:
        self.handles = hooks.removed(self.handles)
        chain.close(self)
        chain.leave(self)
        if self.layers:  # the host may write host memory then: no kernel reads or writes it, no copy reads it
            self.device.record_compute(self.boundary)
            self.device.synchronize(self.boundary)
            self.device.synchronize(self.copied)
            for st in self.layers:
                if st.on_gpu:
                    st.point(st.alias)
                    st.on_gpu = False
        if self.grads is not None:
            self.grads.close()

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        host = sum(st.host.nbytes for st in self.layers) + (self.grads.host.nbytes if self.grads else 0)
        gpu = sum(st.gpu.nbytes for st in self.layers if st.gpu is not None)
        return {"host": {"parameters (pinned)": host}, "gpu": {"parameters": gpu}} if self.layers else {}

    def summary(self) -> list[str]:
        if not self.layers:
            return []
        order = (LayerMode.DHA, LayerMode.GFGB, LayerMode.DFGB)
        by_mode = {m: [st for st in self.layers if st.spec.mode == m] for m in order}
        size = lambda states: SIZE.format_short(sum(p.numel() * p.element_size()  # noqa: E731
                                                    for st in states for p in st.params))
        lines = [f"shadow model on {self.device.kind}: " + ", ".join(
            f"{len(v)} {m.upper()} layer{'s' * (len(v) != 1)} ({size(v)})" for m, v in by_mode.items() if v)]
        return lines + (self.grads.summary() if self.grads is not None else [])
