"""The plan's `routing` section: COARSE's tensor routing, partitioning and dual synchronization (§III-E/F) as a DDP
communication hook, registered on the script's own `DistributedDataParallel` model without touching the script.

Paths. Each path is a process group over all ranks with its own communicator, created with the default group's
backend when the DDP model is built:
  - priority: the first layers' gradients (dual synchronization, below), ranks in natural order;
  - latency: tensors up to `threshold_bytes`, packed into messages of at most that size, ring 0 -> latency_peer -> ...;
  - bandwidth: the other tensors, cut into `shard_bytes` shards all in flight at once, ring 0 -> bandwidth_peer -> ....
A group lists rank 0 then its peer (`new_group(sort_ranks=False)`), so rank 0's ring traffic on that path crosses its
link to that peer, the one the profile measured best for the size class (NCCL builds its rings from the topology, so
there the peers only name the links). A communicator per path keeps small tensors from waiting behind shards.

Dual synchronization. The parameters the first forward uses first, up to `dual_sync_bytes` (the tensor that crosses
the limit included), go on the priority path, issued before anything else in their bucket.

Averaging. Every message is an in-place sum of a slice of DDP's bucket (or a packed copy of small slices, copied
back), the bucket divided by the world size first as torch's `allreduce_hook` does: DDP's own average, the same bits
on every rank.

No deadlock. DDP hands the hook buckets in the same order with the same contents on every rank, `messages` is a pure
function of a bucket's layout, and the groups are made in the same order on every rank right after DDP's constructor;
so every rank issues the same collectives in the same order on each path, each group a FIFO matched by issue order,
and nothing in the hook waits for another path (COARSE's deadlock came from proxies serving in arrival order).
"""

from __future__ import annotations

import inspect
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hetero.errors import STALE_PLAN, HeteroError
from hetero.harness import hooks
from hetero.harness.capture import fingerprint, unwrap
from hetero.harness.layer_timing import CpuClock, CudaClock
from hetero.harness.script import StopScript
from hetero.run.ddp_sync import DdpSync
from hetero.run.mechanism import Mechanism, NeedModel
from hetero.run.spans import span as record_span
from hetero.schema.plan import Predicted, RoutingPlan
from hetero.units import SIZE, TIME

PRIORITY, LATENCY, BANDWIDTH = "priority", "latency", "bandwidth"
DRIFT = 2.0  # warn when measured sync time is this factor above or below the prediction

Range = tuple[int, int]  # [start, end) in elements of a bucket's flat buffer


@dataclass(frozen=True, slots=True)
class Message:
    """One collective: a path and the slices of the bucket it sums (several: packed into one tensor)."""

    path: str
    pieces: tuple[Range, ...]

    @property
    def numel(self) -> int:
        return sum(e - s for s, e in self.pieces)


def messages(tensors: list[tuple[int, int, bool]], element_size: int, threshold_bytes: int,
             shard_bytes: int) -> list[Message]:
    """The collectives for one bucket, in issue order. `tensors`: (start, numel, first-layer) per gradient."""
    shard = max(1, shard_bytes // element_size)
    first = _merge([(s, s + n) for s, n, prio in tensors if prio])
    rest = [(s, n) for s, n, prio in tensors if not prio]
    small = _merge([(s, s + n) for s, n in rest if n * element_size <= threshold_bytes])
    large = _merge([(s, s + n) for s, n in rest if n * element_size > threshold_bytes])
    return ([Message(PRIORITY, (r,)) for r in _shards(first, shard)]
            + [Message(LATENCY, pack) for pack in _packs(small, max(1, threshold_bytes // element_size))]
            + [Message(BANDWIDTH, (r,)) for r in _shards(large, shard)])


def _merge(ranges: list[Range]) -> list[Range]:
    out: list[Range] = []
    for s, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _shards(ranges: list[Range], size: int) -> list[Range]:
    return [(i, min(i + size, e)) for s, e in ranges for i in range(s, e, size)]


def _packs(ranges: list[Range], cap: int) -> list[tuple[Range, ...]]:
    """Small ranges gathered greedily into messages of at most `cap` elements (a longer run is cut first)."""
    packs: list[list[Range]] = []
    for piece in _shards(ranges, cap):
        if packs and sum(e - s for s, e in packs[-1]) + piece[1] - piece[0] <= cap:
            packs[-1].append(piece)
        else:
            packs.append([piece])
    return [tuple(p) for p in packs]


def first_layers(params: list[nn.Parameter], budget_bytes: int) -> set[int]:
    """ids of the parameters, in first-use order, that start within the first `budget_bytes`."""
    chosen, seen = set(), 0
    for p in params:
        if seen >= budget_bytes:
            break
        chosen.add(id(p))
        seen += p.numel() * p.element_size()
    return chosen


def ring_through(peer: int, world: int) -> list[int]:
    """Group ranks for a path: rank 0, then its peer, then the rest in order."""
    return list(range(world)) if peer == 0 else [0, peer] + [r for r in range(1, world) if r != peer]


def union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one span is running."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def make_paths(routing: RoutingPlan, world: int) -> dict[str, dist.ProcessGroup]:
    """One group per path, created in this order on every rank (`new_group` is collective). torch before
    `sort_ranks` sorts every group: the rings then ignore the peers."""
    rings = {PRIORITY: list(range(world)), LATENCY: ring_through(routing.latency_peer, world),
             BANDWIDTH: ring_through(routing.bandwidth_peer, world)}
    keep = {"sort_ranks": False} if "sort_ranks" in inspect.signature(dist.new_group).parameters else {}
    return {path: dist.new_group(ring, **keep) for path, ring in rings.items()}


class ForwardOrder:
    """Parameters in the order the model's first forward uses them (registration order can differ)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.seen: dict[int, nn.Parameter] = {}
        self.handles = [hooks.forward_pre(m, self._used) for m in model.modules()
                        if next(m.parameters(recurse=False), None) is not None]

    def _used(self, module: nn.Module, args) -> None:
        for p in module.parameters(recurse=False):
            self.seen.setdefault(id(p), p)

    def freeze(self) -> list[nn.Parameter]:
        """The order so far, then parameters no forward used, in registration order."""
        self.close()
        unused = [p for p in self.model.parameters() if id(p) not in self.seen]
        return [p for p in [*self.seen.values(), *unused] if p.requires_grad]

    def close(self) -> None:
        self.handles = hooks.removed(self.handles)


@dataclass(eq=False)
class Sync:
    """The hook's state for one DDP model: its paths, the first layers, and what each step moved and took."""

    routing: RoutingPlan
    groups: dict[str, dist.ProcessGroup]
    order: ForwardOrder
    world: int
    first: set[int] | None = None  # ids of the first layers' parameters, fixed at the first backward
    clock: object = None  # CpuClock or CudaClock, by where the gradients are
    pending: list = field(default_factory=list)  # this step's message futures
    spans: list = field(default_factory=list)  # this step's (issued, done) marks
    steps: list = field(default_factory=list)  # every finished step's spans
    moved: dict = field(default_factory=dict)  # path -> [bytes, messages] in the last step
    busy_until: dict = field(default_factory=dict)  # path -> when its last collective ended (trace lanes)

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self.first is None:
            self.first = first_layers(self.order.freeze(), self.routing.dual_sync_bytes)
        buffer = bucket.buffer()
        self.clock = self.clock or (CudaClock() if buffer.is_cuda else CpuClock())
        if bucket.index() == 0:
            self.moved = {path: [0, 0] for path in self.groups}
        buffer.div_(self.world)
        base = buffer.storage_offset()
        layout = [(g.storage_offset() - base, g.numel(), id(p) in self.first)
                  for p, g in zip(bucket.parameters(), bucket.gradients())]
        futures = [self._issue(m, buffer) for m in messages(layout, buffer.element_size(),
                                                             self.routing.threshold_bytes, self.routing.shard_bytes)]
        self.pending += futures
        if not bucket.is_last():
            return torch.futures.collect_all(futures).then(lambda f: _checked(f, buffer))
        step, self.pending = self.pending, []
        return torch.futures.collect_all(step).then(lambda f: self._end_step(f, buffer))

    def _issue(self, m: Message, buffer: torch.Tensor) -> torch.futures.Future:
        views = [buffer[s:e] for s, e in m.pieces]
        tensor = views[0] if len(views) == 1 else torch.cat(views)
        nbytes = tensor.numel() * tensor.element_size()
        self.moved[m.path][0] += nbytes
        self.moved[m.path][1] += 1
        issued = self.clock.mark()
        work = dist.all_reduce(tensor, group=self.groups[m.path], async_op=True)

        def done(fut: torch.futures.Future) -> None:
            fut.value()  # a failed collective fails the step here
            if len(views) > 1:
                for view, part in zip(views, tensor.split([v.numel() for v in views])):
                    view.copy_(part)
            end = self.clock.mark()
            self.spans.append((issued, end))
            if isinstance(self.clock, CpuClock):  # a path runs its collectives one after another: a lane each
                start, self.busy_until[m.path] = max(issued, self.busy_until.get(m.path, issued)), end
                record_span(f"sync {m.path}", f"all_reduce {m.path}", start, end, nbytes)

        return work.get_future().then(done)

    def _end_step(self, fut: torch.futures.Future, buffer: torch.Tensor) -> torch.Tensor:
        _checked(fut, buffer)
        self.steps.append(self.spans)
        self.spans = []
        return buffer

    def step_seconds(self) -> list[float]:
        """Per finished step: the time at least one of its collectives was in flight."""
        if not self.steps:
            return []
        self.clock.finish()
        seconds = self.clock.seconds
        return [union_s([(seconds(spans[0][0], s), seconds(spans[0][0], e)) for s, e in spans])
                for spans in filter(None, self.steps)]


def _checked(fut: torch.futures.Future, buffer: torch.Tensor) -> torch.Tensor:
    for f in fut.value():
        f.value()  # re-raises the first failed collective
    return buffer


class GradientRouting(Mechanism):
    """Routes the all-reduce of every DDP model of the planned model, chosen right after DDP builds it (the hook
    must be in place before the first backward; the runtime's capture only sees the inner model, at its first
    forward). `DdpSync` owns DDP's one hook; routing supplies the all-reduce it runs."""

    def __init__(self, routing: RoutingPlan, ddp: DdpSync, fingerprint: str, predicted: Predicted):
        self.routing, self.ddp, self.fingerprint, self.predicted_s = routing, ddp, fingerprint, predicted.sync_s
        self.syncs: list[Sync] = []
        self.skipped: list[str] = []

    def install(self, patches, need_model: NeedModel) -> None:
        self.ddp.on_build(self._attach)

    def _attach(self, ddp: DistributedDataParallel) -> tuple[Sync, Callable[[Sync, object], object]] | None:
        if fingerprint(unwrap(ddp)) != self.fingerprint:
            self.skipped.append(f"a DDP model of {type(unwrap(ddp)).__name__} that is not the planned model")
            return None
        world = dist.get_world_size()
        if dist.get_world_size(ddp.process_group) != world:
            self.skipped.append("a DDP model over a subgroup of the ranks")
            return None
        try:
            check_routing(self.routing, world)
        except HeteroError as e:
            raise StopScript(e) from None  # raised inside the script: its `except Exception` must not hide it
        sync = Sync(self.routing, make_paths(self.routing, world), ForwardOrder(ddp.module), world)
        self.syncs.append(sync)
        return sync, Sync.__call__

    def close(self) -> None:
        # The script's DDP model keeps the paths' groups until interpreter teardown, where destroying a gloo group
        # whose threads still run aborts the process: they go now.
        for sync in self.syncs:
            sync.order.close()
            groups, sync.groups, sync.pending = list(sync.groups.values()), {}, []
            if dist.is_initialized():
                for group in groups:
                    dist.destroy_process_group(group)

    def summary(self) -> list[str]:
        lines = [f"routing: left {what} alone" for what in self.skipped]
        if not self.syncs:
            return lines + ["routing: no DDP model of the planned model was built: gradient sync not routed"]
        sync = self.syncs[0]
        if not (seconds := sync.step_seconds()):
            return lines + ["routing: hook registered, but no step synchronized"]
        moved = ", ".join(f"{path} {SIZE.format_short(b)} in {n}" for path, (b, n) in sync.moved.items())
        lines.append(f"routing: {len(seconds)} step(s) over {sync.world} ranks; per step {moved} message(s)")
        steady = seconds[1:] or seconds  # the first step also connects the groups and rebuilds DDP's buckets
        return lines + drift(statistics.median(steady), len(steady), self.predicted_s)


def drift(measured_s: float, steps: int, predicted: float | None) -> list[str]:
    """The sync-time line, and a warning when it is far from the plan's prediction."""
    line = f"routing: sync {TIME.format_short(measured_s)} per step (median of {steps})"
    if predicted is None:
        return [f"{line}; the plan predicts no sync time (no profile with peers found) to compare with"]
    ratio = measured_s / predicted if predicted > 0 else float("inf")
    out = [f"{line}, {ratio:.2f}x the {TIME.format_short(predicted)} the plan predicts"]
    if not 1 / DRIFT <= ratio <= DRIFT:
        out.append(f"warning: gradient sync drifted {ratio:.2f}x from the plan: the links are not what the profile "
                   "measured (COARSE re-profiles periodically): hetero profile --nproc-per-node N, then hetero plan")
    return out


def check_routing(routing: RoutingPlan, world: int) -> None:
    """A plan made for more ranks than this run has, or with no shard size, cannot be carried out."""
    for name in ("latency_peer", "bandwidth_peer"):
        rank = getattr(routing, name)
        if rank >= world:
            raise HeteroError(f"the plan's routing.{name} is rank {rank}, but this run has {world} rank(s) "
                              f"(0 to {world - 1})", hint="profile and plan again with the same --nproc-per-node and "
                              "--nnodes, or edit routing in the plan", exit_code=STALE_PLAN)
    if routing.shard_bytes < 1:
        raise HeteroError("the plan's routing.shard is 0B", hint="give a shard size, e.g. shard: 4MiB",
                          exit_code=STALE_PLAN)
