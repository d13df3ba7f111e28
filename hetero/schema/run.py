"""run.yaml: what `hetero run --trace` measured while it carried out a plan, for `hetero report` and
`hetero plan --from-run`. A layer's times mean what they mean in profile.yaml, so a run's layers can replace a
profile's; bytes per tier are the runtime's own accounting, under the plan's tier names.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.schema.fields import MAX_MICRO_BATCHES, MAX_STEPS, doc, unique_names
from hetero.schema.plan import ActivationPrediction
from hetero.units import SIZE, TIME


@dataclass(kw_only=True, slots=True)
class RunSource:
    """The plan the run carried out."""

    plan: str = doc("Path of the plan, as given to `hetero run`.")
    plan_sha256: str = doc("Hash of the plan's content.")
    model_fingerprint: str = doc("Fingerprint of the model the script built.")
    script: str = doc("The training script.")
    trace: str | None = doc("The Chrome trace written beside this file; null when none was.", default=None)


@dataclass(kw_only=True, slots=True)
class RunTiming:
    """The mean optimizer step of the recorded steps."""

    device: str = doc("Where the model computed: `cpu`, or the GPU's name.")
    warmup_steps: int = doc("Steps run before recording (allocation and first-touch costs land there).", ge=0,
                           le=MAX_STEPS)
    steps_recorded: int = doc("Steps recorded; every time here is their mean.", ge=1, le=MAX_STEPS)
    micro_batches: int = doc("Backward passes per optimizer step.", ge=1, le=MAX_MICRO_BATCHES)
    iteration_s: float = doc("Wall time from one step's end to the next one's.", unit=TIME)
    forward_s: float = doc("Forward time of one step, its micro-batches summed.", unit=TIME)
    backward_s: float = doc("Backward time of one step, its micro-batches summed.", unit=TIME)
    optimizer_step_s: float = doc("Time inside `optimizer.step()`.", unit=TIME)
    other_s: float = doc("The rest of the step: data loading, loss, `zero_grad`, between the micro-batches.",
                         unit=TIME)
    overhead: float = doc("Recording overhead: time spent in the recorder's hooks over step time (0.01 = 1%).",
                          ge=0)


@dataclass(kw_only=True, slots=True)
class RunLayer:
    """One layer as measured under the plan."""

    name: str = doc("Layer name, as in the profile.")
    fp_s: float = doc("Forward time of the layer itself (nested layers excluded).", unit=TIME)
    bp_s: float = doc("Backward time of the layer's region, from its backward start to the next one's.", unit=TIME)
    fp_end_s: float = doc("End of its forward, from the micro-batch's forward start.", unit=TIME)
    bp_start_s: float = doc("Start of its backward, from the micro-batch's forward start.", unit=TIME)
    saved_bytes: int | None = doc("Bytes autograd saved for it; null when activation tiering ran (its hooks own "
                                  "the saved tensors).", unit=SIZE)


@dataclass(kw_only=True, slots=True)
class StepEnd:
    """Bytes resident in each tier when a recorded step ended (the trace's counters at that moment)."""

    step: int = doc("Optimizer step number, from 1.", ge=1)
    at_s: float = doc("When it ended, from the trace's origin.", unit=TIME)
    resident_bytes: dict[str, int] = doc("Bytes in use by tier.", unit=SIZE)


@dataclass(kw_only=True, slots=True)
class ProcessPeaks:
    """What the whole process held at its peak by the end of the recorded steps: the figures a user pays for."""

    dram_peak_bytes: int = doc("Peak resident memory (the kernel's high-water mark, VmHWM).", unit=SIZE, ge=0)
    gpu_allocated_peak_bytes: int | None = doc("Peak of torch's allocated GPU memory; null without a GPU.",
                                               unit=SIZE, ge=0, default=None)
    gpu_reserved_peak_bytes: int | None = doc("Peak of GPU memory torch's caching allocator reserved; null without "
                                              "a GPU.", unit=SIZE, ge=0, default=None)


@dataclass(kw_only=True, slots=True)
class Run:
    """run.yaml: one run of a script under a plan, as measured."""

    source: RunSource = doc("What ran.")
    timing: RunTiming = doc("The mean recorded step.")
    peak_bytes: dict[str, int] = doc("Peak bytes the runtime's mechanisms held by tier over the recorded steps (their "
                                     "own count: `process` has what the process paid).", unit=SIZE)
    activations: ActivationPrediction | None = doc("Saved-activation bytes in the fast tier, with and without "
                                                   "the tiering that ran; null without tiering.", default=None)
    late_prefetches: int = doc("Saved tensors not back when backward needed them.", ge=0, default=0)
    steps: list[StepEnd] = doc("The recorded steps' ends.", default_factory=list)
    layers: list[RunLayer] = doc("Layers in forward order.")
    process: ProcessPeaks | None = doc("The whole process's peaks; null in runs recorded before hetero read them.",
                                       default=None)

    def problems(self) -> list[tuple[str, str]]:
        return unique_names(self.layers, "layers")
