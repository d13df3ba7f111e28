"""`hetero profile`: run the user's script for warm-up plus measured steps, then measure the machine.

The script runs under the profile's instruments (hetero.profile.instruments), walked through named phases: capture
the model(s) and optimizer(s) at the first `optimizer.step()` (without one, at the end of the first backward call)
and bind the instruments; run the warm-up steps untouched; time the layers over the measured steps; on a machine
without a GPU, a few steps with freed memory returned (hetero.profile.returned), then the disk timed as the
runtime's tiering drives it (hetero.profile.tier_steps); stop the script; measure the machine (or take an earlier
profile's: hetero.profile.same_machine); assemble the Profile.
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from hetero.errors import FAILURE, USAGE, HeteroError
from hetero.harness import capture
from hetero.harness.capture import Capture, fingerprint
from hetero.harness.layer_timing import COMPILED, CpuClock, CudaClock, Summary
from hetero.harness.layers import sharded
from hetero.harness.models import names, part_name, part_of, roots
from hetero.harness.script import ScriptResult, StopScript, run_script
from hetero.plan.axdimm import host_rate
from hetero.profile import dha, machine, peers, phases, recompute, returned, same_machine, tier_steps
from hetero.profile.instruments import EditedGrads, Instrument, LayerTimer, OutputBytes, StepClock
from hetero.run import allocator, process_memory
from hetero.run.devices import places, workdir
from hetero.run.torch_optim import TORCH_ADAM
from hetero.schema import files
from hetero.schema.profile import (
    Block,
    Layer,
    Machine,
    Memory,
    ModelInfo,
    Profile,
    ScriptOptimizer,
    TrainedModel,
    Training,
    header,
)
from hetero.units import SIZE, measured

Progress = Callable[[str, int, int], None]  # (phase, done, total)
WARMUP_CPU, WARMUP_GPU = 2, 6  # default warm-up steps; on a GPU the last 5 time plain training's own step
MACHINE_REMEMBERED = "machine as measured before on this host"  # the progress phase of a remembered machine


@dataclass(kw_only=True, slots=True)
class ProfileOptions:
    steps: int = 5  # optimizer steps measured
    warmup: int | None = None  # optimizer steps run first, unmeasured; None: WARMUP_CPU, or WARMUP_GPU on CUDA
    granularity: str = "module"
    nvme_dir: str | None = None  # where to measure the disk tier; a temporary folder by default
    model_name: str | None = None  # `--model`: which of several candidate models to profile
    dram_budget_bytes: int | None = None  # `--dram-budget`: keep the profile under it (default: the memory cgroup's)
    machine: str | None = None  # `--machine`: an earlier profile of this machine, whose machine section is taken
    measure_machine: bool = False  # `--measure-machine`: measure it even where an earlier profile of this host did

    def warmup_on(self, device: torch.device) -> int:
        """The warm-up steps on `device`: as asked, else enough that the plain step time is steady."""
        if self.warmup is not None:
            return self.warmup
        return WARMUP_GPU if device.type == "cuda" else WARMUP_CPU

    def check(self) -> None:
        if self.warmup is not None and self.warmup < 1:
            raise HeteroError(f"--warmup {self.warmup}: need at least 1 warm-up step",
                              hint="hetero finds the model during the first optimizer step", exit_code=USAGE)
        if self.steps < 1:
            raise HeteroError(f"--steps {self.steps}: need at least 1 measured step", exit_code=USAGE)
        if self.granularity not in ("module", "block"):
            raise HeteroError(f"--granularity {self.granularity}: expected module or block", exit_code=USAGE)
        if self.nvme_dir is not None:  # refused now, not after the script ran: a private work dir can be made there
            try:
                workdir.create(self.nvme_dir, "profile", "--nvme").remove()
            except places.PlanPathError as e:
                raise HeteroError(e.message, hint=e.hint, exit_code=USAGE) from None
        if self.machine is not None:  # refused now, not after the script ran
            same_machine.load(self.machine, self.nvme_dir)


def profile_script(script: str, args: list[str], options: ProfileOptions,
                   progress: Progress | None = None) -> Profile | None:
    """Profile `script args`: its layers, the links between its ranks, then the machine (HeteroError if it crashes
    or ends too early). Under torchrun every rank calls this; rank 0 returns the profile, the others None."""
    run = measure_script(script, args, options, progress)
    links = peers.measure(run.device)  # collective over the script's ranks; [] for one process
    if peers.rank() != 0:
        return None
    if options.machine is not None:
        known = same_machine.load(options.machine, options.nvme_dir)
    else:
        known = None if options.measure_machine else same_machine.remembered(options.nvme_dir, run.device)
        if known is not None and progress is not None:
            progress(MACHINE_REMEMBERED, 1, 1)
    if known is not None:
        return assemble(run, same_machine.reuse(known, run.device, options.nvme_dir, links, run.disk_beside))
    # under a tight budget the machine's buffers fit under the (released) training's own peak
    resident = process_memory.resident_bytes()
    tight = run.budget_bytes is not None and run.budget_bytes - resident < machine.DEFAULT_BYTES
    room = max(0, min(run.budget_bytes, process_memory.dram_peak_bytes()) - resident) if tight else None
    if room is not None and run.memory.profiled_under:
        run.memory.profiled_under += (f"; the machine measured after the training was released, in buffers of at "
                                      f"most {SIZE.format_short(machine.largest_buffer(room))} (an eighth of the "
                                      f"{SIZE.format_short(room)} left under the training's own peak)")
    out = assemble(run, machine.measure(run.device, options.nvme_dir, progress, links, run.disk_beside, room))
    if room is None:  # measured in full: kept for the next profile on this host
        same_machine.remember(out)
    return out


def assemble(run: ScriptMeasurement, measured_machine: Machine) -> Profile:
    """The profile of a measured script on a measured machine; what is not measured says why in `unmeasured`."""
    unmeasured = machine.unmeasured(run.device, run.layers, measured_machine.tiers, measured_machine.cpu)
    training = run.training
    if run.moved_tensors and measured_machine.cpu.adam_params_per_s:
        training = _plain_step(training, run.moved_tensors, run.model.num_params, measured_machine)
    return Profile(model=run.model, training=training, layers=run.layers, machine=measured_machine,
                   memory=run.memory, unmeasured=unmeasured | ({"layers": COMPILED} if run.compiled else {}),
                   blocks=run.blocks)


def save(profile: Profile, output: Path, script: str) -> None:
    files.save(profile, output, header=header(script))


@dataclass(frozen=True, slots=True)
class ScriptMeasurement:
    model: ModelInfo
    training: Training
    layers: list[Layer]
    device: torch.device
    disk_beside: tier_steps.DiskBeside | None  # the disk timed beside the script's training
    memory: Memory  # the whole process's peaks by the end of the warm-up steps
    compiled: bool = False  # the model runs through torch.compile: its layers are not timed
    budget_bytes: int | None = None  # the budget the profile keeps (--dram-budget or the memory cgroup's)
    moved_tensors: int = 0  # parameters whose optimizer the profile kept on NVMe (Conservative): step not plain's
    blocks: list[Block] = field(default_factory=list)  # the repeated blocks, checked for recomputation


def measure_script(script: str, args: list[str], options: ProfileOptions,
                   progress: Progress | None = None) -> ScriptMeasurement:
    """Run the script for warm-up plus measured steps and measure its layers."""
    options.check()
    session = _Session(script, options, progress or (lambda *a: None))
    try:
        return session.measured(args, session.run(args))
    finally:  # after the blocks' check, whose forward the overrides keep under the budget too
        session.budget.end()


def _release(model: nn.Module, optimizers: list[torch.optim.Optimizer], weights: bool) -> None:
    """Free the stopped script's gradients and optimizer states (before the blocks' check), and with `weights` its
    weights and buffers (before the machine is measured: the hooks torch holds on the parameters would otherwise keep
    them alive); give the memory back."""
    for optimizer in optimizers:
        optimizer.state.clear()
    with torch.no_grad():
        for tensor in [*model.parameters(), *(model.buffers() if weights else ())]:
            tensor.grad = None
            if weights:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    gc.collect()
    allocator.trim()


@dataclass(frozen=True, slots=True)
class _Found:
    """The script's model(s) and optimizer(s) as found at its first step, and the instruments bound to them."""

    model: nn.Module
    optimizers: list[torch.optim.Optimizer]  # the models' optimizers, the first to step first
    described: list[ScriptOptimizer]  # the same, as the profile writes them
    device: torch.device
    compiled: bool  # the script calls the model through torch.compile
    clock: StepClock
    layers: LayerTimer
    output: OutputBytes | None  # None where compiled: the hook would be traced into its graph (COMPILED)
    replay: dha.RootInputs | None  # on CUDA: the model's last call, for the DHA measurements
    blocks: dha.RootInputs | None  # the model's last call, to check its blocks' recomputation

    def instruments(self) -> list[Instrument]:
        return [x for x in (self.clock, self.layers, self.output, self.replay, self.blocks) if x is not None]


class _Session:
    """The script run under the profile's instruments, walked through its phases (`_walk`)."""

    def __init__(self, script: str, options: ProfileOptions, progress: Progress):
        self.script, self.options, self.progress = script, options, progress
        self.cwd = os.getcwd()  # before the script can change it
        self.nvme_dir = options.nvme_dir or tempfile.gettempdir()
        self.capture = Capture(self._found, script, options.model_name)
        self.budget = returned.Budget(options.dram_budget_bytes, self.nvme_dir, progress)  # returning memory now
        self.edits = EditedGrads(self.capture.optimizers)  # before the capture's hooks: its step hook removes itself
        # closed in reverse: the budget's patches of the optimizer wrap the edits' watch of GradScaler.unscale_
        self.instruments: list[Instrument] = [self.edits, self.budget]
        self.found: _Found | None = None
        self.walk: Iterator[None] = iter(())
        self.memory: Memory | None = None  # the process's peaks, from the end of the warm-up steps
        self.summary: Summary | None = None  # the measured steps', once they are all done
        self.returned: returned.ReturnedSteps | None = None
        self.disk: tier_steps.TierSteps | None = None

    def run(self, args: list[str]) -> ScriptResult:
        """The script, until the walk stops it or it ends; every instrument closed however it ended."""
        try:
            with self.capture:
                self.budget.install(self.capture)
                return run_script(self.script, args)
        finally:
            for instrument in reversed(self.instruments):
                instrument.close()

    def _found(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """The model is known: bind the budget and the instruments, start the walk (without an optimizer, this
        backward call ended the first step)."""
        self.budget.bind(model)
        device = next(model.parameters()).device
        compiled = capture.compiled(model, self.capture.roots)
        clock = CudaClock() if device.type == "cuda" else CpuClock()
        if compiled and peers.rank() == 0:
            print(f"hetero: note: {COMPILED}; the plan leaves activations in place", file=sys.stderr)
        self.found = found = _Found(
            model=model, optimizers=optimizers, described=_described(model, optimizers, self.capture.script),
            device=device, compiled=compiled,
            clock=StepClock(clock, optimizers, self.options.warmup_on(device), self.options.steps,
                            self._step_ended, chosen=self.options.model_name is not None),
            layers=LayerTimer(model, self.options.granularity, clock, compiled),
            output=None if compiled else OutputBytes(),
            replay=dha.RootInputs(model) if device.type == "cuda" and len(roots(model)) == 1 else None,
            blocks=None if compiled else recompute.watch(model))
        for instrument in found.instruments():
            self.instruments.append(instrument)
            instrument.bind(model)
        self.walk = self._walk(found)
        next(self.walk)
        if not optimizers:
            self._step_ended()

    def _step_ended(self) -> None:
        next(self.walk, None)  # a step after the walk stopped the script (in its `finally`) counts for nothing

    def _walk(self, found: _Found) -> Iterator[None]:
        """The script's steps, phase by phase: each `yield` waits for the next one to end."""
        yield from self._steps(phases.WARMUP, found.clock.warmup, found.clock)
        self.memory = self.budget.memory(found.device)  # the warm-up steps ran untouched: plain's own peaks
        found.layers.attach()
        yield from self._steps(phases.MEASURED, self.options.steps, found.clock)
        found.layers.close()
        if found.device.type == "cpu":
            # the measured steps count too: a process goes on growing after its first steps
            self.memory = self.budget.memory(found.device)
        self.summary = found.layers.summary()
        if (steps := self._returned_steps(found)) is not None:
            self.returned = steps
            yield from self._after(found, steps, steps.STEPS)
            steps.close()  # malloc's defaults again for the disk's steps
        if (disk := self._disk_steps(found)) is not None:
            self.disk = disk
            yield from self._after(found, disk, tier_steps.STEPS)
        raise StopScript()

    def _steps(self, phase: str, total: int, instrument: Instrument) -> Iterator[None]:
        """The steps of `phase` as each ends, counted by `instrument` and said to `progress`, until it is done."""
        for done in itertools.count(1):
            yield
            finished = instrument.step_ended()
            self.progress(phase, done, total)
            if finished:
                return

    def _after(self, found: _Found, steps: returned.ReturnedSteps | tier_steps.TierSteps, total: int
               ) -> Iterator[None]:
        """A phase after the measured steps: its instrument bound (closed with the others), its start said."""
        self.instruments.append(steps)
        steps.bind(found.model)
        self.progress(steps.PHASE, 0, total)
        yield from self._steps(steps.PHASE, total, steps)

    def _returned_steps(self, found: _Found) -> returned.ReturnedSteps | None:
        """Where returning freed memory can be measured: the CPU trains plainly (no budget) in one process."""
        if found.device.type != "cpu" or self.budget.kept is not None or os.environ.get("WORLD_SIZE", "1") != "1":
            return None
        steps = returned.ReturnedSteps()
        return steps if steps.start() else None

    def _disk_steps(self, found: _Found) -> tier_steps.TierSteps | None:
        """Where the planner needs the disk timed beside training: the CPU computes, some layer saves a storage the
        runtime would move, and the budget leaves room for the store (`tier_steps.room_beside`)."""
        if found.device.type != "cpu" or not tier_steps.room_beside(self.budget.kept):
            return None
        steps = tier_steps.TierSteps(self.summary.layers, self.nvme_dir, machine.NVME_TIER, found.clock.iteration_s())
        return steps if steps.useful else None

    def measured(self, args: list[str], result: ScriptResult) -> ScriptMeasurement:
        """What the stopped script's instruments measured."""
        found, summary, memory = self.found, self.summary, self.memory
        if not result.stopped and (result.exit_code != 0 or summary is None):
            if result.exit_code == 0 and found is None:
                raise capture.no_training()
            done, warmup = (len(found.clock.ends), found.clock.warmup) if found is not None else \
                (0, self.options.warmup_on(torch.device("cpu")))
            raise _ended_early(result.exit_code, done, warmup, self.options.steps)
        layers = dha.measure_layers(found.model, found.replay, summary.layers, self.options.granularity) \
            if found.replay is not None else summary.layers  # T_FP^H, T_BP^H, T_GBP: each layer replayed alone
        output_bytes = found.output.most if found.output is not None else 0
        layers = self.budget.filled(layers, output_bytes, memory)  # blocks measured in parts: the rest from twins
        layers = [replace(x, model=part_of(found.model, x.name)) for x in layers]
        self.budget.least()  # the check's forward under the budget too
        model_info = _model_info(found.model, found.optimizers, self.script, args, self.cwd)
        _release(found.model, found.optimizers, weights=False)  # the check needs the weights only
        blocks = recompute.check(found.model, found.blocks)  # one more forward: after every profiler hook
        out = ScriptMeasurement(model=model_info, training=self._training(found, summary, output_bytes),
                                layers=layers, device=found.device,
                                disk_beside=self.disk.measured() if self.disk is not None else None, memory=memory,
                                compiled=found.compiled, budget_bytes=self.budget.budget_bytes,
                                moved_tensors=self.budget.moved_tensors, blocks=blocks)
        _release(found.model, [], weights=True)  # before the machine is measured: it must not come on top of it
        if self.returned is not None and self.returned.result is not None:
            # plain training's peak and step with freed memory returned, against the measured steps'
            memory.dram_peak_returned_bytes, step_s = self.returned.result
            memory.returned_step_s = measured(step_s)
            memory.default_step_s = out.training.iteration_s
        return out

    def _training(self, found: _Found, summary: Summary, output_bytes: int) -> Training:
        clock, profiler, steps = found.clock, found.layers.profiler, self.options.steps
        iteration, micro = clock.iteration_s(), summary.micro_batches / steps
        backwards = profiler.backward_calls / steps or micro  # several models: forwards outnumber them
        # on a GPU, plain training's iteration from the warm-up steps, without the hooks' launch gaps
        plain = clock.warm_median_s() if found.device.type == "cuda" else None
        placed = [opt for opt in found.described if opt.kept is None]  # hetero's Adam can take their place
        return Training(
            optimizer=(placed[0].kind if placed else "other") if found.optimizers else "none",
            grad_accumulation=max(1, round(backwards)), edits_grads=self.edits.steps > 0,
            warmup_steps=clock.warmup, steps_measured=steps, granularity=self.options.granularity,
            iteration_s=measured(iteration), forward_s=measured(summary.forward_s * micro),
            backward_s=measured(summary.backward_s * micro), optimizer_step_s=measured(clock.optimizer_step_s()),
            overhead=round(profiler.hook_s / (iteration * steps), 4),
            steps_from="optimizer" if found.optimizers else "backward", updates_wait=_updates_wait(found),
            optimizers=found.described, plain_iteration_s=measured(plain) if plain is not None else None,
            output_bytes=output_bytes)


def _updates_wait(found: _Found) -> str | None:
    if len(found.optimizers) > 1:
        return (f"the script steps {len(found.optimizers)} optimizers, and each model's gradients also "
                "accumulate in the backward of another's loss")
    if found.clock.others.others_stepped:
        return ("another model's optimizer steps too, and the backward of its loss also reaches this model's "
                "gradients")
    return None


def _described(model: nn.Module, optimizers: list[torch.optim.Optimizer], script: str) -> list[ScriptOptimizer]:
    """Each optimizer as the profile writes it, named while the script's frames are alive."""
    out = []
    for opt, name in zip(optimizers, names(optimizers, script)):
        params = [p for g in opt.param_groups for p in g["params"]]
        part = next((x for x in roots(model) if any(p is q for q in x.parameters() for p in params[:1])), model)
        kept = capture.offloadable(opt, model)
        if kept is not None and isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and peers.rank() == 0:
            print(f"hetero: note: {kept}: the plan leaves the optimizer to the script", file=sys.stderr)
        out.append(ScriptOptimizer(name=name, kind=_optimizer_kind(opt), model=part_name(model, part),
                                   num_params=sum(p.numel() for p in params), kept=kept,
                                   implementation=_implementation(opt)))
    return out


def _implementation(optimizer: torch.optim.Optimizer) -> str:
    """How torch steps `optimizer`'s parameters (`ScriptOptimizer.implementation`); left to torch: foreach where
    every parameter is a CUDA tensor, else one tensor at a time."""
    groups = optimizer.param_groups
    if any(g.get("fused") for g in groups):
        return "fused"
    default = all(g.get("foreach") is None and not g.get("differentiable") for g in groups) and \
        all(p.is_cuda for g in groups for p in g["params"])
    return "foreach" if default or any(g.get("foreach") for g in groups) else "single"


def _plain_step(training: Training, tensors: int, params: int, measured_machine: Machine) -> Training:
    """The profile's steps updated states on NVMe (Conservative): plain training's step at the measured host Adam
    rate (hetero.plan.axdimm.host_rate) instead, and the iteration changed by as much."""
    cpu = measured_machine.cpu
    step = tensors * (cpu.adam_launch_s or 0.0) + params / host_rate(cpu, params)
    return replace(training, optimizer_step_s=measured(step),
                   iteration_s=measured(max(step, training.iteration_s - training.optimizer_step_s + step)))


def _model_info(model: nn.Module, optimizers: list[torch.optim.Optimizer], script: str, args: list[str],
                cwd: str) -> ModelInfo:
    owned = {id(p): p for opt in optimizers for group in opt.param_groups for p in group["params"]} if optimizers \
        else {id(p): p for p in model.parameters() if p.requires_grad}  # updated by hand: what gets gradients
    dtypes = Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters())
    parts = [TrainedModel(name=name, type=type(part).__name__, fingerprint=fingerprint(part),
                          num_params=sum(p.numel() for p in part.parameters()))
             for name, part in model.named_children()] if len(roots(model)) > 1 else []
    return ModelInfo(fingerprint=fingerprint(model), script=script, args=list(args), cwd=cwd,
                     num_params=sum(p.numel() for p in owned.values()), dtype=dtypes.most_common(1)[0][0],
                     models=parts, sharded=sharded(model))


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """Of the torch class the script built (Conservative may stand in for it)."""
    built = getattr(optimizer, "replaces", None) or type(optimizer)
    return {TORCH_ADAM["Adam"]: "adam", TORCH_ADAM["AdamW"]: "adamw"}.get(built, "other")


def _ended_early(exit_code: int, steps: int, warmup: int, measured_steps: int) -> HeteroError:
    needed = warmup + measured_steps
    if exit_code != 0:
        return HeteroError(f"the script exited with code {exit_code} after {steps} optimizer steps; "
                           "no profile written", exit_code=exit_code)
    return HeteroError(
        f"the script ended after {steps} optimizer step{'s' * (steps != 1)}; hetero profile needs {needed} "
        f"(--warmup {warmup} + --steps {measured_steps})",
        hint="let the script run longer (e.g. pass it a larger step count) or lower --steps/--warmup",
        exit_code=FAILURE)
