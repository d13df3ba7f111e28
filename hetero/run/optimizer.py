"""The offloaded Adam(W): the script's own `torch.optim.Adam`/`AdamW`, with its fp32 master weights and states where
the plan puts them (AXDIMM channels, host memory, NVMe) and its updates run there.

The classes subclass torch's, so argument parsing, defaults, param groups, LR schedulers and `isinstance` checks
are torch's own; only `step`, `state_dict` and `load_state_dict` differ, and `state_dict()` is torch's format.
With `overlap_backward`, each parameter's update is launched as soon as its gradient is final and synchronized:
from its post-accumulate-grad hook on the last micro-batch of the step, or, for a parameter of a DDP model, when
DDP's bucket holding it has been all-reduced (`DdpSync`), from the averaged gradient. Updates thus run while
backward continues; the parameters themselves change only in `step()`, as with torch.

With the plan's `nvme.grads`, the same hook sends each NVMe-held parameter's gradient to the store once it is final
and sets `.grad` to None (hetero.run.nvme_states); `step()` reads it back with the states. What could read
`.grad` in between is made to find it: torch's gradient clipping brings the kept gradients back first, and
`zero_grad` (the optimizer's or a module's) forgets them. A script that keeps gradients across steps without zeroing
them, or reads `.grad` itself between backward and step, is not trained the same way: such a plan is for scripts
that zero their gradients each step (the plan says so).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hetero.errors import STALE_PLAN, UNSUPPORTED_SCRIPT, HeteroError
from hetero.harness.layers import sharded
from hetero.harness.script import StopScript
from hetero.kernels.adam import Hyperparameters
from hetero.run.ddp_sync import DdpSync
from hetero.run.homes import Homes, ParamState
from hetero.run.nvme_states import on_host
from hetero.run.states import FP32, Update, launch
from hetero.schema.plan import OptimizerPlan
from hetero.units import SIZE


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Where an optimizer's states are. 4 fp32 buffers per parameter live on the device (master, m, v, gradient);
    3 in NVMe files (no gradient)."""

    device: int
    nvme: int
    params: int  # parameters placed so far (0 before the first step)


class Offloaded:
    """Mixed into torch's Adam/AdamW by `OptimizerOffload`, which sets the class attributes below for the run."""

    homes_for = None  # callable: OptimizerPlan-bound factory of Homes, set per run
    micro_batches = 1
    overlap = False
    on_first_use = None  # callable(optimizer): the runtime binds parameter names before the first update
    synced = None  # callable(param) -> bool: DDP averages its gradient, and `bucket_synced` launches its update
    keep_grads = False  # the plan's nvme.grads
    replaces = None  # the torch class this one stands in for
    strict = True  # False (the profile's): an optimizer hetero's Adam cannot replace stays torch's, unrefused

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._params: dict[torch.nn.Parameter, ParamState] = {}
        self._group_of: dict[torch.nn.Parameter, dict] = {}
        self._buckets: dict[torch.nn.Parameter, Bucket] = {}
        self._homes: Homes | None = None
        self._pending_state: dict | None = None
        self._own = False  # True: an optimizer of parameters outside the planned model, left as torch's own
        self._unplaceable: str | None = None  # why hetero's Adam cannot take its place (amsgrad, bad constants)
        for group in self.param_groups:
            try:
                Hyperparameters.from_param_group(group)
            except HeteroError as e:
                self._own = not self.strict
                self._unplaceable = e.message
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and (self.overlap or self.keep_grads):
                    p.register_post_accumulate_grad_hook(self._grad_final)

    def bind(self, names: dict[torch.nn.Parameter, str]) -> None:
        """Give the states their homes; called by the runtime once it knows the model. `names`: the parameters whose
        states the plan places. An optimizer none of whose parameters are among them (a model the plan leaves to
        the script, e.g. a GAN's other half) stays torch's own; one that mixes them with others cannot be placed
        and is refused, as is one hetero's Adam cannot take the place of (amsgrad)."""
        if self._homes is not None or self._own:
            return
        order = [p for group in self.param_groups for p in group["params"]]
        if not updates_the_model(self, order, names):
            self._own = True
            return
        if self._unplaceable is not None:
            raise StopScript(HeteroError(
                f"{self._unplaceable}, but the plan offloads the script's {type(self).__name__}",
                hint="plan again from a profile of this script: hetero plan leaves such an optimizer to the script",
                exit_code=UNSUPPORTED_SCRIPT))
        self._homes = self.homes_for()
        self._params = self._homes.build([(names[p], p) for p in order])
        self._group_of = {p: group for group in self.param_groups for p in group["params"]}
        self._buckets = buckets({p: names[p] for p, slot in self._params.items() if slot.home is not None})
        if self._pending_state is not None:
            self._apply_state(self._pending_state)

    def close(self) -> None:
        if self._homes is not None:
            self._homes.close()

    def state_bytes(self) -> StateBytes:
        on_device = [p.numel() for p, s in self._params.items() if s.home is not None]
        in_files = [p.numel() for p, s in self._params.items() if s.home is None]
        return StateBytes(4 * FP32 * sum(on_device), 3 * FP32 * sum(in_files), len(self._params))

    def _group(self, p: torch.nn.Parameter) -> dict:
        return self._group_of[p]

    def _grad_final(self, p: torch.nn.Parameter) -> None:
        if self._homes is None and not self._own:
            type(self).on_first_use(self)
        if self._own:
            return
        slot = self._params[p]
        slot.grads_seen += 1
        if slot.home is None and self.keep_grads and on_host(p):
            self._keep(p, slot)
        elif slot.grads_seen == self.micro_batches and slot.home is not None and not type(self).synced(p):
            self._launch(p, slot, p.grad)

    def _keep(self, p: torch.nn.Parameter, slot: ParamState) -> None:
        if several_ranks():
            raise StopScript(HeteroError(
                "the plan keeps gradients on NVMe (optimizer.nvme.grads), but this script trains on several ranks, "
                "whose gradient all-reduce needs them in memory", hint="set `grads: false` under optimizer.nvme, or "
                "plan again from a profile of this run", exit_code=STALE_PLAN))
        self._homes.staging.keep_grad(slot.name, p.grad)
        p.grad = None

    def bring_back_grads(self) -> None:
        """Every kept gradient back in `.grad`, as plain training would have it now."""
        if self._homes is None or self._homes.staging is None:
            return
        for p, slot in self._params.items():
            if slot.name in self._homes.staging.kept:
                p.grad = self._homes.staging.take_grad(slot.name, p)

    def forget_grads(self, params: set[torch.nn.Parameter] | None = None) -> None:
        """Drop the kept gradients of `params` (all: None): the script set those gradients to None or zero."""
        if self._homes is None or self._homes.staging is None:
            return
        kept = self._homes.staging.kept
        kept -= {slot.name for p, slot in self._params.items() if params is None or p in params}

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.forget_grads()

    def bucket_synced(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        """DDP averaged these gradients: launch the updates of those whose last micro-batch this was. The
        post-accumulate-grad hook (which counts micro-batches) runs inside AccumulateGrad, before DDP's own
        post-hook marks the parameter ready, so the count is current when the bucket completes."""
        for p, grad in zip(params, grads):
            slot = self._params.get(p)
            if slot is not None and slot.home is not None and slot.grads_seen == self.micro_batches:
                self._launch(p, slot, grad)

    def _launch(self, p: torch.nn.Parameter, slot: ParamState, grad: torch.Tensor) -> None:
        """`p`'s update joins its bucket, which goes to the drivers once it is complete (or at the step)."""
        slot.step += 1
        slot.launched = True
        bucket = self._buckets[p]
        update = Update(slot.home, grad, Hyperparameters.from_param_group(self._group(p)), slot.step)
        with bucket.lock:  # DDP's buckets may complete on another thread than autograd's
            bucket.waiting.append(update)
            complete = bucket.take() if len(bucket.waiting) == bucket.size else None
        if complete:
            launch(complete)

    def step(self, closure=None):
        if self._homes is None and not self._own:
            type(self).on_first_use(self)
        if self._own:
            return torch_step(self.replaces, self, closure)
        return self._offloaded_step(closure)

    @torch.no_grad()
    def _offloaded_step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_micro_batches()
        spilled = []
        kept = self._kept()
        for p, slot in self._params.items():
            if (p.grad is None and slot.name not in kept) or slot.launched:
                continue
            if slot.home is None:
                slot.step += 1
                spilled.append((slot.name, p, p.grad, Hyperparameters.from_param_group(self._group(p)), slot.step))
            else:
                self._launch(p, slot, p.grad)
        for bucket in {id(b): b for b in self._buckets.values()}.values():
            with bucket.lock:
                left = bucket.take()
            if left:  # some of its parameters had no gradient this step
                launch(left)
        if spilled:
            self._homes.staging.update_all(spilled)
        self._homes.drain()
        for p, slot in self._params.items():
            if slot.launched:
                slot.home.copy_back(p)
            slot.launched, slot.grads_seen = False, 0
        return loss

    def _check_micro_batches(self) -> None:
        if not self.overlap:
            return
        kept = self._kept()
        seen = {slot.grads_seen for p, slot in self._params.items() if p.grad is not None or slot.name in kept}
        if seen - {self.micro_batches}:
            raise StopScript(HeteroError(  # raised inside the script: its `except Exception` must not hide it
                f"the plan overlaps updates with the backward of micro-batch {self.micro_batches} of each step, but "
                f"this step had {max(seen)} backward pass(es)",
                hint="profile and plan again (the script's gradient accumulation changed), or pass --allow-stale "
                     "with a plan whose optimizer has overlap_backward: false", exit_code=STALE_PLAN))

    def _kept(self) -> set[str]:
        staging = self._homes.staging if self._homes is not None else None
        return set(staging.kept) if staging is not None else set()

    def state_dict(self) -> dict:
        """torch's Adam state_dict, read back from wherever the states live."""
        if self._own:
            return super().state_dict()
        if self._homes is not None:
            self._homes.drain()
        saved = self.state
        self.state = defaultdict(dict, {p: self._export(p, slot) for p, slot in self._params.items() if slot.step})
        try:
            return super().state_dict()
        finally:
            self.state = saved

    def _export(self, p: torch.nn.Parameter, slot: ParamState) -> dict:
        n = p.numel()
        if slot.home is None:
            exp_avg, exp_avg_sq = self._homes.staging.states(slot.name, n)
        else:
            exp_avg, exp_avg_sq = torch.empty(n), torch.empty(n)
            slot.home.store(torch.empty(n), exp_avg, exp_avg_sq)
        return {"step": torch.tensor(float(slot.step)), "exp_avg": exp_avg.view_as(p).to(p.device),
                "exp_avg_sq": exp_avg_sq.view_as(p).to(p.device)}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # torch's checks and casting; then the states move to their homes
        if self._own:
            return
        loaded, self.state = self.state, defaultdict(dict)
        if self._homes is None:
            self._pending_state = dict(loaded)
        else:
            self._apply_state(loaded)

    def _apply_state(self, loaded: dict) -> None:
        self._homes.drain()
        for p, slot in self._params.items():
            if p not in loaded:
                continue
            s = loaded[p]
            slot.step = int(s["step"])
            master, m, v = (t.detach().reshape(-1).float().cpu() for t in (p.data, s["exp_avg"], s["exp_avg_sq"]))
            if slot.home is None:
                self._homes.staging.load(slot.name, master, m, v)
            else:
                slot.home.load(master, m, v)
        self._pending_state = None


@dataclass(eq=False, slots=True)
class Bucket:
    """The parameters of one module: their updates go to the drivers together (hetero.run.states.launch)."""

    size: int
    waiting: list[Update]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> list[Update]:
        out, self.waiting = self.waiting, []
        return out


def buckets(names: dict[torch.nn.Parameter, str]) -> dict[torch.nn.Parameter, Bucket]:
    """Each parameter's bucket: the parameters its module owns directly (a Linear's weight and bias, whose gradients
    one backward node makes)."""
    by_module: dict[str, list[torch.nn.Parameter]] = defaultdict(list)
    for p, name in names.items():
        by_module[name.rpartition(".")[0]].append(p)
    out = {}
    for params in by_module.values():
        bucket = Bucket(len(params), [])
        out.update(dict.fromkeys(params, bucket))
    return out


_TORCH = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}  # before any run replaces them


class OptimizerOffload:
    """The plan's `optimizer` section: the script's Adam/AdamW become offloaded ones for the run."""

    def __init__(self, plan: OptimizerPlan, ddp: DdpSync, strict: bool = True):
        self.plan, self.ddp, self.strict = plan, ddp, strict
        self.optimizers: list[Offloaded] = []
        self.names: dict[torch.nn.Parameter, str] | None = None

    def install(self, patches, need_model) -> None:
        def first_use(opt: Offloaded) -> None:
            need_model(opt)  # binds every optimizer through bind() below
            opt.bind(self.names)

        settings = {"homes_for": staticmethod(lambda: Homes(self.plan)), "overlap": self.plan.overlap_backward,
                    "micro_batches": self.plan.micro_batches, "on_first_use": staticmethod(first_use),
                    "synced": staticmethod(self.ddp.synced), "keep_grads": self._keeps_grads(),
                    "strict": self.strict}
        if self.plan.overlap_backward:
            self.ddp.listen(self)
        replace_adam(patches, Offloaded, settings, self.optimizers,
                     lambda opt: opt.bind(self.names) if self.names is not None else None)
        refuse = refusing_clipping("the plan updates parameters during backward (overlap_backward)",
                                   "hetero plan turns overlap off for scripts that clip")
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            for name in ("clip_grad_norm_", "clip_grad_value_"):
                if self.plan.overlap_backward:
                    patches.set(owner, name, refuse)
                elif self._keeps_grads():
                    patches.set(owner, name, self._bringing_back(getattr(owner, name)))
        if self._keeps_grads():
            zero_grad = torch.nn.Module.zero_grad

            def module_zero_grad(module, set_to_none: bool = True) -> None:
                zero_grad(module, set_to_none)
                for opt in self.optimizers:
                    opt.forget_grads(set(module.parameters()))
            patches.set(torch.nn.Module, "zero_grad", module_zero_grad)

    def _keeps_grads(self) -> bool:
        return self.plan.nvme is not None and self.plan.nvme.grads

    def _bringing_back(self, clip):
        """torch's clip, after every kept gradient is back in `.grad` (clipping reads and scales them all)."""
        def clip_with_grads(*args, **kwargs):
            for opt in self.optimizers:
                opt.bring_back_grads()
            return clip(*args, **kwargs)
        return clip_with_grads

    def bucket_synced(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        for opt in self.optimizers:
            opt.bucket_synced(params, grads)

    def bind(self, model: torch.nn.Module) -> None:
        placed = {s.param for s in self.plan.states}  # several models: some optimizers may stay the script's
        if placed and sharded(model):
            raise HeteroError("the plan offloads the script's optimizer, but FSDP2 shards the model's parameters "
                              "across ranks (hetero's Adam places whole parameters)", exit_code=UNSUPPORTED_SCRIPT,
                              hint="plan again from a profile of this script: hetero plan leaves an FSDP2 model's "
                                   "optimizer to the script")
        self.names = {p: name for name, p in model.named_parameters() if name in placed}
        for opt in self.optimizers:
            opt.bind(self.names)

    def leave_to_torch(self) -> None:
        """Every optimizer, made or still to be made, stays torch's own (no parameter is the plan's)."""
        self.names = {}
        for opt in self.optimizers:
            opt.bind(self.names)

    def close(self) -> None:
        for opt in self.optimizers:
            opt.close()

    def _state_bytes(self) -> StateBytes:
        placed = [opt.state_bytes() for opt in self.optimizers]
        return StateBytes(sum(b.device for b in placed), sum(b.nvme for b in placed), sum(b.params for b in placed))

    def summary(self) -> list[str]:
        placed = self._state_bytes()
        if not placed.params:
            return []
        where = f"emulated AXDIMM ({self.plan.channels} channels)" if self.plan.device == "axdimm" else self.plan.device
        device, nvme = placed.device, placed.nvme
        grads = ", with the gradients from backward to step" if self._keeps_grads() else ""
        return [f"optimizer states: {SIZE.format_short(device)} on {where}, {SIZE.format_short(nvme)} on NVMe{grads}; "
                f"updates {'overlapped with' if self.plan.overlap_backward else 'after'} backward, in torch's fused "
                "AdamW arithmetic (bit-equal to fused=True; ~1 ULP per step from torch's default on CPU)"]


    def resident_bytes(self) -> dict[str, dict[str, int]]:
        placed = self._state_bytes()
        device, nvme = placed.device, placed.nvme
        # An emulated AXDIMM's channels are host memory (the plan counts them there too).
        on = "gpu" if self.plan.device == "gpu" else "host"
        what = "optimizer states (emulated AXDIMM)" if self.plan.device == "axdimm" else "optimizer states"
        held = {what: device}
        staging = [opt._homes.staging for opt in self.optimizers if opt._homes is not None]
        if self.plan.device == "host" and any(staging):
            held["nvme state staging"] = sum(s.host_bytes() for s in staging if s is not None)
        return {on: held, **({"nvme": {"optimizer states": nvme}} if nvme else {})}


def replace_adam(patches, mixin: type, settings: dict, created: list, built: Callable[[object], None]) -> None:
    """For the run, torch.optim.Adam and AdamW are subclasses with `mixin` and `settings` as class attributes (and
    `replaces`: the torch class); each one the script builds joins `created`, then goes to `built`. A HeteroError
    from its construction stops the script (its own `except Exception` must not hide it)."""
    def track(cls):
        def __init__(opt, *args, **kwargs):
            try:
                cls.__init__(opt, *args, **kwargs)
            except HeteroError as e:
                raise StopScript(e) from None
            created.append(opt)
            built(opt)
        return __init__

    for name, base in _TORCH.items():
        cls = type(name, (mixin, base), dict(settings, replaces=base, __module__=mixin.__module__, __qualname__=name))
        patches.set(torch.optim, name, type(name, (cls,), {"__init__": track(cls), "__module__": mixin.__module__}))


def updates_the_model(opt, params: list, model_params) -> bool:
    """Whether the plan's model is what `opt` updates: True for all of `params`, False for none (a second model's
    optimizer, e.g. a GAN's other half, stays torch's own); a mix cannot be planned and is refused."""
    outside = [p for p in params if p not in model_params]
    if outside and len(outside) < len(params):
        raise HeteroError(f"the script's {type(opt).__name__} also updates {len(outside)} parameter(s) outside "
                          "the planned model", exit_code=UNSUPPORTED_SCRIPT,
                          hint="make the parameters it updates submodules of the one model the script trains")
    return not outside


def several_ranks() -> bool:
    """The script trains on several ranks (a process group of more than one)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def torch_step(base: type, opt, closure=None):
    """torch's own `base.step` on `opt`, without the step hooks torch wraps it in (they run once per script step)."""
    step = base.step
    hooked = getattr(step, "hooked", False)  # torch.optim.Optimizer._patch_step_function's mark
    return step.__wrapped__(opt, closure) if hooked else step(opt, closure)


def refusing_clipping(why: str, hint: str) -> Callable:
    """A stand-in for torch's gradient clipping where the plan's updates ran before a clip could scale their
    gradients: it refuses rather than train differently."""
    def refuse(*args, **kwargs):
        raise StopScript(HeteroError(f"the script clips gradients, but {why}",
                                     hint=f"plan again from a profile of this script: {hint}",
                                     exit_code=STALE_PLAN))
    return refuse
