"""`hetero run` keeping the plan's GPU budget (`budget.gpu_memory`).

The CUDA allocator's reserved memory is capped at the budget on the model's GPU once the model is bound (a torchrun
worker picks its GPU before that), so a run that needs more than the plan promised fails as it would on a card of that
size, not passing on a bigger one. Its out-of-memory error then ends the run with one line naming the plan entry, the
predicted and the measured peak (reserved), exit code STALE_PLAN: never a traceback.
"""

from __future__ import annotations

import torch
from torch import nn

from hetero.errors import STALE_PLAN, HeteroError
from hetero.kernels import dha
from hetero.kernels.dha import Device
from hetero.run.mechanism import Mechanism
from hetero.schema.plan import Budget, Predicted
from hetero.units import SIZE

GPU = "gpu"  # the GPU's key in `predicted.peak` (hetero.plan.model.GPU)
ENTRY = "budget.gpu_memory"


def overrun_line(budget: int, predicted: int | None, measured: int) -> str:
    """`out of GPU memory under the plan's budget.gpu_memory 2.2GiB: predicted peak 2.06GiB, measured 2.2GiB ...`."""
    expected = f"predicted peak {SIZE.format_short(predicted)}" if predicted else "no predicted peak"
    return (f"out of GPU memory under the plan's {ENTRY} {SIZE.format_short(budget)}: {expected}, measured "
            f"{SIZE.format_short(measured)} reserved when an allocation failed")


class GpuBudget(Mechanism):
    """Caps the model's GPU at the plan's budget from bind to close; explains its overrun."""

    def __init__(self, budget: Budget, predicted: Predicted):
        self.budget = budget.gpu_memory_bytes
        self.predicted = predicted.peak_bytes.get(GPU)
        self.device: Device | None = None

    def bind(self, model: nn.Module) -> None:
        try:
            dha.devices.check()
        except HeteroError:
            return  # no GPU here: the sections that need one refuse the plan themselves
        self.device = dha.devices.for_model(model)
        self.device.limit(self.budget)

    def explain(self, error: BaseException) -> HeteroError | None:
        """The one-line error for an out-of-memory error of the capped GPU; None for anything else."""
        if self.device is None or not isinstance(error, torch.cuda.OutOfMemoryError):
            return None
        return HeteroError(overrun_line(self.budget, self.predicted, self.device.peak_reserved()),
                           hint="plan again with a larger --gpu-memory, or from a profile of this run (hetero profile, "
                                "then hetero plan)", exit_code=STALE_PLAN)

    def close(self) -> None:
        if self.device is not None:
            self.device.limit(None)
            self.device = None
