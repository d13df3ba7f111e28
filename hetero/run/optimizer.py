"""The offloaded Adam(W): the script's own `torch.optim.Adam`/`AdamW`, with its fp32 master weights and states where the
plan puts them (AXDIMM channels, host memory, NVMe) and its updates run there.

The classes subclass torch's, so arguments, param groups, LR schedulers and `isinstance` are torch's; only `step`,
`state_dict` and `load_state_dict` differ, and `state_dict()` is torch's format. With `overlap_backward`, an update
starts once its gradient is final and synchronized (its post-accumulate-grad hook on the step's last micro-batch, or,
under DDP, when its bucket is all-reduced: `DdpSync`); the parameters still change only in `step()`. Without it the
updates run in `step()`, and host-held states write the parameter's own host bytes in place
(`OptimizerPlan.shares_master`, hetero.run.states.HostHome). A gradient the script changes after its overlapped update
ran stops the run at `step()` (hetero.harness.grads).

With the plan's `nvme.grads`, the same hook sends an NVMe-held parameter's final gradient to the store and sets `.grad`
to None (hetero.run.nvme_states); `step()` reads it back. torch's gradient clipping and GradScaler's unscale_ bring the
kept gradients back first, and `zero_grad` (the optimizer's or a module's) forgets them; such a plan is for scripts
that zero their gradients each step and do not read `.grad` between backward and step.
"""

from __future__ import annotations

import torch

from hetero.errors import UNSUPPORTED_SCRIPT, HeteroError
from hetero.harness.layers import sharded
from hetero.run.ddp_sync import DdpSync
from hetero.run.homes import Homes
from hetero.run.mechanism import Mechanism
from hetero.run.offloaded_adam import OffloadConfig, Offloaded, StateBytes
from hetero.run.torch_optim import replace_adam, replace_clipping
from hetero.schema.plan import OptimizerPlan
from hetero.units import SIZE


class OptimizerOffload(Mechanism):
    """The plan's `optimizer` section: the script's Adam/AdamW become offloaded ones for the run."""

    def __init__(self, plan: OptimizerPlan, ddp: DdpSync, strict: bool = True):
        self.plan, self.ddp, self.strict = plan, ddp, strict
        self.optimizers: list[Offloaded] = []
        self.names: dict[torch.nn.Parameter, str] | None = None

    def install(self, patches, need_model) -> None:
        def first_use(opt: Offloaded) -> None:
            need_model(opt)  # binds every optimizer through bind() below
            opt.bind(self.names)

        config = OffloadConfig(homes_for=lambda: Homes(self.plan), on_first_use=first_use, synced=self.ddp.synced,
                               micro_batches=self.plan.micro_batches, overlap=self.plan.overlap_backward,
                               keep_grads=self._keeps_grads(), strict=self.strict)
        if self.plan.overlap_backward:
            self.ddp.listen(self)
        replace_adam(patches, Offloaded, config, self.optimizers,
                     lambda opt: opt.bind(self.names) if self.names is not None else None)
        if self._keeps_grads():
            replace_clipping(patches, self._bringing_back)
            zero_grad = torch.nn.Module.zero_grad

            def module_zero_grad(module, set_to_none: bool = True) -> None:
                zero_grad(module, set_to_none)
                for opt in self.optimizers:
                    opt.forget_grads(set(module.parameters()))
            patches.set(torch.nn.Module, "zero_grad", module_zero_grad)

    def _keeps_grads(self) -> bool:
        return self.plan.nvme is not None and self.plan.nvme.grads

    def _bringing_back(self, clip):
        """torch's clip (or unscale), after every kept gradient is back in `.grad` (it reads and scales them all)."""
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
        grads = ", with the gradients from backward to step" if self._keeps_grads() else ""
        when = ("overlapped with backward (every step's gradients checked unchanged at step())"
                if self.plan.overlap_backward else "at step()")
        return [f"optimizer states: {SIZE.format_short(placed.device)} on {where}, {SIZE.format_short(placed.nvme)} "
                f"on NVMe{grads}; updates {when}, by torch's fused AdamW op (the arithmetic of AdamW(fused=True))"]

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        placed = self._state_bytes()
        # An emulated AXDIMM's channels are host memory (the plan counts them there too).
        on = "gpu" if self.plan.device == "gpu" else "host"
        what = "optimizer states (emulated AXDIMM)" if self.plan.device == "axdimm" else "optimizer states"
        held = {what: placed.device}
        staging = [s for opt in self.optimizers if (s := opt.staging()) is not None]
        if self.plan.device == "host" and staging:
            held["nvme state staging"] = sum(s.host_bytes() for s in staging)
        return {on: held, **({"nvme": {"optimizer states": placed.nvme}} if placed.nvme else {})}
