"""Activation tiering: the plan's `activations` schedule carried out with saved-tensor hooks (TierTrain §5-6).

Attribution is the profiler's (hetero.harness.layer_timing), so a planned byte means the same here: every tensor
autograd saves inside the model's forward (parameters and their views excluded, each storage once) belongs to the
innermost layer running, or to the last layer that ended inside it since it started, or between layers to the last
one that ended; a storage saved by several layers belongs to the last, whose backward needs it first.

Eviction (§5.1): when a layer's forward ends, its saved storages are queued for the slow tier up to the planned bytes,
largest first, the last one cut to the bytes left (the tail stays in fast memory); storages saved after their layer
ended are queued at once. Parameters' storages never move, and storages under `min_tensor` are left to autograd
unrecorded. One writer thread writes evictions in queue order (a layer's still queued when its backward starts is
called off) and drops the fast-tier copy once a write completes (on a GPU the slow tier keeps the storage until a
query finds the download done: hetero.run.devices.host_pool).

Prefetch follows backward progress: a layer's backward starts at the first unpack of its saved tensors (or when its
output's gradient is ready), and the layers the plan triggers from it are queued then. Untriggered entries are due at
their planned time from the forward start, once their layer's saved storages are all known, and all at the latest
when backward starts, the latest layer first; within a layer the last saved storage comes back first. One reader
thread serves requests in order. An unpack whose bytes are not back waits for them (fetching them itself if nobody
started) and counts a late prefetch; a failed read raises.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from time import perf_counter

import torch
from torch import nn

from hetero.errors import STALE_PLAN, HeteroError
from hetero.harness import hooks, watch
from hetero.harness.capture import calling
from hetero.harness.layers import LayerSpec, before_backward, layers_named, sharded, storages
from hetero.harness.models import roots
from hetero.harness.saved_tensors import TIERING, chain
from hetero.harness.script import StopScript
from hetero.run.devices.evictions import RESIDENT, Group, Mover, Record, Saved, TieredPass
from hetero.run.devices.residency import Ledger
from hetero.run.devices.slow_tier import model_gpu, open_tier
from hetero.run.mechanism import Mechanism
from hetero.schema.plan import ActivationPlan
from hetero.units import relative_change, short_size, short_time

ACTIVATIONS = "saved activations"  # what the tiers' bytes are, in the run's memory counters


class ActivationTiering(Mechanism):
    """The plan's `activations` section, as a runtime mechanism."""

    def __init__(self, plan: ActivationPlan):
        self.plan = plan
        self.budget = {e.layer: e.evict_bytes for e in plan.schedule if e.evict_bytes > 0}
        self.after: dict[str, list[str]] = defaultdict(list)  # trigger layer -> layers to prefetch
        for e in plan.schedule:
            if e.evict_bytes > 0 and e.prefetch_after is not None:
                self.after[e.prefetch_after].append(e.layer)
        # Earliest first; of prefetches due at once, the latest layer first: backward needs it first.
        order = {e.layer: i for i, e in enumerate(plan.schedule)}
        self.timed = [(at, layer) for at, _, layer in sorted((e.prefetch_at_s, -order[e.layer], e.layer)
                                                              for e in plan.schedule
                                                              if e.evict_bytes > 0 and e.prefetch_after is None)]
        self.ledger = Ledger(plan.fast, plan.slow)
        self.lock = self.ledger.lock
        self.model: nn.Module | None = None
        self.mover: Mover | None = None
        self.device: torch.device | None = None  # the fast tier's: tensors elsewhere stay where they are
        self.note: str | None = None
        self.handles: list = []
        self.names: dict[int, str] = {}
        self.current: TieredPass | None = None  # the micro-batch whose forward is running
        self.root: nn.Module | None = None  # the module whose call it is (one of several models')
        self.last: TieredPass | None = None  # the last one whose forward ended
        self.stack: list[str] = []  # the layers running, outermost first
        self.inner: list[str | None] = []  # for each, the last layer that ended inside it since it started
        self.last_ended: str | None = None
        self.param_storages: set[int] = set()
        self.sharded = False  # FSDP2: the parameters' storages are read again at each layer's start
        self.unpack_listeners: list[Callable[[str], None]] = []  # told each layer whose saved tensor is read back

    def bind(self, model: nn.Module) -> None:
        layers = self._layers(model)
        self.model, self.sharded = model, sharded(model)
        tier, self.note = open_tier(self.plan, model_gpu(self.plan, model))
        self.mover, self.device = Mover(tier, self.ledger), tier.device
        for spec in layers:
            self.names[id(spec.module)] = spec.name
            self.handles += [hooks.forward_pre(spec.module, self._layer_start),
                             hooks.forward(spec.module, self._layer_end, always_call=True)]
        # Each model's hooks go around its layers' (a root may be a layer itself): pre-hook first, post-hook last.
        for root in roots(model):
            self.handles += [hooks.forward_pre(root, self._forward_start, prepend=True),
                             hooks.forward(root, self._forward_end, always_call=True)]
        # a step's end: the optimizer may allocate next, so evicted storages whose copies are done go first
        self.handles.append(watch.backward_calls(self.mover.tier.reclaim))
        chain.join(self, TIERING)
        for root in roots(model):
            if calling(root):  # bound at the model's first forward, whose pre-hooks have already run
                self._forward_start(root, ())
                if id(root) in self.names:
                    self._layer_start(root, ())

    def close(self) -> None:
        self.current = None  # the script may have ended inside the model's forward
        chain.close(self)
        chain.leave(self)
        self.handles = hooks.removed(self.handles)
        if self.mover is not None:
            self.mover.close()

    def summary(self) -> list[str]:
        r = self.ledger.report()
        if r.span_s <= 0:
            return []
        where = f"{self.plan.fast} saved activations"
        lines = [f"{where}: average {short_size(r.avg_saved)} -> {short_size(r.avg_fast)} "
                 f"({relative_change(r.avg_fast, r.avg_saved)}), peak {short_size(r.peak_saved)} -> "
                 f"{short_size(r.peak_fast)} ({relative_change(r.peak_fast, r.peak_saved)}) with tiering",
                 f"{r.evictions} evictions to {self.plan.slow} ({short_size(sum(r.evicted.values()))}), "
                 f"{r.late} late prefetch{'' if r.late == 1 else 'es'} (waited {short_time(r.waited_s)})"]
        return lines + ([self.note] if self.note else [])

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        with self.lock:
            fast, slow, _ = self.ledger.now
        return {self.plan.fast: {ACTIVATIONS: fast}, self.plan.slow: {ACTIVATIONS: slow}}

    def on_unpack(self, listener: Callable[[str], None]) -> None:
        """`listener(layer)` is called at each read of a saved tensor of `layer` (its backward has started)."""
        self.unpack_listeners.append(listener)

    def _layers(self, model: nn.Module) -> list[LayerSpec]:
        """The profile's layers: the granularity under which every layer the schedule names exists."""
        wanted = {e.layer for e in self.plan.schedule} | {e.prefetch_after for e in self.plan.schedule
                                                          if e.prefetch_after is not None}
        layers, missing = layers_named(model, wanted)
        if missing:
            raise HeteroError(f"the plan's activation schedule names {len(missing)} layer(s) the model does not "
                              f"have, e.g. {missing[0]}", hint="profile and plan again for this model",
                              exit_code=STALE_PLAN)
        return layers

    def _forward_start(self, module, args) -> None:
        if self.current is not None or not torch.is_grad_enabled():
            return  # evaluation forwards save nothing
        self.param_storages = storages(self.model.parameters())
        self.current = TieredPass(start=perf_counter(), timed=list(self.timed))
        self.root = module
        self.stack, self.inner, self.last_ended = [], [], None
        chain.open(self)

    def _forward_end(self, module, args, output) -> None:
        mb = self.current
        if mb is None or module is not self.root:
            return
        chain.close(self)
        self.current, self.last = None, mb
        self._due(mb)
        self._raise_failure()

    def _layer_start(self, module, args) -> None:
        if (mb := self.current) is None:
            return
        name = self.names[id(module)]
        self.stack.append(name)
        self.inner.append(None)
        if self.sharded:  # FSDP2 has just unsharded the layer's parameters into storages of their own
            self.param_storages |= storages(module.parameters(recurse=False))
        for record in mb.pending:
            self._own(mb, record, name)
        mb.pending.clear()
        self._due(mb)

    def _layer_end(self, module, args, output) -> None:
        mb = self.current
        if mb is None or not self.stack:
            return
        name = self.stack.pop()
        self.inner.pop()
        self.last_ended = name
        if self.inner:
            self.inner[-1] = name
        # made here if the layer saved nothing movable itself: what it saves after its end (the output of a ReLU
        # called in its parent's forward) then leaves at once
        group = self._group(mb, name)
        group.ended = True
        self._evict(group, group.live())
        if name in self.after and output is not None:
            before_backward(output, lambda grads, mb=mb, name=name: self._started(mb, name))
        self._due(mb)
        self._raise_failure()

    def _saving(self) -> str | None:
        """The layer a tensor saved now belongs to, by the profiler's rule (the module's docstring)."""
        return (self.inner[-1] or self.stack[-1]) if self.stack else self.last_ended

    def _raise_failure(self) -> None:
        if self.mover.failure is not None:
            e, self.mover.failure = self.mover.failure, None
            if not isinstance(e, HeteroError):
                e = HeteroError(f"moving activations to {self.plan.slow} failed: {e}",
                                hint="check the slow tier's directory and free space")
            raise StopScript(e)

    # -- saved tensors (hetero.harness.saved_tensors) ----------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Saved | None:
        mb = self.current
        if mb is None or type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return None  # parameters (nn.Parameter) and tensor subclasses stay where they are
        storage = tensor.untyped_storage()
        if storage.nbytes() < self.plan.min_tensor_bytes:
            return None  # never moves: not worth a record (autograd keeps it as it would)
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.param_storages:
            return None
        record = self._record(mb, storage, ptr, self._saving())
        keep = None if record.movable else tensor.detach()  # not the tensor itself: an output would hold its grad_fn
        return Saved(record, keep, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _record(self, mb: TieredPass, storage: torch.UntypedStorage, ptr: int, layer: str | None) -> Record:
        ref = mb.storages.get(ptr)
        record = ref() if ref is not None else None
        if record is not None and record.alias.expired():
            record = None  # that storage died and its address was reused
        if record is None:
            movable = storage.nbytes() >= self.plan.min_tensor_bytes and storage.device == self.device
            record = Record(self.mover, storage, movable)
            mb.storages[ptr] = weakref.ref(record)
        elif record.group is not None and record.group.layer == layer:
            return record
        if layer is None:
            mb.pending.append(record)
        else:
            self._own(mb, record, layer)
        return record

    def _own(self, mb: TieredPass, record: Record, layer: str) -> None:
        """`layer` saved the record last: it owns it now, and its schedule decides whether the bytes move."""
        if (old := record.group) is not None:
            del old.records[id(record)]
            old.committed -= record.evict_bytes if record.state != RESIDENT else 0
        group = self._group(mb, layer)
        group.records[id(record)] = weakref.ref(record)
        record.group = group
        if record.state == RESIDENT:
            if group.ended and layer not in self.stack:
                self._evict(group, [record])  # saved after its layer ended: leaves now
        elif group.committed + record.evict_bytes <= group.budget and not group.requested:
            group.committed += record.evict_bytes
        else:
            self.mover.recall(record)  # evicted for a layer that no longer owns it, and its new owner keeps it

    def _group(self, mb: TieredPass, layer: str) -> Group:
        if layer not in mb.groups:
            mb.groups[layer] = Group(layer, mb, self.budget.get(layer, 0))
        return mb.groups[layer]

    def _evict(self, group: Group, records: list[Record]) -> None:
        """Queue the planned bytes: whole storages, largest first, then part of the next one (the planner times
        these transfers one by one: hetero.plan.model.chunks)."""
        left = group.budget - group.committed
        if group.requested or left <= 0:
            return
        chosen = []
        for r in sorted((r for r in records if r.movable and r.state == RESIDENT), key=lambda r: -r.nbytes):
            if left <= 0:
                break
            chosen.append((r, min(r.nbytes, left)))
            left -= chosen[-1][1]
        if chosen:
            group.committed += sum(nbytes for _, nbytes in chosen)
            self.mover.evict(chosen, group.layer)

    def unpack(self, saved: Saved) -> torch.Tensor:
        record = saved.record
        if record.group is not None:
            self._started(record.group.mb, record.group.layer)
            for listener in self.unpack_listeners:
                listener(record.group.layer)
        if saved.tensor is not None:
            return saved.tensor
        data = self.mover.data(record)  # uint8, where the storage's bytes are (it may start inside a larger buffer)
        out = torch.empty(0, dtype=saved.dtype, device=data.device)
        start = data.storage_offset() // out.element_size()  # buffers start aligned for every dtype
        return out.set_(data.untyped_storage(), start + saved.offset, saved.size, saved.stride)

    # -- backward progress and prefetch ---------------------------------------------------------------------

    def _started(self, mb: TieredPass, layer: str) -> None:
        """`layer`'s backward has started: queue the prefetches the plan keyed to it (and, at the first one of
        the micro-batch, every prefetch still waiting for its time)."""
        if mb.backward and layer in mb.started:
            return
        with self.lock:
            if not mb.backward:
                mb.backward = True
                for _, target in mb.timed:
                    self._request(mb, target)
                mb.timed.clear()
            if layer in mb.started:
                return
            mb.started.add(layer)
            for target in self.after.get(layer, ()):
                self._request(mb, target)

    def _due(self, mb: TieredPass) -> None:
        """Time-keyed prefetches whose time has come, for layers whose saved storages are all known: its forward
        ended and a tensor saved now would not be its (`_saving`). What the layer saved was queued first, as planned,
        and is called off if still unwritten."""
        now = perf_counter() - mb.start
        if not mb.timed or mb.timed[0][0] > now:
            return
        saving = self._saving() if mb is self.current else None  # may still save: its storages are not all known
        with self.lock:
            waiting = []
            for at, target in mb.timed:
                group = mb.groups.get(target)
                if at <= now and group is not None and group.ended and target not in self.stack and target != saving:
                    self._request(mb, target)
                else:
                    waiting.append((at, target))
            mb.timed = waiting

    def _request(self, mb: TieredPass, layer: str) -> None:
        group = self._group(mb, layer)
        if not group.requested:
            group.requested = True
            if group.committed:
                self.mover.prefetch(reversed(group.records.values()))  # backward's order: the last saved first
