"""Where one parameter's fp32 master copy and Adam states live, and how its update runs there.

A home holds the states; a driver runs updates in arrival order on its own thread, so a gradient hook in backward only
enqueues work. Updates reach the drivers in buckets (`launch`, hetero.schema.names.update_buckets): one ready event,
one job per driver and, on the host, one fused Adam call, each parameter's arithmetic exactly as alone. Each AXDIMM
channel has a driver that alone switches its arbiter (normal to copy the gradient in, acceleration to run Adam), so
the paper's exclusivity holds by construction (§5.2). The model's parameters change only in `optimizer.step()`:
overlapped updates wait in the homes' masters until `copy_back`; a host home updated in `step()` has no master of its
own, the parameter's host bytes are it (`HostHome`). Parameters whose data is device memory get their weights by
`upload`: one asynchronous copy per bucket (`flatten`) on the upload stream, one event for compute to wait on.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hetero.errors import HeteroError
from hetero.kernels import dha
from hetero.kernels.adam import AdamKernel, Hyperparameters
from hetero.run import spans
from hetero.run.devices.axdimm import AxdimmDevice

FP32 = 4


def flat(t: torch.Tensor) -> torch.Tensor:
    """A parameter's or gradient's data as a flat fp32 tensor, without a copy."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise HeteroError(f"hetero's offloaded Adam updates contiguous float32 parameters; got {t.dtype} "
                          f"{'contiguous' if t.is_contiguous() else 'non-contiguous'} {tuple(t.shape)}",
                          hint="train in float32, or set `optimizer: {device: gpu}` in the plan to keep the "
                               "script's optimizer")
    return t.detach().view(-1)


class GradientSource:
    """Where a home reads a gradient from. A GPU gradient comes down into pinned memory on the download stream after
    its ready event, the driver thread waiting for the copy's event; a device view of pinned host memory (a `grad:
    host` layer's gradient) is read in place."""

    def __init__(self, param: torch.Tensor):
        self.link = dha.devices.of(param)  # the parameter's GPU, the one its gradients are made on; None: host

    def ready(self, grad: torch.Tensor):
        """On the thread that made `grad` final: an event after its producer on the parameter's device; None on the
        host (its gradient is final when the hook runs)."""
        if self.link is None:
            return None
        event = self.link.event("gradient ready")
        self.link.record_compute(event)
        return event

    def in_host(self, grad: torch.Tensor) -> torch.Tensor | None:
        """`grad` itself or the host tensor it views (read it after `wait`); None when on a GPU."""
        return grad if self.link is None else self.link.host_view(grad)

    def wait(self, ready) -> None:
        """The host waits for `ready`: the kernels writing the gradients, and those before them reading the
        parameters' host bytes, are done."""
        if self.link is not None and ready is not None:
            self.link.synchronize(ready)

    def download_async(self, dst: torch.Tensor, grad: torch.Tensor, ready):
        """Start copying a GPU gradient into pinned `dst` after `ready`; returns the event ending it (one stream, in
        order). The caller keeps `grad` until then."""
        return self.link.download(dst, grad, ready)

    def finish(self, done) -> None:
        """The host waits for downloads up to the one `done` ends."""
        self.link.synchronize(done)

    def copy_into(self, dst: torch.Tensor, grad: torch.Tensor, ready, waited: bool = False) -> None:
        """dst <- grad, wherever it is; `waited`: the caller waited for `ready` already."""
        if (host := self.in_host(grad)) is None:  # a GPU gradient: in pinned `dst` once this returns
            self.finish(self.download_async(dst, grad, ready))
            return
        if not waited:
            self.wait(ready)
        dst.copy_(host)

    def host_bytes(self, param: torch.Tensor) -> torch.Tensor | None:
        """The parameter's own host bytes, flat: a host parameter's data, or the pinned host bytes behind its device
        view; None while its data is device memory."""
        if self.link is None:
            return flat(param.data)
        host = self.link.host_view(param.data)
        return None if host is None else flat(host)

    def host_data(self, param: torch.Tensor) -> torch.Tensor:
        """Where `copy_back` writes: the parameter's host bytes, else its data."""
        host = self.host_bytes(param)
        return flat(param.data) if host is None else host

    def buffer(self, numel: int) -> torch.Tensor:
        """fp32 host memory for `numel` values, pinned when a GPU reads or writes it, exact bytes as the plan counts
        (torch's pinned allocator rounds up to a power of two)."""
        return torch.empty(numel) if self.link is None else self.link.pinned(numel * FP32).view(torch.float32)


@dataclass(eq=False, slots=True)
class Update:
    """One parameter's update: its home, its final gradient, its constants and its 1-based step."""

    home: AxdimmHome | HostHome
    grad: torch.Tensor
    hp: Hyperparameters
    step: int


def launch(updates: list[Update], uploads: list | None = None) -> None:
    """Start updates whose gradients are all final, the last one made final by the calling thread: one ready event
    (recorded after every kernel the gradients came from) and one job per driver, in order. With `uploads`, each
    job then sends its weights to device memory (`upload`, into `uploads`) right after its update."""
    ready = updates[0].home.source.ready(updates[-1].grad)
    jobs: dict[int, list[Update]] = defaultdict(list)
    for u in updates:
        jobs[id(u.home.driver)].append(u)
    for batch in jobs.values():
        home = batch[0].home
        home.driver.submit(lambda home=home, batch=batch: _run(home, batch, ready, uploads))


def _run(home: AxdimmHome | HostHome, batch: list[Update], ready, uploads: list | None) -> None:
    """One driver job: the bucket's updates, then (in step()) its weights on their way back."""
    home.run_updates(batch, ready)
    if uploads is not None:
        upload(batch, uploads, ready)


def upload(batch: list[Update], into: list, after=None) -> None:
    """The updated masters of a bucket's parameters whose data is device memory (`HostHome.attach`) into that
    memory, on the upload stream after event `after` (None: every kernel so far): one copy where they fill their
    flat buffers (`flatten`), else one each. Adds (device, last copy's event) to `into`; the caller has compute wait
    for it and keeps the masters unwritten until then."""
    homes = [u.home for u in batch if u.home.device_data is not None]
    if not homes:
        return
    link = homes[0].source.link
    waits = (homes[0].source.ready(None) if after is None else after,)
    whole = homes[0].bucket
    if whole is not None and len(homes) == whole.members and all(h.bucket is whole for h in homes):
        copies = [(whole.device, whole.master)]
    else:  # some had no gradient this step, or the script gave one other memory
        copies = [(h.device_data, h.buffers[0][:h.device_data.numel()]) for h in homes]
    for dst, src in copies:
        done = link.upload(dst, src, waits)
        waits = ()  # the stream runs its copies in order
    into.append((link, done))


@dataclass(eq=False, slots=True)
class FlatBucket:
    """A bucket's resident weights in one device buffer and their masters in one pinned host buffer, each parameter
    at the same offset in both (`flatten`), so that `upload` sends them back in one copy."""

    device: torch.Tensor
    master: torch.Tensor
    members: int

    def holds(self, t: torch.Tensor | None) -> bool:
        return t is not None and 0 <= t.data_ptr() - self.device.data_ptr() < self.device.nbytes


def flatten(members: list[tuple[torch.nn.Parameter, AxdimmHome | HostHome]]) -> None:
    """Lay out a bucket's resident parameters (of `members`: host homes' whose data is a whole device storage on the
    first one's device, with no host bytes behind it) as views into one new device buffer, and their masters as views
    into one pinned host buffer at the same offsets (a FlatBucket, aligned as dha.offsets), holding what they held.
    Once, on step()'s thread before its updates, the drivers drained. `p.data = view` on the same device and dtype
    keeps the parameter's gradient accumulator and the hooks on it (the optimizer's, DDP's reducer)."""
    link = members[0][1].source.link  # a bucket's parameters are on one device, as a model's are
    resident = [(p, h) for p, h in members if isinstance(h, HostHome) and link is not None and h.source.link is link
                and h.source.host_bytes(p) is None and p.untyped_storage().nbytes() == p.nbytes]
    if not resident:
        return
    starts, nbytes = dha.offsets([p.nbytes for p, _ in resident])
    bucket = FlatBucket(link.buffer(nbytes).view(torch.float32), resident[0][1].source.buffer(nbytes // FP32),
                        len(resident))
    for (p, home), start in zip(resident, starts):
        data, master = (t[start // FP32:start // FP32 + p.numel()] for t in (bucket.device, bucket.master))
        link.write(data, flat(p.data))
        home.adopt(master, p, bucket)
        p.data = data.view_as(p)


class Driver:
    """One thread that runs a place's update jobs in order."""

    def __init__(self, name: str):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"hetero-{name}")
        self.pending: list[Future] = []

    def submit(self, job) -> None:
        self.pending.append(self.pool.submit(job))

    def drain(self) -> None:
        """Wait for every job submitted; re-raise the first failure."""
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class ChannelDriver(Driver):
    """The host side of one AXDIMM channel."""

    def __init__(self, device: AxdimmDevice, channel: int):
        super().__init__(f"axdimm-ch{channel}")
        self.device, self.channel = device, channel

    def drain(self) -> None:
        super().drain()
        self.device.set_arbiter(self.channel, "normal")  # waits for the last kernel, like polling its status


class AxdimmHome:
    """Master copy, gradient and Adam states of one parameter on one AXDIMM channel. Every operation sizes itself
    from the tensor it is given, so a home sized for the largest parameter stages any smaller one (NvmeStaging)."""

    device_data = None  # never uploaded: the channel's memory is reached through memcpy only, by `copy_back`

    def __init__(self, driver: ChannelDriver, param: torch.Tensor):
        self.driver, self.device, self.channel = driver, driver.device, driver.channel
        self.source = GradientSource(param)
        self.numel = param.numel()
        self.buffers = [self.device.malloc(self.numel * FP32, self.channel) for _ in range(4)]  # master, m, v, grad
        self.load(flat(param), torch.zeros(self.numel), torch.zeros(self.numel))

    def _regions(self, numel: int) -> list:
        return [b.region(0, numel * FP32) if numel < self.numel else b for b in self.buffers]

    def load(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Replace the states (host access: the channel is normal whenever its driver is drained)."""
        for dst, src in zip(self._regions(master.numel()), (master, exp_avg, exp_avg_sq)):
            self.device.memcpy(dst, src.reshape(-1).contiguous(), master.numel() * FP32)

    def store(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Copy the states out into host tensors (whose size says how much)."""
        for dst, src in zip((master, exp_avg, exp_avg_sq), self._regions(master.numel())):
            self.device.memcpy(dst, src, master.numel() * FP32)

    def update(self, grad: torch.Tensor, hp: Hyperparameters, step: int) -> None:
        """A bucket of one (the profile times single updates this way)."""
        launch([Update(self, grad, hp, step)])

    def quiesce(self) -> None:
        """Take the channel back for the host (on the driver thread: only it switches the arbiter)."""
        self.device.set_arbiter(self.channel, "normal")

    def run_updates(self, batch: list[Update], ready=None) -> None:
        """The updates of a bucket on this channel, after one wait for `ready`; on the driver thread."""
        waited = any(u.home.source.in_host(u.grad) is not None for u in batch)
        if waited:
            self.source.wait(ready)
        for u in batch:
            u.home.run_update(u.grad, u.hp, u.step, ready, waited)

    def run_update(self, grad: torch.Tensor, hp: Hyperparameters, step: int, ready=None, waited: bool = False) -> None:
        """Copy the gradient in and launch the kernel; on the driver thread."""
        master, exp_avg, exp_avg_sq, buffer = self._regions(grad.numel())
        self.device.set_arbiter(self.channel, "normal")
        with spans.timed(f"axdimm ch{self.channel} host", "gradient in", grad.numel() * FP32):
            # straight from the GPU into the channel's (pinned) memory, on the device's download stream
            self.device.memcpy(buffer, flat(grad), grad.numel() * FP32,
                               through=lambda dst, src: self.source.copy_into(dst, src, ready, waited))
        self.device.set_arbiter(self.channel, "acceleration")
        self.device.run_adam_async(master, exp_avg, exp_avg_sq, buffer, hyperparameters=hp, step=step,
                                   channel=self.channel)

    def attach(self, param: torch.Tensor) -> None:
        """Nothing: the master lives on the channel (see HostHome.attach)."""

    def copy_back(self, param: torch.Tensor) -> None:
        self.device.memcpy(self.source.host_data(param), self._regions(param.numel())[0], param.numel() * FP32)

    def nbytes(self) -> int:
        """Channel memory held: master, m, v and the gradient's landing place."""
        return 4 * FP32 * self.numel

    def host_buffers(self) -> None:
        """None: the channel's memory is reached through memcpy only (the AXDIMM's rule), so staging bounces."""
        return


class HostHome:
    """Master copy and Adam states in host memory (pinned when a GPU computes), updated by the host's driver.

    A `shared` home (`OptimizerPlan.shares_master`: host states updated in `step()`) has no master buffer: its master
    is the parameter's own host bytes (`GradientSource.host_bytes`), written in place, so `copy_back` copies nothing.
    `attach` finds them at every step, before its update; a parameter without host bytes then gets a master of its
    own from that step on. Updates that overlap backward are never shared: the parameters change only in `step()`. A
    parameter whose data `attach` finds in device memory has a master of its own, which `upload` sends there."""

    def __init__(self, driver: Driver, kernel: AdamKernel, param: torch.Tensor, shared: bool = False):
        self.driver, self.kernel = driver, kernel
        self.source = GradientSource(param)
        self.shared = shared
        n = param.numel()
        # master (a shared home's: the parameter's host bytes as `attach` last found them, None before), m, v
        self.buffers: list[torch.Tensor | None] = [None if shared else self.source.buffer(n),
                                                   self.source.buffer(n), self.source.buffer(n)]
        self.grad = self.source.buffer(n) if self.source.link is not None else None  # from the GPU
        self.loaded: torch.Tensor | None = None  # a master `load` gave a shared home: written at the next `attach`
        self.device_data: torch.Tensor | None = None  # the parameter's data where `attach` found it device memory
        self.bucket: FlatBucket | None = None  # where `flatten` laid out that data and the master
        for b in self.buffers[1:]:
            b.zero_()
        if not shared:
            _copy(self.buffers[0], flat(param))

    def load(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Replace the states. A shared home keeps `master` (left unchanged by the caller) until its next `attach`
        writes it into the parameter's host bytes."""
        if self.shared:
            self.loaded = master.reshape(-1)
        for dst, src in zip(self._own(), (exp_avg, exp_avg_sq) if self.shared else (master, exp_avg, exp_avg_sq)):
            _copy(dst[:master.numel()], src.reshape(-1))

    def store(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Copy the states out (a shared home's master as its last step left it; none before its first step)."""
        for dst, src in zip((master, exp_avg, exp_avg_sq), self.buffers):
            if src is not None:
                _copy(dst, src[:master.numel()])

    def attach(self, param: torch.Tensor) -> None:
        """On the thread calling step(), before this step's updates: a shared home's master is `param`'s host bytes
        now, holding what `load` gave since; without host bytes, a master of the home's own from now on, and the
        parameter's data (device memory) is where `upload` sends it."""
        host = self.source.host_bytes(param)
        self.device_data = flat(param.data) if host is None and self.source.link is not None else None
        if self.bucket is not None and not self.bucket.holds(self.device_data):
            self.bucket = None  # the script gave the parameter other memory: its weights go back on their own
        if not self.shared:
            return
        loaded, self.loaded = self.loaded, None
        if host is None:
            self.shared, host = False, self.source.buffer(param.numel())
            loaded = flat(param.data) if loaded is None else loaded
        if loaded is not None:
            self.source.wait(self.source.ready(loaded))  # kernels of this step may still read the host bytes
            _copy(host, loaded)
        self.buffers[0] = host

    def adopt(self, master: torch.Tensor, param: torch.Tensor, bucket: FlatBucket) -> None:
        """`master` (its place in `bucket`: `flatten`) is the home's own master from now on, holding what its master
        holds (a shared home's, whose parameter has no host bytes: what `load` gave, else the weights)."""
        current = (flat(param.data) if self.loaded is None else self.loaded) if self.shared else self.buffers[0]
        _copy(master, current[:master.numel()])
        self.buffers[0], self.shared, self.loaded, self.bucket = master, False, None, bucket

    def update(self, grad: torch.Tensor, hp: Hyperparameters, step: int) -> None:
        """A bucket of one (the profile times single updates this way)."""
        launch([Update(self, grad, hp, step)])

    def quiesce(self) -> None:
        """Nothing to wait for: the host kernel finishes before run_update returns."""

    def run_update(self, grad: torch.Tensor, hp: Hyperparameters, step: int, ready=None) -> None:
        self.run_updates([Update(self, grad, hp, step)], ready)

    def run_updates(self, batch: list[Update], ready=None) -> None:
        """The updates of a bucket (homes of this driver and kernel): GPU gradients downloaded, the rest read in
        place, after one host wait (the last download, else `ready`) that precedes any write of a shared master;
        then one fused call per constants."""
        grads = [u.home.source.in_host(u.grad) for u in batch]
        last = None
        for i, u in enumerate(batch):
            if grads[i] is None:
                n = u.grad.numel()
                last = u.home.source.download_async(u.home.grad[:n], flat(u.grad), ready)
                grads[i] = u.home.grad[:n]
        if last is not None:
            self.source.finish(last)
        else:
            self.source.wait(ready)
        by_constants: dict[Hyperparameters, list[tuple[Update, torch.Tensor]]] = defaultdict(list)
        for u, g in zip(batch, grads):
            by_constants[u.hp].append((u, flat(g)))
        for hp, items in by_constants.items():
            states = [[b[:u.grad.numel()] for b in u.home.buffers] for u, _ in items]
            with spans.timed("host adam", "adam", 4 * FP32 * sum(u.grad.numel() for u, _ in items)):
                self.kernel.many([m for m, _, _ in states], [g for _, g in items], [a for _, a, _ in states],
                                 [v for _, _, v in states], hyperparameters=hp, steps=[u.step for u, _ in items])

    def copy_back(self, param: torch.Tensor) -> None:
        """The updated master into the parameter's host bytes (its data where it has none); nothing when shared or
        uploaded (`device_data`: `upload` sends it)."""
        if not self.shared and self.device_data is None:
            self.source.host_data(param).copy_(self.buffers[0][:param.numel()])

    def nbytes(self) -> int:
        """Host memory held: m, v, a master unless shared, and a GPU gradient's landing place."""
        return sum(b.nbytes for b in self._own()) + (self.grad.nbytes if self.grad is not None else 0)

    def _own(self) -> list[torch.Tensor]:
        """The state buffers the home itself holds: m and v, after its master unless shared."""
        return self.buffers[1:] if self.shared else self.buffers

    def host_buffers(self) -> list[torch.Tensor] | None:
        """master, m and v as host tensors, for NVMe staging to read into and write from directly (None when
        shared: the master is a parameter's, and staging bounces)."""
        return None if self.shared else self.buffers


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, nothing when they are the same memory (NVMe staging reads straight into a host home)."""
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)
