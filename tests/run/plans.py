"""Plans for tests, written by hand the way a user edits one (`hetero plan` makes real ones)."""

from torch import nn

from hetero.harness.capture import fingerprint
from hetero.schema.plan import Budget, NvmeOverflow, OptimizerPlan, Plan, Predicted, Source, StatePlacement


def optimizer_plan(model: nn.Module, *, device: str = "axdimm", channels: int = 2, overlap: bool = True,
                   micro_batches: int = 1, nvme: tuple[str, ...] = (), nvme_path: str = "/tmp",
                   kind: str = "adamw", grads: bool = False) -> Plan:
    """Every parameter round-robin over the channels (or on the host); the ones named in `nvme` on NVMe."""
    states = []
    for i, (name, _) in enumerate(model.named_parameters()):
        if name in nvme:
            states.append(StatePlacement(param=name, tier="nvme"))
        elif device == "axdimm":
            states.append(StatePlacement(param=name, tier="axdimm", channel=i % channels))
        else:
            states.append(StatePlacement(param=name, tier=device))
    opt = OptimizerPlan(kind=kind, device=device, backend="emulated" if device == "axdimm" else None,
                        channels=channels if device == "axdimm" else None, overlap_backward=overlap,
                        micro_batches=micro_batches, states=states,
                        nvme=NvmeOverflow(path=nvme_path, size_bytes=0, grads=grads) if nvme else None)
    return Plan(source=Source(profile="profile.yaml", profile_sha256="0" * 64, model_fingerprint=fingerprint(model)),
                budget=Budget(gpu_memory_bytes=None, dram_budget_bytes=None, reserve=1.0), layers=[], optimizer=opt,
                activations=None, routing=None, predicted=Predicted(iteration_s=0.0, peak_bytes={}),
                omitted={"layers": "test", "activations": "test", "routing": "test"})
