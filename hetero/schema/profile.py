"""profile.yaml: what `hetero profile` measured about the machine and about every layer of the model.

A layer's times are per micro-batch, from the start of its forward, averaged over the measured micro-batches;
quantities are in base units (bytes, seconds, bytes/s). A value that could not be measured is null, and
`unmeasured` says why: nothing here is invented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetero.schema.fields import (
    MAX_CHANNELS,
    MAX_CORES,
    MAX_LAYERS,
    MAX_LINK,
    MAX_MICRO_BATCHES,
    MAX_RANK,
    MAX_STEPS,
    doc,
    unique_names,
)
from hetero.units import COUNT, PARAM_RATE, RATE, SIZE, TIME

Granularity = Literal["module", "block"]
TierKind = Literal["hbm", "dram", "numa", "cxl", "nvme"]
Backend = Literal["emulated", "hardware"]
CommBackend = Literal["gloo", "nccl"]
OptimizerKind = Literal["adam", "adamw", "other", "none"]
AdamImplementation = Literal["single", "foreach", "fused"]
StepsFrom = Literal["optimizer", "backward"]
ROOT_LAYER = "(model)"  # the layer of parameters the model's root module owns directly


@dataclass(kw_only=True, slots=True)
class CurvePoint:
    """One point of a transfer-time curve: moving `size` bytes took `time`."""

    size_bytes: int = doc("Bytes moved in one transfer.", unit=SIZE)
    time_s: float = doc("Median time of that transfer over the repeats.", unit=TIME)


@dataclass(kw_only=True, slots=True)
class TrainedModel:
    """One of several models a script trains (a GAN's generator and discriminator)."""

    name: str = doc("The script's name for it (its variable), or its class name; its layers' and parameters' names "
                    "start with it (`netD.0.weight`).")
    type: str = doc("Module class.")
    fingerprint: str = doc("Its own fingerprint, as `model.fingerprint` of a profile of it alone.")
    num_params: int = doc("Its parameters.", unit=COUNT)


@dataclass(kw_only=True, slots=True)
class ModelInfo:
    """Which model was profiled; `hetero run` refuses a plan made for another one."""

    fingerprint: str = doc("`sha256:` hash over (name, shape, dtype) of every parameter, in order.")
    script: str = doc("The training script, as given to `hetero profile`.")
    args: list[str] | None = doc("The script's arguments, as given to `hetero profile`: `hetero plan` runs the script "
                                 "with them to measure a plan under a DRAM budget; null: not recorded (an older "
                                 "profile).", default=None, added=True)
    cwd: str | None = doc("The directory `hetero profile` ran the script in, where `hetero plan` runs it too.",
                          default=None, added=True)
    num_params: int = doc("Parameters the optimizer owns.", unit=COUNT)
    dtype: str = doc("Parameter dtype, e.g. `float32` (the most common one when mixed).")
    models: list[TrainedModel] = doc("The models, where the script trains several (each with its own optimizer): "
                                     "`fingerprint` and `num_params` are then over all of them, and each layer "
                                     "names its model. Empty: one model.", default_factory=list)
    sharded: bool = doc("The model's parameters are sharded across ranks (FSDP2's `fully_shard`, DTensor): the "
                        "optimizer and the gradient reduction stay the script's (FSDP2's).", default=False)


@dataclass(kw_only=True, slots=True)
class ScriptOptimizer:
    """One optimizer the script steps."""

    name: str = doc("The script's name for it (its variable), or its class name.")
    kind: OptimizerKind = doc("Its class: `adam`, `adamw`, or `other`.")
    model: str = doc("The model whose parameters it updates (a name of `model.models`).")
    num_params: int = doc("Parameters it updates.", unit=COUNT)
    kept: str | None = doc("Why hetero's Adam cannot take its place, so that it stays the script's; null: it can.",
                           default=None)
    implementation: AdamImplementation = doc(
        "How torch steps it: `single` (tensor by tensor: temporaries the size of one parameter), `foreach` (a group "
        "at once: scratch the size of every parameter it updates; torch's default on a GPU) or `fused` (none).",
        default="single", added=True)


@dataclass(kw_only=True, slots=True)
class Training:
    """How the script trains, and the mean cost of one optimizer step."""

    optimizer: OptimizerKind = doc("The optimizer class the script built; only Adam and AdamW can be offloaded. "
                                   "`other`: another class, or one hetero's Adam cannot take the place of; `none`: "
                                   "the script updates its parameters without a torch.optim optimizer. Several "
                                   "optimizers: the class of those that can be offloaded, if they share one.")
    grad_accumulation: int = doc("Backward passes per optimizer step.", ge=1, le=MAX_MICRO_BATCHES)
    edits_grads: bool = doc("Whether the script changes gradients between the end of backward and `step()`: "
                            "clipping, unscaling, or any in-place op on or replacement of `.grad`.")
    warmup_steps: int = doc("Steps run before measuring.", ge=0, le=MAX_STEPS)
    steps_measured: int = doc("Steps measured; every time here is their mean.", ge=1, le=MAX_STEPS)
    granularity: Granularity = doc("`module`: a layer per module owning parameters; `block`: per repeated block.")
    iteration_s: float = doc("Wall time of one optimizer step, all micro-batches included.", unit=TIME)
    forward_s: float = doc("Forward time of one optimizer step.", unit=TIME)
    backward_s: float = doc("Backward time of one optimizer step.", unit=TIME)
    optimizer_step_s: float = doc("Time of `optimizer.step()`.", unit=TIME)
    overhead: float = doc("Profiling overhead: step time with the profiler's hooks over step time without, "
                          "minus one (0.03 = 3% slower while measured).", ge=0)
    plain_iteration_s: float | None = doc(
        "Wall time of one optimizer step of plain training: the median of the warm-up steps after the first, "
        "without the profiler's hooks (on a GPU they leave launch gaps that `iteration` includes). The planner "
        "predicts a GPU plan's iteration as this plus what the plan changes in simulation; null: not measured "
        "(a CPU, or one warm-up step).", unit=TIME, default=None)
    steps_from: StepsFrom = doc("What marks a step: `optimizer`, the end of `step()` of the first optimizer to step; "
                                "`backward`, the end of a backward call (a script without a torch.optim optimizer: "
                                "its own update is then part of the iteration, and `optimizer_step` is 0).",
                                default="optimizer")
    updates_wait: str | None = doc("Why the updates must wait for the whole backward, besides clipping (several "
                                   "optimizers: each model's gradients also accumulate in another's backward); "
                                   "null: nothing else makes them wait.", default=None)
    optimizers: list[ScriptOptimizer] = doc("Every optimizer of the model(s) the script steps, the first to step "
                                            "first. Empty: none, or a profile made before hetero listed them.",
                                            default_factory=list)
    output_bytes: int = doc("Bytes of the tensors the model's training forward returns with gradients (an LM's "
                            "logits): the loss's backward holds about three times that at backward's start "
                            "(hetero.plan.backward); 0: not measured (a compiled model, or a script of several "
                            "models).", unit=SIZE, ge=0, default=0, added=True)


@dataclass(kw_only=True, slots=True)
class Cpu:
    """The host processor and its memory bandwidth."""

    model: str = doc("Processor model name.")
    cores: int = doc("Cores this process may run on.", ge=1, le=MAX_CORES)
    dram_bandwidth_bytes_per_s: float = doc("Host memory copy bandwidth with all cores.", unit=RATE)
    adam_params_per_s: float | None = doc("Adam throughput of the `host` optimizer device as the runtime drives it "
                                          "(hetero's kernel on one driver thread), on states of at most 64 MiB, "
                                          "which a large last-level cache holds.", unit=PARAM_RATE)
    adam_launch_s: float | None = doc("Fixed cost of one call there, whatever its size: handing it to the driver, "
                                      "one fused Adam call and waiting for it, timed on small updates. The runtime "
                                      "makes one call per bucket (whole modules' parameters, up to a size); null: "
                                      "not measured (older profiles).", unit=TIME, ge=0, default=None)
    adam_beyond_cache_params_per_s: float | None = doc(
        "`adam` on states (16 B/param: fp32 master copy, m, v, gradient) 4 times `last_level_cache` (512 MiB where "
        "no cache is reported; under a budget at most what it leaves the measurements), which no cache holds: the "
        "rate of a step whose states exceed the cache; null: not measured (older profiles): `adam` holds.",
        unit=PARAM_RATE, default=None, added=True)
    last_level_cache_bytes: int | None = doc("The last-level caches of the cores this process may run on, summed over "
                                             "distinct caches, as /sys reports them: host Adam runs at "
                                             "`adam_beyond_cache` for a model whose states exceed them; null: not "
                                             "reported (or an older profile): every model's do.", unit=SIZE, ge=0,
                                             default=None, added=True)
    background_slowdown: float | None = doc(
        "Compute time on all cores while one host worker thread streams memory, over compute time alone (1: workers "
        "do not slow compute); null: not measured. Without a GPU the planner stretches compute by it while "
        "evictions, prefetches and AXDIMM or host Adam updates run beside it.", ge=1, default=None)
    adam_cpu: float | None = doc("How much the host Adam driver slows compute on the cores while it updates, as a "
                                 "share of `background_slowdown`; null: not measured (a GPU computes): taken as 1.",
                                 ge=0, le=1, default=None)
    adam_beside_compute_params_per_s: float | None = doc(
        "`adam` while the model computes on all cores; null: not measured (a GPU computes): `adam` holds.",
        unit=PARAM_RATE, default=None)
    adam_launch_beside_compute_s: float | None = doc("`adam_launch` the same way.", unit=TIME, ge=0, default=None)
    hook_pair_s: float | None = doc("Host time of a module's forward pre-hook and forward hook, both Python: what "
                                    "the runtime's per-layer work costs the thread that runs the model; null: not "
                                    "measured (older profiles).", unit=TIME, ge=0, default=None)
    saved_tensor_s: float | None = doc("Host time of one saved tensor's trip through Python pack and unpack hooks "
                                       "(activation tiering's per-tensor work); null: not measured.", unit=TIME,
                                       ge=0, default=None)


@dataclass(kw_only=True, slots=True)
class NumaNode:
    """A NUMA node of the host."""

    node: int = doc("Node id, as in /sys/devices/system/node.", ge=0, le=MAX_CORES)
    memory_bytes: int = doc("Memory of the node.", unit=SIZE)


@dataclass(kw_only=True, slots=True)
class Pcie:
    """The GPU's PCIe link as NVML reports it."""

    generation: int = doc("Current link generation.", ge=1, le=MAX_LINK)
    width: int = doc("Current link width (lanes).", ge=1, le=MAX_LINK)
    max_generation: int = doc("Highest generation the link supports.", ge=1, le=MAX_LINK)
    max_width: int = doc("Highest width the link supports.", ge=1, le=MAX_LINK)


@dataclass(kw_only=True, slots=True)
class Gpu:
    """The CUDA device training runs on, and its links to host memory."""

    name: str = doc("Device name.")
    uuid: str = doc("Device UUID (the key NVML and CUDA_VISIBLE_DEVICES agree on).")
    memory_bytes: int = doc("Device memory.", unit=SIZE)
    pcie: Pcie | None = doc("PCIe link, null when NVML cannot tell.")
    h2d: list[CurvePoint] = doc("Pinned host-to-device copy time by size (MemFerry's T_trans).")
    d2h: list[CurvePoint] = doc("Device-to-pinned-host copy time by size.")
    dha_read_bytes_per_s: float | None = doc("Bandwidth of kernels reading pinned host memory directly (DHA).",
                                             unit=RATE)
    dha_write_bytes_per_s: float | None = doc("Bandwidth of kernels writing pinned host memory directly.",
                                              unit=RATE)
    event_s: float | None = doc("Host time of recording a CUDA event on one stream and making another wait for it: "
                                "every ordered hand-off the runtime makes (a copy's wait, a gradient's download); "
                                "null: not measured (older profiles).", unit=TIME, ge=0, default=None)


@dataclass(kw_only=True, slots=True)
class Tier:
    """A memory tier tensors can live in, with its measured transfer rates."""

    name: str = doc("Name plans use to refer to the tier, e.g. `dram`, `nvme0`.")
    kind: TierKind = doc("What the tier is.")
    capacity_bytes: int = doc("Space hetero may use in the tier.", unit=SIZE)
    path: str | None = doc("Directory of a file-backed tier; null for memory tiers.", default=None)
    read: list[CurvePoint] = doc("Time to read (prefetch into the fast tier) by size.", default_factory=list)
    write: list[CurvePoint] = doc("Time to write (evict from the fast tier) by size.", default_factory=list)
    emulated: bool = doc("True when the tier is emulated on other hardware.", default=False)
    read_cpu: float | None = doc("How much a worker reading from the tier slows compute on the cores, as a share of "
                                 "`cpu.background_slowdown` (0: not at all, 1: like a thread streaming memory); "
                                 "null: taken as 1. A disk's is measured on whole trips (write, read back, delete), "
                                 "so it equals `write_cpu`: from the script's own steps with every layer's "
                                 "activations tiered to the disk (their extra time per second the workers were "
                                 "busy) where the script ran long enough, else beside a GEMM loop.",
                                 ge=0, le=1, default=None)
    write_cpu: float | None = doc("The same for a worker writing to the tier; null: taken as 1.", ge=0, le=1,
                                  default=None)
    read_beside_compute: list[CurvePoint] = doc(
        "Time to read by size while the model computes on all cores, the worker sharing the cores with it: what "
        "the planner times reads by when the CPU computes; for a disk it includes deleting the file the tensor "
        "came back from. A disk's is timed at the model's own storage sizes during the script's extra steps with "
        "every layer tiered, where the script ran long enough; else at fixed sizes beside a GEMM loop. Empty: not "
        "measured (a GPU computes, or a memory tier).",
        default_factory=list)
    write_beside_compute: list[CurvePoint] = doc("The same for writes.", default_factory=list)


@dataclass(kw_only=True, slots=True)
class Axdimm:
    """The near-memory accelerator DIMM that runs Adam next to the optimizer states."""

    backend: Backend = doc("`emulated`: host memory and worker threads; `hardware`: a real device driver.")
    channels: int = doc("Independent memory channels, each with its own arbiter and Adam kernel.", ge=1,
                   le=MAX_CHANNELS)
    channel_capacity_bytes: int = doc("Memory of one channel.", unit=SIZE)
    adam_params_per_s: float = doc("Adam throughput of one channel, the gradient's copy into it included.",
                                   unit=PARAM_RATE)
    launch_s: float = doc("Fixed cost of one parameter's update on a channel, whatever its size: the arbiter's mode "
                          "switches, the kernel launch and waiting for its status.", unit=TIME, ge=0)
    cpu: float | None = doc("How much one emulated channel's worker slows compute on the cores while it updates, as a "
                            "share of `cpu.background_slowdown`, measured with every channel updating; null: not "
                            "measured (hardware, or a GPU computes): taken as 1 when emulated.", ge=0, le=1,
                            default=None)
    adam_beside_compute_params_per_s: float | None = doc(
        "`adam` while the model computes on all cores, every channel updating; null: not measured (hardware, or a "
        "GPU computes): `adam` holds.", unit=PARAM_RATE, default=None)
    launch_beside_compute_s: float | None = doc("`launch` the same way.", unit=TIME, ge=0, default=None)


@dataclass(kw_only=True, slots=True)
class Peer:
    """The link between two data-parallel ranks (COARSE's per-proxy profile)."""

    src: int = doc("Sending rank.", ge=0, le=MAX_RANK)
    dst: int = doc("Receiving rank.", ge=0, le=MAX_RANK)
    backend: CommBackend = doc("torch.distributed backend measured.")
    transfer: list[CurvePoint] = doc("Point-to-point transfer time by size.")


@dataclass(kw_only=True, slots=True)
class Machine:
    """Everything measured about the machine."""

    cpu: Cpu = doc("The host processor.")
    numa: list[NumaNode] = doc("NUMA nodes; one entry on a single-node machine.")
    gpu: Gpu | None = doc("The CUDA device; null on a CPU-only machine.")
    tiers: list[Tier] = doc("Memory tiers, fastest first.")
    axdimm: Axdimm | None = doc("The AXDIMM; null when there is none.")
    peers: list[Peer] = doc("Links between data-parallel ranks; empty for one process.", default_factory=list)
    memory_limit_bytes: int | None = doc("The limit of the memory cgroup the profiled process ran in (cgroup v1 "
                                         "`memory.limit_in_bytes`, v2 `memory.max`); null: none. `hetero plan` "
                                         "takes it as the default DRAM budget.", unit=SIZE, ge=0, default=None)
    host: str | None = doc("The machine measured: 8 hex digits of a hash of its host name (as hetero's work "
                           "directories carry it); `hetero profile --machine` takes this section again only on that "
                           "host. null: not recorded (older profiles).", default=None)

    def problems(self) -> list[tuple[str, str]]:
        return unique_names(self.tiers, "tiers")


@dataclass(kw_only=True, slots=True)
class Layer:
    """One layer, in forward order: its parameters, its times and its saved activations."""

    name: str = doc("Qualified module name, as in `model.named_modules()`; `(model)` for the root module. Where "
                    "the script trains several models, it starts with the model's name (`netD.0`).")
    type: str = doc("Module class, e.g. `Linear`.")
    model: str | None = doc("The model the layer belongs to (a name of `model.models`); null: the only one.",
                            default=None)
    num_params: int = doc("Parameters this layer owns directly.", unit=COUNT)
    params: dict[str, int] = doc("Bytes of each parameter the layer owns, by local name (`weight`).", unit=SIZE)
    fp_s: float = doc("Forward time of the layer itself (nested layers excluded), parameters in fast memory "
                      "(MemFerry's T_FP).", unit=TIME)
    bp_s: float = doc("Backward time of the layer's region, from its backward start to the next one's: its own "
                      "backward, its gradient accumulation and the operations between it and the next layer "
                      "(T_BP, GO's T_CBP).", unit=TIME)
    fp_dha_s: float | None = doc("Forward time reading parameters from pinned host memory (T_FP^H).", unit=TIME)
    bp_dha_s: float | None = doc("Backward time reading parameters from pinned host memory (T_BP^H).", unit=TIME)
    bp_grad_host_s: float | None = doc("Backward time writing gradients to pinned host memory (GO's T_GBP).",
                                       unit=TIME)
    saved_bytes: int = doc("Bytes autograd saves from the layer's forward start until the next layer starts "
                           "(distinct storages, parameters excluded).", unit=SIZE)
    saved_storages_bytes: list[int] = doc(
        "Size of each storage counted in `saved`, largest first, from the last measured micro-batch: the runtime "
        "moves saved activations storage by storage, so each one is a transfer with its own fixed cost. Empty: "
        "not recorded (the layer's bytes are then timed as one transfer).", unit=SIZE, default_factory=list)
    fp_end_s: float = doc("End of the layer's forward, from the start of the micro-batch's forward "
                          "(TierTrain's te^F).", unit=TIME)
    bp_start_s: float = doc("When backward first reads a tensor the layer saved (saving none: when its output's "
                            "gradient is ready), from the micro-batch's forward start (TierTrain's ts^B).", unit=TIME)

    @property
    def params_bytes(self) -> int:
        return sum(self.params.values())

    def param_names(self) -> list[str]:
        """Qualified names of the layer's parameters, as in `model.named_parameters()`."""
        return [local if self.name == ROOT_LAYER else f"{self.name}.{local}" for local in self.params]

    def problems(self) -> list[tuple[str, str]]:
        # An invisible character (U+FEFF, a zero-width space) in a name is an edit or a corruption: no module or
        # parameter torch builds has one, so the plan made from it would name something the model does not have.
        for key, name in [("name", self.name), *((f"params.{k}", k) for k in self.params)]:
            if not name.isprintable():
                return [(key, f"{name!r} holds an invisible or control character, which no module or parameter "
                              "name has: re-profile")]
        return []


@dataclass(kw_only=True, slots=True)
class Memory:
    """What the whole process held while the script trained as it is: what plain training costs, interpreter,
    libraries and allocator slack included."""

    dram_peak_bytes: int = doc("Peak of host memory as a memory limit charges it (the kernel's high-water mark "
                               "VmHWM less the file pages mapped then), in the profile's own process by the end of "
                               "the measured steps (on a GPU or under torchrun, of the warm-up steps, which run "
                               "without the profiler's hooks); under a budget an estimate (`dram_peak_estimated`).",
                               unit=SIZE, ge=0)
    gpu_allocated_peak_bytes: int | None = doc("Peak of torch's allocated GPU memory; null without a GPU.",
                                               unit=SIZE, ge=0, default=None)
    gpu_reserved_peak_bytes: int | None = doc("Peak of GPU memory torch's caching allocator reserved; null without "
                                              "a GPU.", unit=SIZE, ge=0, default=None)
    dram_peak_estimated: bool = doc("`dram_peak` was not measured: the profile ran under a budget with freed memory "
                                    "returned from the start (plain training might not have fit), and `dram_peak` "
                                    "is the peak measured that way (a lower bound of plain's), plus, where the "
                                    "profile also kept Adam's states and the gradients on NVMe (`profiled_under` "
                                    "says so), the 12 B/param plain training holds there instead.", default=False)
    dram_peak_returned_bytes: int | None = doc("Peak of host memory (as `dram_peak` counts it) over a few more steps "
                                               "with glibc returning freed memory to the kernel (the plan's "
                                               "`allocator`), from a trimmed heap; under a budget, `dram_peak` "
                                               "itself; null: not measured.", unit=SIZE, ge=0, default=None)
    returned_step_s: float | None = doc("Mean time of those steps; null: not measured.", unit=TIME, default=None)
    default_step_s: float | None = doc("The measured steps' time, with malloc's defaults: `returned_step` less this "
                                       "is what returning memory costs a step (page faults); null: not measured.",
                                       unit=TIME, default=None)
    profiled_under: str | None = doc("How the profile kept a budget it found or was given (null: none), e.g. "
                                     "`freed memory returned from the start, under the 2GiB memory cgroup`.",
                                     default=None)


@dataclass(kw_only=True, slots=True)
class Block:
    """A repeated block of the model (a transformer layer): what activation checkpointing would recompute in
    backward instead of keeping its saved tensors. Its forward time and saved bytes are those of the profile's layers
    under it (`layers`: the names that start with its own)."""

    name: str = doc("The block's module path, e.g. `h.3`.")
    input_bytes: int = doc("Bytes of the tensors its forward takes: what checkpointing keeps of it.", unit=SIZE, ge=0)
    recomputable: bool = doc("Whether its forward, run again from the same RNG state on the same inputs, gave the "
                             "same output bit for bit and changed none of its buffers (checked once, after the "
                             "measured steps).")
    why: str | None = doc("Why it cannot be recomputed; null where it can.", default=None)


@dataclass(kw_only=True, slots=True)
class Profile:
    """profile.yaml: the machine and the model as `hetero profile` measured them."""

    model: ModelInfo = doc("The model profiled.")
    training: Training = doc("How the script trains.")
    machine: Machine = doc("The machine.")
    layers: list[Layer] = doc("Layers in forward order.")
    memory: Memory | None = doc("The whole process's peaks under plain training; null in profiles made before "
                                "hetero measured them.", default=None)
    unmeasured: dict[str, str] = doc("Why each null field is null, by path (`machine.gpu`, `layers.*.fp_dha`).",
                                     default_factory=dict)
    blocks: list[Block] = doc("The model's repeated blocks, which `hetero plan` may recompute in backward; empty: none "
                              "found (or a profile made before hetero measured them).", default_factory=list,
                              added=True)

    def kept_models(self) -> set[str]:
        """The models whose optimizer stays the script's (hetero's Adam cannot take its place): a plan places no
        state of their parameters, and `hetero run` looks none up."""
        return {o.model for o in self.training.optimizers if o.kept}

    def problems(self) -> list[tuple[str, str]]:
        too_many = [("layers", f"{len(self.layers)} entries, at most {MAX_LAYERS}")] if len(self.layers) > MAX_LAYERS \
            else []
        # Every parameter the optimizer owns belongs to a layer (frozen ones too, so the layers may hold more).
        held = sum(layer.num_params for layer in self.layers)
        missing = [("layers", f"the layers hold {held:,} parameters, fewer than the {self.model.num_params:,} of "
                              "model.num_params: a layer is missing; re-profile")] \
            if self.layers and held < self.model.num_params else []
        return unique_names(self.layers, "layers") + unique_names(self.blocks, "blocks") + too_many + missing


def header(script: str) -> tuple[str, ...]:
    """The comment lines a profile file starts with."""
    return f"hetero profile of {script}", "Edit with care: `hetero plan` reads it."
