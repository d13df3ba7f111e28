"""One predicted iteration under a plan: tasks on lanes (compute, H2D, D2H, optimizer channels, NVMe read/write,
activation evict/prefetch, sync), each lane serving its tasks in the order they are issued.

Every lane has a fixed issue order (GFGB copies in forward order, then DFGB copies in backward order, then
prefetches as backward progresses; gradients in backward order; updates in gradient order, then the NVMe-spilled
ones in the optimizer's order), so the simulation is one pass over the layers: a task starts when its lane is free
and its inputs are ready. Spans are recorded only when asked: the planners call `simulate` hundreds of times.

NVMe-spilled states are handled as the runtime does (hetero.run.nvme_states.NvmeStaging): inside
`optimizer.step()`, in parameter order, through two alternating staging slots (slot k on channel k); the next
tensor's read overlaps the current update, a slot is read into once its last tensor was written out.

Without a GPU, background lanes share the cores with compute, which slows while they work (`Background`), by the
background tasks issued before each compute task; one issued later but starting earlier does not slow it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from hetero.plan.background import Background
from hetero.plan.model import GPU, Choices, Costs, Update, host_time_s, timed
from hetero.schema import trace
from hetero.schema.series import levels, sweep
from hetero.schema.trace import Count, Span, TierUse, memory_track


@dataclass(kw_only=True, slots=True)
class Result:
    iteration_s: float
    fp_start_s: list[float]
    fp_end_s: list[float]
    bp_start_s: list[float]
    bp_end_s: list[float]
    stall_s: float  # compute waiting for copies and prefetches
    nvme_late_s: float  # updates waiting for states read from NVMe
    peak_bytes: dict[str, int]
    act_avg_bytes: int
    act_peak_bytes: int
    act_avg_untiered_bytes: int
    act_peak_untiered_bytes: int
    spans: list[Span]
    counters: list[TierUse]  # when recorded


@dataclass(slots=True)
class LayerTimes:
    """When one layer's tasks start and end, in seconds from the iteration's start (0.0: a task it does not have)."""

    fp_host: float  # the runtime's host work in its forward and backward (model.host_time_s)
    bp_host: float
    fp_start: float = 0.0
    fp_end: float = 0.0
    bp_start: float = 0.0
    bp_end: float = 0.0
    load_end: float = 0.0  # its parameters' copy to the GPU
    evict_start: float = 0.0  # its saved activations' eviction and prefetch
    evict_end: float = 0.0
    pf_start: float = 0.0
    pf_end: float = 0.0
    issued: bool = False  # its prefetch
    ready: float = 0.0  # its gradients, for the optimizer


@dataclass(frozen=True, slots=True)
class _Spilled:
    """An update of layer `layer` whose states are on NVMe: `optimizer.step()` runs it."""

    layer: int
    update: Update


@dataclass(slots=True)
class _State:
    costs: Costs
    ch: Choices
    record: bool
    free: dict[str, float]
    layers: list[LayerTimes]  # index = layer
    spans: list[Span] = field(default_factory=list)
    opt_end: float = 0.0
    stall: float = 0.0
    nvme_late: float = 0.0
    background: Background | None = None  # None: background lanes do not slow compute

    def run(self, lane: str, what: str, i: int, ready: float, duration: float) -> float:
        """Start layer i's task `what` on `lane` once the lane is free and its input is `ready`; its end time."""
        start = max(self.free[lane], ready)
        end = self.free[lane] = start + duration
        if self.record:
            self.span(lane, what, i, start, end)
        if self.background is not None:
            self.background.add(lane, start, end)
        return end

    def compute(self, start: float, duration: float) -> float:
        """The end of `duration` seconds of compute (as profiled, alone on the cores) started at `start`."""
        return start + duration if self.background is None else self.background.finish(start, duration)

    def span(self, lane: str, what: str, i: int, start: float, end: float) -> None:
        self.spans.append(Span(lane=lane, name=f"{what} {self.costs.layers[i].name}", start_s=start, end_s=end))


def simulate(costs: Costs, ch: Choices, record: bool = False, detail: bool = True) -> Result:
    """The iteration under `ch`. `record` keeps every span for a trace; without `detail` only the iteration time
    and peak memory are computed (what a search compares), not averages or untiered activations."""
    n = len(costs.layers)
    lanes = ["compute", "h2d", "d2h", "evict", "prefetch", "nvme read", "nvme write", "sync", *ch.lanes]
    if len(ch.evict_s) != n:
        ch = timed(costs, replace(ch))
    st = _State(costs=costs, ch=ch, record=record, free=dict.fromkeys(lanes, 0.0),
                layers=[LayerTimes(fp, bp) for fp, bp in zip(*host_time_s(costs, ch))],
                background=Background.of(costs, ch))
    _forward(st)
    _dfgb_copies(st)
    compute_end = _backward(st)
    end = max(compute_end, st.opt_end, st.free["nvme write"])
    compute_only = st.layers[costs.bp_order[-1]].bp_end if n else 0.0
    iteration = end + costs.tail_s + (costs.micro_batches - 1) * compute_only
    if record and iteration > end:
        st.spans.append(Span(lane="compute", name="rest of the step (earlier micro-batches, data, zero_grad, ...)",
                             start_s=end, end_s=iteration))
    return _result(st, iteration, detail)


def _forward(st: _State) -> None:
    """GFGB copies start at the iteration start, back to back (MemFerry Fig. 6); DHA/DFGB layers start at once;
    saved activations are evicted as each layer's forward ends (TierTrain's aggressive eviction)."""
    costs, ch, gpu = st.costs, st.ch, st.costs.has_gpu
    for i, layer in enumerate(costs.layers):
        if gpu and not ch.params_on_gpu and ch.modes[i] == "gfgb" and layer.copy_s > 0:
            st.layers[i].load_end = st.run("h2d", "copy", i, 0.0, layer.copy_s)
    evict_lane = "d2h" if gpu else "evict"
    bg = st.background  # `st.compute` inlined: the searches' hot loop
    c = 0.0
    for i, (layer, t) in enumerate(zip(costs.layers, st.layers)):
        c = c + layer.fp_gap_s if bg is None else bg.finish(c, layer.fp_gap_s)
        start = max(c, t.load_end)
        st.stall += start - c
        dha = gpu and not ch.params_on_gpu and ch.modes[i] != "gfgb"
        fp = (layer.fp_dha_s if dha else layer.fp_s) + t.fp_host
        c = start + fp if bg is None else bg.finish(start, fp)
        t.fp_start, t.fp_end = start, c
        if st.record:
            st.span("compute", "fp", i, start, c)
        st.free["compute"] = c
        if ch.evict_bytes[i] > 0:
            t.evict_start = max(st.free[evict_lane], c)
            t.evict_end = st.run(evict_lane, "evict", i, c, ch.evict_s[i])


def _dfgb_copies(st: _State) -> None:
    """DFGB layers go to the GPU after their DHA forward, in the order backward needs them."""
    if not st.costs.has_gpu or st.ch.params_on_gpu:
        return
    for i in st.costs.bp_order:
        layer = st.costs.layers[i]
        if st.ch.modes[i] == "dfgb" and layer.copy_s > 0:
            st.layers[i].load_end = st.run("h2d", "dfgb copy", i, st.layers[i].fp_end, layer.copy_s)


def _backward(st: _State) -> float:
    costs, ch, gpu = st.costs, st.ch, st.costs.has_gpu
    evicted = [i for i in range(len(st.layers)) if ch.evict_bytes[i] > 0]
    planned = sorted(evicted, key=lambda i: (ch.prefetch_at_s[i], i))  # prefetches in their planned order
    by_time = [i for i in reversed(planned) if ch.trigger[i] is None]  # those the clock starts; popped earliest first
    by_layer: dict[int, list[int]] = {}  # those one layer's backward start triggers
    for i in (i for i in planned if ch.trigger[i] is not None):
        by_layer.setdefault(ch.trigger[i], []).append(i)
    bg = st.background  # `st.compute` inlined: the searches' hot loop
    c = st.free["compute"]
    for i in costs.bp_order:
        layer, t = costs.layers[i], st.layers[i]
        c = c + layer.bp_gap_s if bg is None else bg.finish(c, layer.bp_gap_s)
        start = c
        if gpu and ch.modes[i] == "dfgb" and not ch.params_on_gpu:
            start = max(start, t.load_end)
        while by_time and ch.prefetch_at_s[by_time[-1]] <= start:
            k = by_time.pop()
            _prefetch(st, k, ch.prefetch_at_s[k])
        for k in by_layer.get(i, ()):
            _prefetch(st, k, start)
        if ch.evict_bytes[i] > 0:
            _prefetch(st, i, start)  # not triggered yet (a late trigger in an edited plan): fetched on demand
            start = max(start, t.pf_end)
        st.stall += start - c
        mode = ch.modes[i] if gpu and not ch.params_on_gpu else "gfgb"
        bp = (layer.bp_time_s(mode, ch.grads[i]) if gpu else layer.bp_s) + t.bp_host
        c = start + bp if bg is None else bg.finish(start, bp)
        t.bp_start, t.bp_end = start, c
        if st.record:
            st.span("compute", "bp", i, start, c)
        kept = sum(u.grad_write_s for u in ch.updates[i])
        if kept:  # written by the training thread, in the parameter's post-accumulate-grad hook
            start, c = c, st.compute(c, kept)
            if st.record:
                st.span("compute", "grad to nvme", i, start, c)
        st.free["compute"] = c
        t.ready = _gradient_ready(st, i, c)
        if ch.overlap_backward:
            c = _updates(st, i, t.ready)
    last = max([t.ready for t in st.layers], default=c)  # the last gradient
    if not ch.overlap_backward:
        ready = max(c, last)  # clipping needs every gradient before the first update
        for i in costs.bp_order:
            c = _updates(st, i, ready)
    spilled = [_Spilled(i, u) for i in range(len(st.layers)) for u in ch.updates[i] if u.nvme_bytes]
    if spilled:  # step() runs them in the optimizer's order: its parameters, forward order
        c = _spilled_updates(st, spilled, max(c, last))
    if ch.step_s:
        c = st.compute(max(c, last), ch.step_s)
    return c


def _gradient_ready(st: _State, i: int, ready: float) -> float:
    """When layer i's gradients, final at `ready`, are where its updates read them."""
    layer, ch = st.costs.layers[i], st.ch
    if st.costs.has_gpu and ch.grads_to_host and ch.grads[i] == "gpu" and layer.params_bytes > 0:
        ready = st.run("d2h", "grad", i, ready, layer.grad_copy_s)
    if ch.sync_s and ch.sync_s[i] > 0:
        ready = st.run("sync", "sync", i, ready, ch.sync_s[i])
    return ready


def _prefetch(st: _State, i: int, at: float) -> None:
    t = st.layers[i]
    if t.issued:
        return
    t.issued = True
    lane = "h2d" if st.costs.has_gpu else "prefetch"
    t.pf_start = max(st.free[lane], at, t.evict_end)
    t.pf_end = st.run(lane, "prefetch", i, t.pf_start, st.ch.prefetch_s[i])


def _updates(st: _State, i: int, ready: float) -> float:
    """Run layer i's updates not spilled to NVMe; the compute lane's new end (host Adam without a GPU shares cores)."""
    for u in st.ch.updates[i]:
        if not u.nvme_bytes:
            st.opt_end = max(st.opt_end, _adam(st, i, u.lane, ready, u.update_s))
    return st.free["compute"]


def _adam(st: _State, i: int, lane: int, ready: float, duration: float) -> float:
    """One update on `lane` (-1: the compute lane, from where it is free) once `ready`; its end."""
    if lane >= 0:
        return st.run(st.ch.lanes[lane], "adam", i, ready, duration)
    start = max(st.free["compute"], ready)
    end = st.free["compute"] = st.compute(start, duration)
    if st.record:
        st.span("compute", "adam", i, start, end)
    return end


def _spilled_updates(st: _State, jobs: list[_Spilled], step: float) -> float:
    """The NVMe-spilled updates `jobs`, in order, in `step()` from `step` on (module docstring); compute's end."""
    slots = [step, step]  # when each staging slot's last tensor was written out
    lanes = len(st.ch.lanes)
    reads = {0: st.run("nvme read", "read states", jobs[0].layer, step, jobs[0].update.read_s)}
    t = step  # where the step's loop is
    for j, job in enumerate(jobs):
        if j + 1 < len(jobs):  # the next tensor's read, issued before this one's update
            nxt = jobs[j + 1]
            reads[j + 1] = st.run("nvme read", "read states", nxt.layer, max(t, slots[(j + 1) % 2]), nxt.update.read_s)
        lane = (j % 2) % lanes if lanes else -1
        free = st.free[st.ch.lanes[lane] if lane >= 0 else "compute"]
        read = reads.pop(j)
        st.nvme_late += max(0.0, read - max(t, free))  # the update waits for its states
        end = _adam(st, job.layer, lane, max(t, read), job.update.update_s)
        slots[j % 2] = st.run("nvme write", "write states", job.layer, end, job.update.write_s)
        st.opt_end = max(st.opt_end, end)
        t = end
    return st.free["compute"]


def _result(st: _State, iteration: float, detail: bool) -> Result:
    fast, slow = _activation_events(st, tiered=True)
    untiered_peak = untiered_avg = slow_peak = act_avg = 0
    fast_curve: list[tuple[float, int]] = []
    slow_curve: list[tuple[float, int]] = []
    if detail:
        act_peak, act_avg, fast_curve = _sweep(fast, iteration)
        untiered_peak, untiered_avg, _ = _sweep(_activation_events(st, tiered=False)[0], iteration)
        slow_peak, _, slow_curve = _sweep(slow, iteration)
    else:  # a search needs the peak only
        act_peak = max(itertools.accumulate(delta for _, delta in sorted(fast)), default=0)
    peak = dict(st.ch.static_bytes)
    if st.costs.has_gpu:
        peak[GPU] = peak.get(GPU, 0) + _gpu_static(st)
    counters = []
    for tier, extra, curve in ((st.ch.fast, act_peak, fast_curve), (st.ch.slow, slow_peak, slow_curve)):
        if tier is not None:
            peak[tier] = peak.get(tier, 0) + extra
            base = peak[tier] - extra
            counters += [TierUse(t, tier, base + used) for t, used in curve] if st.record else []
    ts = st.layers
    return Result(iteration_s=iteration, fp_start_s=[t.fp_start for t in ts], fp_end_s=[t.fp_end for t in ts],
                  bp_start_s=[t.bp_start for t in ts], bp_end_s=[t.bp_end for t in ts], stall_s=st.stall,
                  nvme_late_s=st.nvme_late, peak_bytes=peak, act_avg_bytes=act_avg, act_peak_bytes=act_peak,
                  act_avg_untiered_bytes=untiered_avg, act_peak_untiered_bytes=untiered_peak, spans=st.spans,
                  counters=counters)


def _gpu_static(st: _State) -> int:
    """Parameter and gradient buffers the shadow model keeps on the GPU for the whole iteration."""
    ch, total = st.ch, 0
    for i, layer in enumerate(st.costs.layers):
        if ch.params_on_gpu or ch.modes[i] != "dha":
            total += layer.params_bytes
        if ch.grads[i] == "gpu" or not ch.grads_to_host:
            total += layer.params_bytes
    return total


def _activation_events(st: _State, tiered: bool) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """(time, change in bytes) of saved activations in the fast and the slow tier: a layer's tensors appear when
    its forward ends and leave when its backward ends; an evicted part is away from the end of its eviction to
    the start of its prefetch."""
    fast, slow = [], []
    for i, (layer, t) in enumerate(zip(st.costs.layers, st.layers)):
        if layer.saved_bytes:
            fast += [(t.fp_end, layer.saved_bytes), (t.bp_end, -layer.saved_bytes)]
        e = min(st.ch.evict_bytes[i], layer.saved_bytes) if tiered else 0
        if e > 0:
            fast += [(t.evict_end, -e), (t.pf_start, e)]
            slow += [(t.evict_start, e), (t.pf_end, -e)]
    return fast, slow


def _sweep(events: list[tuple[float, int]], horizon: float) -> tuple[int, int, list[tuple[float, int]]]:
    """Peak and time-averaged bytes in use over [0, horizon], and the usage after each event (hetero.schema.series:
    the recorder's rule for the measured bytes)."""
    curve = levels(events)
    swept = sweep(curve, 0.0, horizon)
    return max(0, swept.peak_bytes), swept.avg_bytes if horizon > 0 else 0, curve


def chrome_trace(result: Result, predicted_iteration_s: float) -> dict:
    """The timeline as Chrome/Perfetto trace JSON: one thread per lane, memory per tier as counters; its metadata
    holds the simulated iteration and the plan's prediction (plain's measured step plus the simulated difference)."""
    counters = [Count(u.time_s, memory_track(u.tier), {"predicted": u.used_bytes}) for u in result.counters]
    return trace.chrome(result.spans, counters, {"iteration_s": result.iteration_s, "peak_bytes": result.peak_bytes,
                                                 "predicted_iteration_s": predicted_iteration_s})
