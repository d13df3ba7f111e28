"""plan.yaml: where every tensor lives and when it moves, as `hetero plan` decided and the user may edit.

`hetero run` carries a plan out and decides nothing itself. Every decision of the solver carries a `why` written as
a `# why:` comment; entries marked `pinned: true` are kept as written when re-planning. A section that is absent
(null, or no layers) says why in `omitted`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from hetero.schema.fields import MAX_CHANNELS, MAX_MICRO_BATCHES, MAX_RANK, doc, unique_names
from hetero.schema.profile import Backend
from hetero.units import SIZE, TIME

Mode = Literal["gfgb", "dha", "dfgb"]
GradPlace = Literal["gpu", "host"]
OptimizerDevice = Literal["axdimm", "host", "gpu"]
StateTier = Literal["axdimm", "nvme", "host", "gpu"]
SECTIONS = ("layers", "optimizer", "activations", "routing")


class LayerMode:
    """The words of `Mode`, a named constant each, for code that sets or compares a layer's mode. Plain strings taken
    from the `Literal`, not an `Enum`: every enumeration of the schema is a `Literal` of words, which the YAML
    boundary, docs/plan-format.md and content hashes read as they are, so plan files keep their words."""

    ALL: tuple[Mode, ...] = get_args(Mode)
    GFGB, DHA, DFGB = ALL  # what each means: `LayerPlan.mode`


class LayerGrad:
    """The words of `GradPlace`, a named constant each (as `LayerMode`'s)."""

    ALL: tuple[GradPlace, ...] = get_args(GradPlace)
    GPU, HOST = ALL


@dataclass(kw_only=True, slots=True)
class PlannedModel:
    """One of several models the plan is for."""

    name: str = doc("The script's name for it, as in the profile.")
    fingerprint: str = doc("Its own fingerprint.")


@dataclass(kw_only=True, slots=True)
class Source:
    """The profile this plan was solved from; `hetero run` refuses the plan when either hash no longer matches."""

    profile: str = doc("Path of the profile, as given to `hetero plan`.")
    profile_sha256: str = doc("Hash of the profile's content (not its formatting).")
    model_fingerprint: str = doc("The profiled model's fingerprint (`model.fingerprint` of the profile).")
    models: list[PlannedModel] = doc("The models, where the script trains several (`model.models` of the profile): "
                                     "`hetero run` finds each by its fingerprint, and layer and parameter names "
                                     "start with its name. Empty: one model.", default_factory=list)


@dataclass(kw_only=True, slots=True)
class Trial:
    """A candidate plan `hetero plan` ran in fresh processes under a DRAM budget before choosing
    (hetero.launch.trials), and what they measured (judged by hetero.plan.policy)."""

    levers: list[str] = doc("What the candidate turns on to keep the budget (hetero.plan.fit's levers: `allocator`, "
                            "`in_backward`, `states`, `grads`, `tiering`, `recompute`); empty: plain training.")
    blocks: int | None = doc("Blocks it recomputes; null: none.", default=None)
    predicted_bytes: int = doc("Its predicted peak of host memory, before the trial.", unit=SIZE, ge=0)
    peaks_bytes: list[int] = doc("Each process's peak, as a memory limit charges it (anonymous memory), once it "
                                 "settled; a process that reached the budget and stopped itself has none.", unit=SIZE)
    stopped: int = doc("Processes that reached the budget and stopped themselves.", ge=0)
    stop_bytes: int = doc("What they stopped themselves at: the budget, less what `hetero plan` held beside them "
                          "under the same memory limit.", unit=SIZE, ge=0)
    mapped_bytes: int = doc("The most file pages a process referenced in its steps, with its page tables: what a "
                            "limit charges beside the peak.", unit=SIZE, ge=0)
    step_s: float | None = doc("The processes' median step time; null: none settled.", unit=TIME)
    step_range_s: float = doc("The range of their step times.", unit=TIME, ge=0)
    mmap_threshold_bytes: int | None = doc("The `allocator` thresholds it ran with; null: malloc's defaults.",
                                           unit=SIZE, ge=0, default=None)
    system_s: float | None = doc("The processes' median time in the kernel per step (page faults, file I/O); "
                                 "null: not measured.", unit=TIME, default=None)


@dataclass(kw_only=True, slots=True)
class Budget:
    """The limits the plan was solved under."""

    gpu_memory_bytes: int | None = doc("GPU memory the plan may use; null: the whole device.", unit=SIZE)
    dram_budget_bytes: int | None = doc("Host memory the plan may use; null: what the profile measured.", unit=SIZE)
    reserve: float = doc("GO-MemFerry's reserve factor: the fraction of gradient bytes allowed to stay on the "
                         "GPU (1 keeps all, 0 writes all to host).", ge=0, le=1)
    grad_grid_bytes: int | None = doc("Step of the size grid the gradient-offload DP solved on (sizes rounded up "
                                      "to it, the reserve down); null without a GPU.", unit=SIZE, default=None)
    trials: list[Trial] = doc("The candidates `hetero plan` ran in fresh processes to keep a binding DRAM budget, "
                              "in the order it tried them; the plan is one a trial verified. Empty: none ran.",
                              default_factory=list, added=True)
    why: str = doc("Where the DRAM budget came from (the option, or the memory cgroup the profile ran in) and what "
                   "the plan turned on to keep the process's predicted peak under it.", default="", comment=True)


@dataclass(kw_only=True, slots=True)
class LayerPlan:
    """How one layer's parameters and gradients are placed on a GPU (MemFerry)."""

    name: str = doc("Layer name from the profile (of several models: it starts with its model's name, `netD.0`).")
    mode: Mode = doc("`gfgb`: copied to the GPU before forward; `dha`: the GPU reads it from pinned host memory; "
                     "`dfgb`: forward from host memory, copied to the GPU before backward.")
    grad: GradPlace = doc("Where backward writes the layer's gradients: `gpu`, or `host` (pinned, GO-MemFerry).")
    pinned: bool = doc("Keep this entry as written when re-planning.", default=False)
    why: str = doc("The numbers behind the decision.", default="", comment=True)

    def runs_plain(self) -> bool:
        """Placed as plain training places it: parameters and gradients on the GPU."""
        return self.mode == LayerMode.GFGB and self.grad == LayerGrad.GPU


@dataclass(kw_only=True, slots=True)
class StatePlacement:
    """Where one parameter's fp32 master copy, gradient and Adam states live."""

    param: str = doc("Qualified parameter name, as in `model.named_parameters()` (of several models: it starts with "
                     "its model's name, `netD.0.weight`; an optimizer of models without any here stays the script's).")
    tier: StateTier = doc("Device holding the states.")
    channel: int | None = doc("AXDIMM channel; null unless `tier: axdimm`.", ge=0, le=MAX_CHANNELS - 1, default=None)


@dataclass(kw_only=True, slots=True)
class NvmeOverflow:
    """The file-backed tier for optimizer states that do not fit on the device.

    The rule the planner and the runtime share: spilled states are updated through `STAGING_SLOTS` DRAM (or AXDIMM)
    slots, each as large as the largest spilled tensor, used in turn (one updating while the other is read or
    written back); slot k sits on channel `staging_channel(k, channels)`. A tensor trained in host memory (no GPU
    makes its gradient) is staged in pieces of at most `STAGING_PIECE_PARAMS` elements (Adam is elementwise), so
    its slots cost a few MiB whatever the largest tensor; the state store moves them through `STORE_THREADS` bounce
    buffers of `STORE_CHUNK_BYTES`."""

    STAGING_SLOTS: ClassVar[int] = 2
    STAGING_PIECE_PARAMS: ClassVar[int] = 1 << 18
    STORE_CHUNK_BYTES: ClassVar[int] = 1 << 20
    STORE_THREADS: ClassVar[int] = 3  # the store's 2 workers and the thread that calls it

    @staticmethod
    def staging_channel(slot: int, channels: int) -> int:
        return slot % channels

    path: str = doc("Directory for the state files (created 0600, removed at exit).")
    size_bytes: int = doc("Bytes of states placed there.", unit=SIZE)
    grads: bool = doc("The gradients of the parameters trained in host memory whose states are here wait here too, "
                      "from the moment each is final until `step()` reads it with the states: host memory holds "
                      "none between backward and step, and `.grad` is None meanwhile (a clip brings them back "
                      "first).", default=False)
    tier: str | None = doc("The profile's name of the tier `path` is on (hetero.schema.tiers: the NVMe role of the "
                           "run's memory accounting); null in plans written before it.", default=None)

    def problems(self) -> list[tuple[str, str]]:
        return [("path", "empty path (give a directory)")] if not self.path.strip() else []


@dataclass(kw_only=True, slots=True)
class OptimizerPlan:
    """Where Adam(W) keeps its states and runs (AXDIMM paper §5)."""

    kind: Literal["adam", "adamw"] = doc("The optimizer the script builds.")
    device: OptimizerDevice = doc("Where the update runs: the AXDIMM's channels, the host CPU, or the GPU.")
    backend: Backend | None = doc("AXDIMM backend (`emulated` here); null for host and gpu.", default=None)
    channels: int | None = doc("AXDIMM channels used; null for host and gpu.", ge=1, le=MAX_CHANNELS, default=None)
    overlap_backward: bool = doc("Update each parameter as soon as its gradient is final, during backward.")
    micro_batches: int = doc("Backward passes per optimizer step (the profile's gradient accumulation); "
                             "overlapped updates launch on the last.", ge=1, le=MAX_MICRO_BATCHES, default=1)
    nvme: NvmeOverflow | None = doc("Overflow tier; null when everything fits.", default=None)
    states: list[StatePlacement] = doc("Placement of every parameter's states.", default_factory=list)
    pinned: bool = doc("Keep this section as written when re-planning.", default=False)
    why: str = doc("The numbers behind the decision.", default="", comment=True)

    def shares_master(self, tier: str) -> bool:
        """The rule planner and runtime share: a parameter whose states live in host memory (`tier: host`) and whose
        update runs in `step()` (no `overlap_backward`) has no fp32 master copy of its own: its master is the
        parameter's own host bytes (a CPU parameter's data, or the pinned host copy behind a GPU parameter), which
        the update writes in place, 4 bytes a parameter fewer. Updates that overlap backward keep a master of their
        own, since the model's parameters must change only in `step()`; AXDIMM channels (reached by copies only) and
        NVMe staging slots keep theirs too."""
        return self.device == "host" and tier == "host" and not self.overlap_backward

    def problems(self) -> list[tuple[str, str]]:
        out = unique_names(self.states, "states", "param")
        if self.device == "axdimm" and (self.backend is None or self.channels is None):
            out.append(("device", "device axdimm needs `backend` and `channels`"))
        for i, s in enumerate(self.states):
            if (s.tier == "axdimm") != (s.channel is not None):
                out.append((f"states[{i}].channel", "a channel is set exactly when tier is axdimm"))
            elif s.channel is not None and self.channels is not None and s.channel >= self.channels:
                out.append((f"states[{i}].channel", f"channel {s.channel} out of range (channels: {self.channels})"))
            if s.tier == "nvme" and self.nvme is None:
                out.append((f"states[{i}].tier", "tier nvme needs the `nvme` section"))
        return out


@dataclass(kw_only=True, slots=True)
class Eviction:
    """TierTrain's decision for one layer's saved tensors (§5.3)."""

    layer: str = doc("Layer name from the profile (of several models: it starts with its model's name).")
    evict_bytes: int = doc("Saved bytes moved to the slow tier when the layer's forward ends (Eq. 6-7, 10).",
                           unit=SIZE)
    prefetch_at_s: float = doc("When to start bringing them back, from the iteration start (Eq. 8).", unit=TIME)
    prefetch_after: str | None = doc("Start the prefetch when this layer's backward starts (progress, not clock); "
                                     "null: by time alone.", default=None)
    pinned: bool = doc("Keep this entry as written when re-planning.", default=False)
    why: str = doc("The numbers behind the decision.", default="", comment=True)


@dataclass(kw_only=True, slots=True)
class ActivationPlan:
    """Where saved activations wait between a layer's forward and its backward (TierTrain).

    The rule the planner and the runtime share: with host memory the fast tier, the NVMe store under the slow tier
    moves data through `STORE_BOUNCES` bounce buffers of `STORE_CHUNK_BYTES` (its writer's and its reader's), which
    the process holds beside the activations: `STORE_BYTES` in all."""

    STORE_CHUNK_BYTES: ClassVar[int] = 8 << 20
    STORE_BOUNCES: ClassVar[int] = 2
    STORE_BYTES: ClassVar[int] = STORE_BOUNCES * STORE_CHUNK_BYTES

    fast: str = doc("Tier the layers compute in: a profile tier name, or `gpu` for GPU memory.")
    slow: str = doc("Tier evicted tensors wait in.")
    slow_path: str | None = doc("Directory of the slow tier when it is file-backed (the profile tier's `path`); "
                                "null for a memory tier, or to let `hetero run` use the system temp directory.",
                                default=None)
    stay_time_s: float = doc("Least time an evicted tensor stays in the slow tier (TierTrain's ST).", unit=TIME)
    min_tensor_bytes: int = doc("Tensors smaller than this are never evicted.", unit=SIZE)
    schedule: list[Eviction] = doc("Evictions, in forward order.")
    why: str = doc("The numbers behind the decision.", default="", comment=True)

    def problems(self) -> list[tuple[str, str]]:
        out = unique_names(self.schedule, "schedule", "layer")
        if self.fast == self.slow:
            out.append(("slow", f"slow tier {self.slow!r} is the fast tier"))
        if self.slow_path is not None and not self.slow_path.strip():
            out.append(("slow_path", "empty path (give a directory, or null for the system temp directory)"))
        return out


@dataclass(kw_only=True, slots=True)
class RoutingPlan:
    """COARSE's routing of data-parallel gradient synchronization (§III-E/F)."""

    threshold_bytes: int = doc("Tensors up to this size take the latency path, larger ones the bandwidth path.",
                               unit=SIZE)
    latency_peer: int = doc("Rank whose link has the lowest latency.", ge=0, le=MAX_RANK)
    bandwidth_peer: int = doc("Rank whose link has the highest bandwidth.", ge=0, le=MAX_RANK)
    shard_bytes: int = doc("Large tensors are split into shards of this size and pipelined.", unit=SIZE)
    dual_sync_bytes: int = doc("Bytes of the first layers' gradients synchronized directly and first, as the "
                               "next forward needs them first (COARSE's n - m).",
                               unit=SIZE)
    pinned: bool = doc("Keep this section as written when re-planning.", default=False)
    why: str = doc("The numbers behind the decision.", default="", comment=True)


@dataclass(kw_only=True, slots=True)
class AllocatorPlan:
    """How the process's C allocator (glibc malloc) hands memory back: the runtime sets these with `mallopt` before the
    script runs, so that the memory freed tensors leave is returned to the kernel instead of kept in the heap (glibc's
    default keeps it, and a memory limit counts it); `hetero run` starts the process asking glibc for transparent huge
    pages, which makes mapping the blocks again cheaper (unless GLIBC_TUNABLES sets glibc.malloc.hugetlb already)."""

    # The thresholds a plan returns freed memory at, least memory kept first: the profile measures at the first;
    # `hetero plan` tries the next in a trial where the last one's processes spent time in the kernel (page faults)
    # that could pay for the blocks the rung recomputes (hetero.plan.fit).
    RUNGS: ClassVar[tuple[int, ...]] = (128 << 10, 1 << 20, 8 << 20)
    RETURNING: ClassVar[int] = RUNGS[0]

    mmap_threshold_bytes: int = doc("Blocks at least this large are mapped on their own and unmapped when freed "
                                    "(M_MMAP_THRESHOLD).", unit=SIZE, ge=0)
    trim_threshold_bytes: int = doc("Free memory above this at the top of a heap is returned (M_TRIM_THRESHOLD).",
                                    unit=SIZE, ge=0)
    from_bytes: int | None = doc("Keep malloc's defaults until the process's resident memory reaches this, then "
                                 "set the thresholds and return what is free (a thread watches it): below it, no "
                                 "page faults are paid; null: from the start.", unit=SIZE, ge=0, default=None)
    why: str = doc("The numbers behind the decision.", default="", comment=True)


@dataclass(kw_only=True, slots=True)
class UpdateInBackward:
    """The script's own Adam(W) updates each parameter from its post-accumulate-grad hook, as soon as backward makes its
    gradient final, and the gradient is freed there: host memory never holds every gradient at once (MemFerry's "a
    gradient leaves when it is final", with nowhere to go but the update). torch's own arithmetic on each parameter
    alone, a large one in pieces of at most 1 MiB (below the `allocator`'s mmap threshold where there is one) so that
    Adam's temporaries are a piece's size, so the weights are plain training's bit for bit; for a script that runs one
    backward per step, does not clip, and reads no `.grad` between backward and step (`.grad` is None then)."""

    kind: Literal["adam", "adamw"] = doc("The optimizer the script builds.")
    why: str = doc("The numbers behind the decision.", default="", comment=True)


@dataclass(kw_only=True, slots=True)
class RecomputePlan:
    """Activation checkpointing of chosen blocks: the runtime runs each one's forward through
    `torch.utils.checkpoint.checkpoint(use_reentrant=False)` (its RNG state preserved, as torch does by default), so
    that backward recomputes the block's saved tensors from its inputs instead of keeping them: less memory for one
    more forward of the block. Only blocks the profile found recomputable (the same output from the same RNG state,
    no buffer changed)."""

    blocks: list[str] = doc("Module paths of the blocks recomputed, in forward order.")
    why: str = doc("The numbers behind the decision, and the blocks left out.", default="", comment=True)


@dataclass(kw_only=True, slots=True)
class ActivationPrediction:
    """Saved-activation bytes resident in the fast tier over one iteration, with and without tiering."""

    avg_fast_bytes: int = doc("Time-averaged, with the schedule.", unit=SIZE)
    peak_fast_bytes: int = doc("Peak, with the schedule.", unit=SIZE)
    avg_fast_untiered_bytes: int = doc("Time-averaged, without tiering.", unit=SIZE)
    peak_fast_untiered_bytes: int = doc("Peak, without tiering.", unit=SIZE)


@dataclass(kw_only=True, slots=True)
class Predicted:
    """What the simulator predicts for one iteration under this plan."""

    iteration_s: float = doc("Iteration time.", unit=TIME)
    sync_s: float | None = doc("Gradient synchronization time of one iteration, all tensors summed; null for one "
                               "process.", unit=TIME, default=None)
    peak_bytes: dict[str, int] = doc("Peak bytes used in each memory tier, by tier name.", unit=SIZE)
    activations: ActivationPrediction | None = doc("Saved-activation residency; null without a schedule.",
                                                   default=None)
    dram: dict[str, int] = doc("What makes up the predicted host-memory peak (`peak` of the host tier is this sum "
                               "less `dram_saved`): plain training's measured peak and what the plan adds there; "
                               "`hetero run` names the largest when the process nears the budget.", unit=SIZE,
                               default_factory=dict)
    dram_saved: dict[str, int] = doc("What the plan moves out of host memory, by what it is.", unit=SIZE,
                                     default_factory=dict)
    gpu: dict[str, int] = doc("What makes up the predicted GPU peak (`peak` of `gpu` is this sum less `gpu_saved`): "
                              "what the plan keeps on the GPU in the phase of the step where it holds the most "
                              "(forward, backward or the optimizer's step; an entry names its phase), and what plain "
                              "training's measured reserved peak holds beyond the same count; empty without a GPU.",
                              unit=SIZE, default_factory=dict)
    gpu_saved: dict[str, int] = doc("What the plan takes off that phase's count: saved activations evicted to host "
                                    "memory (and plain training's count beyond its measured peak, where it is).",
                                    unit=SIZE, default_factory=dict)


@dataclass(kw_only=True, slots=True)
class Plan:
    """plan.yaml: the placement and schedule `hetero run` enforces."""

    source: Source = doc("The profile the plan was solved from.")
    budget: Budget = doc("The limits it was solved under.")
    layers: list[LayerPlan] = doc("Per-layer GPU modes, in forward order; empty without a GPU.")
    optimizer: OptimizerPlan | None = doc("Optimizer state placement; null leaves the script's optimizer as is.")
    activations: ActivationPlan | None = doc("Saved-activation tiering; null: none.")
    routing: RoutingPlan | None = doc("Gradient-sync routing; null for one process.")
    predicted: Predicted = doc("The simulator's prediction.")
    omitted: dict[str, str] = doc("Why each absent section is absent, by section name.", default_factory=dict)
    allocator: AllocatorPlan | None = doc("glibc malloc's settings for the run; null: its defaults.", default=None)
    update_in_backward: UpdateInBackward | None = doc("The script's own optimizer steps each parameter during "
                                                      "backward; null: in `step()`, as the script does.",
                                                      default=None)
    recompute: RecomputePlan | None = doc("Blocks whose saved tensors backward recomputes; null: none.", default=None,
                                          added=True)

    def runs_plain(self) -> bool:
        """Nothing to carry out: no section moves anything (layers all `gfgb` with gradients on the GPU, and an
        optimizer, if any, on the GPU: the script's own), and no budget to keep at run time."""
        return (all(e.runs_plain() for e in self.layers)
                and (self.optimizer is None or self.optimizer.device == "gpu") and self.activations is None
                and self.routing is None and self.allocator is None and self.update_in_backward is None
                and self.recompute is None and self.budget.dram_budget_bytes is None
                and self.budget.gpu_memory_bytes is None)

    def problems(self) -> list[tuple[str, str]]:
        out = unique_names(self.layers, "layers")
        for key in self.omitted:
            if key not in SECTIONS:
                out.append((f"omitted.{key}", f"unknown section {key!r} (sections: {', '.join(SECTIONS)})"))
        for section in SECTIONS:
            value = getattr(self, section)
            if (value is None or value == []) and section not in self.omitted:
                out.append((section, f"{section} is empty; say why under `omitted: {{{section}: ...}}`"))
        if self.update_in_backward is not None and self.optimizer is not None:
            out.append(("update_in_backward", "the `optimizer` section replaces the script's optimizer; update in "
                                              "backward only with `optimizer: null`"))
        return out
