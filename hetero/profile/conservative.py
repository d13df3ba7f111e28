"""The profile of a script whose plain training may not fit the budget it must keep: everything hetero can move
without a plan, moved, once the profile sees that plain training would not fit.

The script's Adam(W) is hetero's (hetero.run.optimizer) from its construction, acting as torch's own. At the first
gradient the model is known, and with it what plain training would add: a gradient and two Adam states per parameter
(`PLAIN_BYTES_PER_PARAM`), the multi-tensor step's temporaries (`STEP_SLACK_BYTES_PER_PARAM`) and the policy's
`profile_block_share` of the budget for the rest of backward. Under the budget less the plan's headroom the optimizer
stays torch's; otherwise every state, master copy and gradient waits on NVMe, and the profile says so, writes plain
training's peak as an estimate (`plain_estimate`) and reports hetero.profile.phases.MOVED to `progress`. Under
`profile_ample_share` of the budget (`ample`) the budget binds nothing. A first gradient before every optimizer's
model was called (a GAN) leaves the optimizers torch's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from hetero.plan.footprint import ADAM_STATE_BYTES_PER_PARAM
from hetero.plan.policy import POLICY
from hetero.profile import phases
from hetero.run import process_memory
from hetero.run.ddp_sync import DdpSync
from hetero.run.mechanism import Patches
from hetero.run.optimizer import OptimizerOffload
from hetero.schema.plan import NvmeOverflow, OptimizerPlan, StatePlacement
from hetero.units import COUNT, SIZE

GRAD_BYTES_PER_PARAM = 4
PLAIN_BYTES_PER_PARAM = GRAD_BYTES_PER_PARAM + ADAM_STATE_BYTES_PER_PARAM
STEP_SLACK_BYTES_PER_PARAM = 4


class Conservative:
    """The profile's optimizer: torch's, or everything it keeps on NVMe (`moved_params` > 0)."""

    def __init__(self, budget_bytes: int, nvme_dir: str, progress=lambda phase, done, total: None):
        self.budget_bytes, self.progress = budget_bytes, progress
        plan = OptimizerPlan(kind="adamw", device="host", overlap_backward=False,
                             nvme=NvmeOverflow(path=nvme_dir, size_bytes=0, grads=True))
        self.offload = OptimizerOffload(plan, DdpSync(), strict=False)
        self.patches = Patches()
        self.moved_params = self.moved_tensors = self.held_at_bind = 0
        self.left_to_torch = False  # the first gradient came before every optimizer's model was called
        self.ample = False  # plain training needs under POLICY.profile_ample_share of the budget

    def install(self, need_model, model_known: Callable[[], bool]) -> None:
        """`need_model(optimizer)` decides the model now (then `bind` is called); `model_known()` says whether it
        can be decided yet (where not, the optimizers stay torch's)."""
        def first_gradient(optimizer) -> None:
            if model_known():
                need_model(optimizer)
            else:
                self.left_to_torch = True
                self.offload.leave_to_torch()

        self.offload.install(self.patches, first_gradient)

    def bind(self, model: nn.Module) -> None:
        """Decide, now that the model is known, whether plain training would fit beside what the process holds."""
        if self.left_to_torch:
            return
        named = list(model.named_parameters())
        n = sum(p.numel() for _, p in named)
        self.held_at_bind = process_memory.resident_bytes()
        needed = self.held_at_bind + (PLAIN_BYTES_PER_PARAM + STEP_SLACK_BYTES_PER_PARAM) * n \
            + int(self.budget_bytes * POLICY.profile_block_share)
        fits = needed <= self.budget_bytes * (1 - POLICY.profile_headroom)
        self.ample = needed <= self.budget_bytes * POLICY.profile_ample_share
        if fits or not _movable(named):
            self.offload.leave_to_torch()
            return
        self.offload.plan = replace(self.offload.plan, states=[StatePlacement(param=name, tier="nvme")
                                                               for name, _ in named])
        self.moved_params, self.moved_tensors = n, len(named)
        self.offload.bind(model)
        self.progress(phases.MOVED, n, n)

    def held_bytes(self) -> int:
        """Host memory the moved optimizer holds: its staging slots and the state store's bounce buffers."""
        staging = self.offload.resident_bytes().get("host", {}).get("nvme state staging", 0)
        return staging + NvmeOverflow.STORE_THREADS * NvmeOverflow.STORE_CHUNK_BYTES

    def plain_estimate(self, measured_peak: int) -> int:
        """Plain training's peak, from the peak measured with the states and gradients moved."""
        if not self.moved_params:
            return measured_peak
        return measured_peak - self.held_bytes() + PLAIN_BYTES_PER_PARAM * self.moved_params

    def described(self) -> str:
        return (f"Adam states, fp32 master copies and gradients of {COUNT.format_short(self.moved_params)} "
                f"parameters on NVMe (plain training would have added "
                f"{SIZE.format_short(PLAIN_BYTES_PER_PARAM * self.moved_params)} to the "
                f"{SIZE.format_short(self.held_at_bind)} the process held at the first gradient)")

    def close(self) -> None:
        self.patches.restore()
        self.offload.close()


def _movable(named: list[tuple[str, torch.Tensor]]) -> bool:
    """What hetero's host Adam with NVMe states trains: contiguous fp32 parameters in host memory, on one process."""
    one_process = os.environ.get("WORLD_SIZE", "1") == "1"
    return one_process and all(p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
                               for _, p in named)
