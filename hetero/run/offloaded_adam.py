"""The offloaded Adam(W) optimizer itself: mixed into torch's own classes for a run (hetero.run.optimizer), it
keeps each parameter's fp32 master weights and states in their homes (hetero.run.homes) and runs the updates there,
launched from the gradient hooks when they overlap backward, else from `step()`; `state_dict()` is torch's format."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hetero.errors import STALE_PLAN, UNSUPPORTED_SCRIPT, HeteroError
from hetero.harness.grads import GradEdits
from hetero.harness.script import StopScript
from hetero.kernels.adam import Hyperparameters
from hetero.run.homes import Homes, ParamState
from hetero.run.nvme_states import NvmeStaging, on_host
from hetero.run.states import FP32, Update, flatten, launch, upload
from hetero.run.torch_optim import ids, parameters, several_ranks, torch_step, updates_the_model
from hetero.schema.names import UPDATE_BUCKETS, UpdateBuckets, update_buckets


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Where an optimizer's states are: the bytes its homes hold on the device (`nbytes`: hetero.run.states), and 3
    fp32 buffers per parameter in NVMe files (master, m, v)."""

    device: int
    nvme: int
    params: int  # parameters placed so far (0 before the first step)


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """How a run's offloaded optimizers behave: the same for every one the script builds."""

    homes_for: Callable[[], Homes]  # the states' homes, from the plan's optimizer section
    on_first_use: Callable[[object], None]  # (optimizer): the runtime binds parameter names before the first update
    synced: Callable[[torch.nn.Parameter], bool]  # DDP averages its gradient; `bucket_synced` launches its update
    micro_batches: int = 1
    overlap: bool = False
    keep_grads: bool = False  # the plan's nvme.grads
    strict: bool = True  # False (the profile's): an optimizer hetero's Adam cannot replace stays torch's, unrefused


class Offloaded:
    """Mixed into torch's Adam/AdamW by `OptimizerOffload` (hetero.run.torch_optim.replace_adam), which gives the
    class its `config` and `replaces` (the torch class it stands in for) for the run."""

    config: OffloadConfig
    replaces: type

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._params: dict[torch.nn.Parameter, ParamState] = {}
        self._group_of: dict[torch.nn.Parameter, dict] = {}
        self._buckets: dict[torch.nn.Parameter, Bucket] = {}
        self._overlapped: list[list[Update]] = []  # buckets updated during backward: their weights go back in step()
        self._uploads: list = []  # (device, event) of the latest step's weights sent to device memory, per bucket
        self._homes: Homes | None = None
        self._flat = False  # the buckets' resident weights laid out flat (`_flatten`, at the first step)
        self._edits: GradEdits | None = None  # overlapped updates: gradients the script changes after backward
        self._pending_state: dict | None = None
        self._own = False  # True: an optimizer of parameters outside the planned model, left as torch's own
        self._unplaceable: str | None = None  # why hetero's Adam cannot take its place (amsgrad, bad constants)
        for group in self.param_groups:
            try:
                Hyperparameters.from_param_group(group)
            except HeteroError as e:
                self._own = not self.config.strict
                self._unplaceable = e.message
        # removed at close: the garbage collector cannot see a parameter's hook, which would keep the optimizer,
        # the runtime behind its config and the model alive after the run
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_final)
                       for group in self.param_groups for p in group["params"]
                       if p.requires_grad and (self.config.overlap or self.config.keep_grads)]

    def bind(self, names: dict[torch.nn.Parameter, str]) -> None:
        """Give the states their homes, once the runtime knows the model (`names`: the parameters the plan places).
        An optimizer of none of them stays torch's own; one mixing them with others is refused, as is one hetero's
        Adam cannot replace (amsgrad)."""
        if self._homes is not None or self._own:
            return
        order = parameters(self)
        if not updates_the_model(self, ids(names)):
            self._own = True
            return
        if self._unplaceable is not None:
            raise StopScript(HeteroError(
                f"{self._unplaceable}, but the plan offloads the script's {type(self).__name__}",
                hint="plan again from a profile of this script: hetero plan leaves such an optimizer to the script",
                exit_code=UNSUPPORTED_SCRIPT))
        self._homes = self.config.homes_for()
        self._params = self._homes.build([(names[p], p) for p in order])
        self._group_of = {p: group for group in self.param_groups for p in group["params"]}
        # in the model's order, which the planner's buckets follow (NVMe-staged states update one by one at step())
        self._buckets = buckets({p: n for p, n in names.items()
                                 if p in self._params and self._params[p].home is not None})
        if self.config.overlap:
            self._edits = GradEdits(self._params.keys, by_value=True)  # values: the first step's
        if self._pending_state is not None:
            self._apply_state(self._pending_state)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._edits is not None:
            self._edits.close()
        if self._homes is not None:
            self._settle_uploads()
            self._homes.close()

    def state_bytes(self) -> StateBytes:
        on_device = [s.home.nbytes() for s in self._params.values() if s.home is not None]
        in_files = [p.numel() for p, s in self._params.items() if s.home is None]
        return StateBytes(sum(on_device), 3 * FP32 * sum(in_files), len(self._params))

    def staging(self) -> NvmeStaging | None:
        """Where its states beyond the device's live on their way to and from NVMe (None: none, or not bound)."""
        return self._homes.staging if self._homes is not None else None

    def _grad_final(self, p: torch.nn.Parameter) -> None:
        if self._homes is None and not self._own:
            self.config.on_first_use(self)
        if self._own:
            return
        slot = self._params[p]
        slot.grads_seen += 1
        if slot.home is None and self.config.keep_grads and on_host(p):
            self._keep(p, slot)
        elif self.config.overlap and slot.grads_seen == self.config.micro_batches and slot.home is not None \
                and not self.config.synced(p):
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
        self._homes.staging.kept -= {slot.name for p, slot in self._params.items() if params is None or p in params}

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.forget_grads()

    def bucket_synced(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        """DDP averaged these gradients: launch the updates of those whose last micro-batch this was (the
        post-accumulate-grad hook counted it before DDP marked the parameter ready)."""
        for p, grad in zip(params, grads):
            slot = self._params.get(p)
            if slot is not None and slot.home is not None and slot.grads_seen == self.config.micro_batches:
                self._launch(p, slot, grad)

    def _launch(self, p: torch.nn.Parameter, slot: ParamState, grad: torch.Tensor, uploads: list | None = None) -> None:
        """`p`'s update joins its bucket, which goes to the drivers once complete (or at the step). In step()
        (`uploads` given) its weights go to device memory right after; else they wait in the masters until step()."""
        slot.step += 1
        slot.launched = True
        bucket = self._buckets[p]
        update = Update(slot.home, grad, Hyperparameters.from_param_group(self._group_of[p]), slot.step)
        with bucket.lock:  # DDP's buckets may complete on another thread than autograd's
            bucket.waiting.append(update)
            complete = bucket.take() if len(bucket.waiting) == bucket.size else None
        if complete:
            launch(complete, uploads)
            if uploads is None:
                self._overlapped.append(complete)  # one append: DDP's thread may complete a bucket meanwhile

    def step(self, closure=None):
        loss = None
        if closure is not None:  # first, as torch's Adam does: the script may call its model only in there
            with torch.enable_grad():
                loss = closure()
        if self._homes is None and not self._own:
            self.config.on_first_use(self)
        torch_step(self.replaces, self) if self._own else self._offloaded_step()
        return loss

    @torch.no_grad()
    def _offloaded_step(self) -> None:
        self._check_micro_batches()
        self._check_grads_unedited()
        if not self._flat:
            self._flatten()
        spilled, uploads = [], []
        kept = self._kept()
        for p, slot in self._params.items():
            if slot.home is not None:
                slot.home.attach(p)  # before any of this step's updates: a shared master is p's host bytes
            if (p.grad is None and slot.name not in kept) or slot.launched:
                continue
            if slot.home is None:
                slot.step += 1
                spilled.append((slot.name, p, p.grad, Hyperparameters.from_param_group(self._group_of[p]), slot.step))
            else:
                self._launch(p, slot, p.grad, uploads)
        for bucket in {id(b): b for b in self._buckets.values()}.values():
            with bucket.lock:
                left = bucket.take()
            if left:  # some of its parameters had no gradient this step
                launch(left, uploads)
        if spilled:
            self._homes.staging.update_all(spilled)
        self._homes.drain()
        overlapped, self._overlapped = self._overlapped, []
        for batch in overlapped:
            upload(batch, uploads)
        for link, done in uploads:  # the next kernels read the weights: the device waits, not the host
            link.compute_waits(done)
        self._uploads = uploads
        for p, slot in self._params.items():
            if slot.launched:
                slot.home.copy_back(p)
            slot.launched, slot.grads_seen = False, 0

    def _flatten(self) -> None:
        """Once, before the first step's homes attach, after the updates that overlapped backward (they wrote the
        masters): each bucket's resident weights and their masters in one buffer each (hetero.run.states.flatten)."""
        self._homes.drain()
        for bucket in {id(b): b for b in self._buckets.values()}.values():
            flatten([(p, self._params[p].home) for p, b in self._buckets.items() if b is bucket])
        self._flat = True

    def _check_micro_batches(self) -> None:
        if not self.config.overlap:
            return
        kept = self._kept()
        seen = {slot.grads_seen for p, slot in self._params.items() if p.grad is not None or slot.name in kept}
        if seen - {self.config.micro_batches}:
            raise StopScript(HeteroError(  # raised inside the script: its `except Exception` must not hide it
                f"the plan overlaps updates with the backward of micro-batch {self.config.micro_batches} of each "
                f"step, but this step had {max(seen)} backward pass(es)",
                hint="profile and plan again (the script's gradient accumulation changed), or pass --allow-stale "
                     "with a plan whose optimizer has overlap_backward: false", exit_code=STALE_PLAN))

    def _check_grads_unedited(self) -> None:
        """The gradients the overlapped updates used are the ones `step()` sees: else the run stops here, before
        the updated master weights reach the model (hetero.harness.grads)."""
        if self._edits is None:
            return
        if edited := self._edits.edited(p for p, slot in self._params.items() if slot.launched):
            raise StopScript(HeteroError(
                f"the script changed {len(edited)} gradient(s) between backward and step() (clipping, unscaling or "
                "an in-place op), after the plan's overlapped updates had used them", exit_code=STALE_PLAN,
                hint="profile and plan again (hetero plan then updates after backward), or set overlap_backward: "
                     "false under optimizer in the plan"))

    def _settle_uploads(self) -> None:
        """The host waits for the latest step's uploads, which read masters it is about to write or free."""
        for link, done in self._uploads:
            link.synchronize(done)
        self._uploads = []

    def _kept(self) -> set[str]:
        staging = self.staging()
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
        self._settle_uploads()
        for p, slot in self._params.items():
            if (s := loaded.get(p)) is None:
                continue
            slot.step = int(s["step"])
            master, m, v = (t.detach().reshape(-1).float().cpu() for t in (p.data, s["exp_avg"], s["exp_avg_sq"]))
            if slot.home is None:
                self._homes.staging.load(slot.name, master, m, v)
            else:
                slot.home.load(master, m, v)
        self._pending_state = None


@dataclass(eq=False, slots=True)
class Bucket:
    """Parameters whose updates go to the drivers together (hetero.run.states.launch), once all are final."""

    size: int
    waiting: list[Update]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> list[Update]:
        out, self.waiting = self.waiting, []
        return out


def buckets(names: dict[torch.nn.Parameter, str],
            policy: UpdateBuckets = UPDATE_BUCKETS) -> dict[torch.nn.Parameter, Bucket]:
    """Each parameter's bucket, `names` given in the model's order: by the rule the planner prices calls by
    (hetero.schema.names.update_buckets), whole modules in backward order up to the policy's size."""
    of = update_buckets([(name, p.numel()) for p, name in names.items()], policy)
    members: dict[int, list[torch.nn.Parameter]] = defaultdict(list)
    for p, name in names.items():
        members[of[name]].append(p)
    out = {}
    for params in members.values():
        out.update(dict.fromkeys(params, Bucket(len(params), [])))
    return out
