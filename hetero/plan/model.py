"""The simulator's inputs: what a profile says each layer and transfer costs (`Curve`, `Costs`), and what a plan
decides in the simulator's terms (`Choices`). Pure: built from Profile and Plan objects, no I/O.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from hetero.errors import USAGE, HeteroError
from hetero.schema.plan import GradPlace, LayerGrad, LayerMode, Mode
from hetero.schema.profile import CurvePoint, Profile

GPU = "gpu"  # the key of GPU memory in `predicted.peak` and the fast tier of activations on a GPU


@dataclass(frozen=True, slots=True)
class Curve:
    """Transfer time by size from measured points: linear between points, the last segment's rate beyond them,
    and never less than the smallest measured transfer (its latency)."""

    sizes: tuple[int, ...]
    times: tuple[float, ...]

    @classmethod
    def of(cls, points: list[CurvePoint], what: str = "a transfer curve") -> Curve:
        """From CurvePoints; times are made non-decreasing, since a noisy median must not make a larger transfer
        faster (inverting the curve needs it monotone). `what` names the curve in the error when it is empty."""
        sizes: list[int] = []
        times: list[float] = []
        for size, time in sorted((p.size_bytes, p.time_s) for p in points if p.size_bytes > 0):
            if sizes and size == sizes[-1]:
                times[-1] = max(times[-1], time)
                continue
            sizes.append(size)
            times.append(max(time, times[-1]) if times else time)
        if not sizes:
            raise HeteroError(f"the profile's {what} has no measured sizes; the planner needs it to time transfers",
                              hint="re-run `hetero profile` on this machine", exit_code=USAGE)
        return cls(tuple(sizes), tuple(times))

    @classmethod
    def linear(cls, rate_bytes_per_s: float, latency_s: float = 0.0) -> Curve:
        """A pure rate (TierTrain's ER/PR) with a fixed latency: for hand-worked cases."""
        top = 2**50
        return cls((1, top), (latency_s + 1 / rate_bytes_per_s, latency_s + top / rate_bytes_per_s))

    def then(self, other: Curve) -> Curve:
        """One transfer after the other (GPU -> host -> NVMe): times add at every size either curve measured."""
        sizes = tuple(sorted(set(self.sizes) | set(other.sizes)))
        return Curve(sizes, tuple(self.time_s(s) + other.time_s(s) for s in sizes))

    @property
    def _tail_s_per_byte(self) -> float:
        s, t = self.sizes, self.times
        if len(s) >= 2 and t[-1] > t[-2]:
            return (t[-1] - t[-2]) / (s[-1] - s[-2])
        return t[-1] / s[-1]

    def time_s(self, size: int | float) -> float:
        if size <= 0:
            return 0.0
        s, t = self.sizes, self.times
        i = bisect.bisect_left(s, size)
        if i == 0:
            return t[0]
        if i == len(s):
            return t[-1] + (size - s[-1]) * self._tail_s_per_byte
        return t[i - 1] + (t[i] - t[i - 1]) * (size - s[i - 1]) / (s[i] - s[i - 1])

    def size_within(self, time_s: float) -> int:
        """The largest size that moves within `time_s` (0 when even the smallest transfer takes longer)."""
        s, t = self.sizes, self.times
        if time_s < t[0]:
            return 0
        i = bisect.bisect_right(t, time_s)
        if i == len(t):
            per = self._tail_s_per_byte
            size = s[-1] + int((time_s - t[-1]) / per) if per > 0 else 2**62
        else:
            size = int(s[i - 1] + (time_s - t[i - 1]) / (t[i] - t[i - 1]) * (s[i] - s[i - 1]))
        while size > 0 and self.time_s(size) > time_s:  # float rounding of the inversion: a byte or two
            size -= 1
        return size

    def rate(self, size: int) -> float:
        return size / self.time_s(size)

    @property
    def peak_rate(self) -> float:
        return max((s / t for s, t in zip(self.sizes, self.times) if t > 0), default=float("inf"))


def chunks(storages: tuple[int, ...], size: int) -> list[int]:
    """How the runtime moves `size` bytes of a layer whose saved storages are `storages` (largest first): whole
    storages while they fit, then the bytes left from the next one; bytes past them (storages not recorded) as one
    more transfer."""
    out = []
    for s in storages:
        if size <= 0:
            break
        out.append(min(s, size))
        size -= out[-1]
    return out + [size] if size > 0 else out


def chunks_time_s(curve: Curve, storages: tuple[int, ...], size: int) -> float:
    """`curve`'s time for `size` bytes moved as `chunks`: each storage pays its transfer's fixed cost."""
    if size <= 0:
        return 0.0
    if not storages or size <= storages[0]:  # one transfer: the common case, kept cheap for the searches
        return curve.time_s(size)
    return sum(curve.time_s(c) for c in chunks(storages, size))


def chunks_within(curve: Curve, storages: tuple[int, ...], budget_s: float, upper: int) -> int:
    """The most bytes, at most `upper`, that `chunks` moves within `budget_s`."""
    done = 0
    for c in chunks(storages, upper):
        t = curve.time_s(c)
        if t > budget_s:
            return done + min(c, curve.size_within(budget_s))
        done, budget_s = done + c, budget_s - t
    return done


@dataclass(kw_only=True, slots=True)
class LayerCosts:
    """What one layer costs, from the profile; no plan changes these."""

    name: str
    params_bytes: int
    num_params: int
    saved_bytes: int
    saved_storages: tuple[int, ...] = ()  # largest first; empty: not profiled (the bytes move as one transfer)
    fp_s: float
    bp_s: float
    fp_dha_s: float | None  # None: the layer cannot run from host memory
    bp_dha_s: float | None
    bp_grad_host_s: float | None  # None: its gradients cannot be written to host memory
    copy_s: float  # MemFerry's T_trans: H2D copy of its parameters
    grad_copy_s: float  # D2H copy of its gradients
    fp_gap_s: float  # compute between the previous layer's forward and this one's (MemFerry's A)
    bp_gap_s: float  # compute between the previous backward layer and this one
    tensors: int = 1  # parameter tensors it owns: the optimizer's and the gradient hooks' unit of work

    def bp_time_s(self, mode: Mode, grad: GradPlace) -> float:
        """Backward time by parameter and gradient place. A DHA layer writing host gradients is not measured:
        both slowdowns are added, since they load different directions of the link."""
        on_gpu = self.bp_s if mode != LayerMode.DHA else self.bp_dha_s
        if grad == LayerGrad.HOST:
            return on_gpu + (self.bp_grad_host_s - self.bp_s)
        return on_gpu


@dataclass(kw_only=True, slots=True)
class Costs:
    layers: list[LayerCosts]
    bp_order: list[int]  # layer indices in backward order
    tail_s: float  # the rest of an iteration after the optimizer (data loading, zero_grad, ...)
    micro_batches: int
    has_gpu: bool
    evict: Curve | None  # fast -> slow tier for saved activations
    prefetch: Curve | None
    # Compute time with a host worker streaming memory beside it, over compute time alone. None where background
    # lanes cannot slow compute: a GPU computes, or the profile did not measure it.
    background_slowdown: float | None = None
    host: HostWork | None = None  # what the runtime's own work costs the thread that runs the model (a GPU's)


@dataclass(frozen=True, slots=True)
class HostWork:
    """Unit costs of the runtime's host-side work, as the profile measured them on the GPU machine: while that
    thread works, no kernel is issued, so the simulator adds it to the compute lane (an upper bound where the GPU
    is busy for longer than the launches take)."""

    hook_pair_s: float  # a module's pre- and post-forward hooks
    saved_tensor_s: float  # a saved tensor's pack and unpack
    event_s: float  # an ordered hand-off between streams


def costs(profile: Profile, evict: Curve | None = None, prefetch: Curve | None = None) -> Costs:
    """A profile's layers as the simulator sees them. The compute between layers (loss, reshapes, ...) comes from
    the gaps in the profiled timeline. DHA times the profiler could not measure are estimated from the measured
    DHA read bandwidth (one extra pass over the parameters), or left unknown (no DHA for that layer); host-gradient
    times from the DHA write bandwidth, else from the D2H curve (the gradients cross the link once either way)."""
    gpu, layers = profile.machine.gpu, profile.layers
    h2d, d2h = (Curve.of(gpu.h2d, "gpu.h2d"), Curve.of(gpu.d2h, "gpu.d2h")) if gpu else (None, None)
    out, prev = [], 0.0
    for x in layers:
        size = x.params_bytes
        read = gpu.dha_read_bytes_per_s if gpu else None
        write = gpu.dha_write_bytes_per_s if gpu else None
        out.append(LayerCosts(
            name=x.name, params_bytes=size, num_params=x.num_params, saved_bytes=x.saved_bytes,
            saved_storages=tuple(x.saved_storages_bytes), fp_s=x.fp_s,
            bp_s=x.bp_s, fp_dha_s=_known(x.fp_dha_s, x.fp_s, size, read),
            bp_dha_s=_known(x.bp_dha_s, x.bp_s, size, read),
            bp_grad_host_s=_known(x.bp_grad_host_s, x.bp_s, size, write, d2h),
            copy_s=h2d.time_s(size) if gpu else 0.0, grad_copy_s=d2h.time_s(size) if gpu else 0.0,
            fp_gap_s=max(0.0, x.fp_end_s - x.fp_s - prev), bp_gap_s=0.0, tensors=max(1, len(x.params))))
        prev = max(prev, x.fp_end_s)
    order = sorted(range(len(layers)), key=lambda i: (layers[i].bp_start_s, -i))
    for i in order:
        out[i].bp_gap_s = max(0.0, layers[i].bp_start_s - prev)
        prev = max(prev, layers[i].bp_start_s + layers[i].bp_s)
    t = profile.training
    tail = max(0.0, t.iteration_s - t.optimizer_step_s - t.grad_accumulation * prev)
    slowdown = profile.machine.cpu.background_slowdown if gpu is None else None  # a GPU's kernels share no cores
    return Costs(layers=out, bp_order=order, tail_s=tail, micro_batches=t.grad_accumulation, has_gpu=gpu is not None,
                 evict=evict, prefetch=prefetch, background_slowdown=slowdown, host=_host_work(profile))


def _host_work(profile: Profile) -> HostWork | None:
    """The measured unit costs on a GPU machine (None elsewhere, where the CPU's own compute is what the runtime's
    work competes with, and the profile measures that beside compute instead)."""
    cpu, gpu = profile.machine.cpu, profile.machine.gpu
    if gpu is None or cpu.hook_pair_s is None:
        return None
    return HostWork(hook_pair_s=cpu.hook_pair_s, saved_tensor_s=cpu.saved_tensor_s or 0.0, event_s=gpu.event_s or 0.0)


def _known(measured: float | None, base_s: float, size: int, rate: float | None,
           link: Curve | None = None) -> float | None:
    if measured is not None:
        return measured
    if size == 0:
        return base_s
    if rate:
        return base_s + size / rate
    return base_s + link.time_s(size) if link else None


@dataclass(kw_only=True, slots=True)
class Update:
    """One optimizer call: a parameter's update, or on the host a bucket's (hetero.plan.axdimm.calls)."""

    lane: int  # index into Choices.lanes; -1: the compute lane (host Adam without a GPU, GPU Adam)
    update_s: float
    nvme_bytes: int = 0  # states staged from NVMe for this update and written back after it
    read_s: float = 0.0
    write_s: float = 0.0
    grad_write_s: float = 0.0  # its gradient written to NVMe as backward makes it final (the plan's nvme.grads)


@dataclass(kw_only=True, slots=True)
class Choices:
    """Everything a plan decides, in the simulator's terms (index = layer)."""

    modes: list[Mode]
    grads: list[GradPlace]
    evict_bytes: list[int]
    trigger: list[int | None]  # the layer whose backward start triggers the prefetch; None: by time
    prefetch_at_s: list[float]
    updates: list[list[Update]]
    lanes: list[str]
    overlap_backward: bool
    grads_to_host: bool  # the optimizer runs off the GPU: gradients kept on the GPU are copied to the host
    params_on_gpu: bool  # the optimizer runs on the GPU: every parameter lives there
    step_s: float = 0.0  # the script's own optimizer step, on the compute lane after backward
    staging_bytes: int = 0
    sync_s: list[float] = field(default_factory=list)
    fast: str | None = None
    slow: str | None = None
    static_bytes: dict[str, int] = field(default_factory=dict)
    # Share of a core each background lane's worker keeps busy (lanes not listed: none); with the profile's
    # background_slowdown it says how much a CPU-only machine's compute slows while that lane works.
    cpu_share: dict[str, float] = field(default_factory=dict)
    evict_s: list[float] = field(default_factory=list)  # per layer, from `timed`: searches reuse them
    prefetch_s: list[float] = field(default_factory=list)


def timed(costs: Costs, ch: Choices) -> Choices:
    """`ch` with its eviction and prefetch durations worked out once."""
    pairs = list(zip(ch.evict_bytes, costs.layers))
    ch.evict_s = [chunks_time_s(costs.evict, x.saved_storages, b) for b, x in pairs]
    ch.prefetch_s = [chunks_time_s(costs.prefetch, x.saved_storages, b) for b, x in pairs]
    return ch


def host_time_s(costs: Costs, ch: Choices) -> tuple[list[float], list[float]]:
    """The runtime's host work in each layer's forward and backward, counted as the runtime does it: with
    activations tiered, every layer's boundary hooks and each saved storage's pack and unpack; with the shadow
    model, a GFGB layer's wait for its copy, a DFGB layer's hook, event and switch; with the optimizer off the GPU,
    each parameter's post-accumulate hook and the event its update waits on; host gradients, a hook per parameter."""
    n, w = len(costs.layers), costs.host
    if w is None:
        return [0.0] * n, [0.0] * n
    tiered = any(ch.evict_bytes)
    shadow = costs.has_gpu and not ch.params_on_gpu
    fp, bp = [0.0] * n, [0.0] * n
    for i, x in enumerate(costs.layers):
        saved = len(x.saved_storages) if x.saved_storages else (1 if x.saved_bytes else 0)
        if tiered:
            fp[i] += w.hook_pair_s + saved * w.saved_tensor_s / 2
            bp[i] += saved * w.saved_tensor_s / 2
        if shadow and x.params_bytes:
            mode = ch.modes[i]
            fp[i] += (w.hook_pair_s / 2 + w.event_s) if mode != LayerMode.DHA else 0.0
            bp[i] += (w.hook_pair_s / 2 + w.event_s) if mode == LayerMode.DFGB else 0.0
        if ch.grads_to_host and x.params_bytes:
            bp[i] += x.tensors * (w.hook_pair_s / 2 + w.event_s)
            bp[i] += x.tensors * w.hook_pair_s if ch.grads[i] == LayerGrad.HOST else 0.0
    return fp, bp
