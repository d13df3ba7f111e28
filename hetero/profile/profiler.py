"""`hetero profile`: run the user's script for warm-up plus measured steps, then measure the machine.

Phases: capture the model(s) and optimizer(s) at the first `optimizer.step()` (a script without a torch.optim
optimizer: at the end of its first backward call, and its steps are counted from backward calls); run the warm-up
steps untouched; attach the layer profiler for the measured steps; on a machine without a GPU, time the disk for a
few more steps as the runtime's tiering drives it (hetero.profile.tier_steps); stop the script; measure the machine
(or, with `--machine`, take an earlier profile's: hetero.profile.same_machine); assemble the Profile.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hetero.errors import FAILURE, USAGE, HeteroError
from hetero.harness import capture, hooks, watch
from hetero.harness.capture import Capture, fingerprint
from hetero.harness.grads import GradEdits, after_closure, closure_of
from hetero.harness.layer_timing import COMPILED, CpuClock, CudaClock, LayerProfiler, Summary, summarize
from hetero.harness.layers import select_layers, sharded, tensors, unique_storages
from hetero.harness.models import names, part_name, part_of, roots
from hetero.harness.script import StopScript, run_script
from hetero.profile import dha, machine, peers, phases, recompute, returned, same_machine, tier_steps
from hetero.profile.conservative import Conservative
from hetero.profile.pressure import UnderPressure
from hetero.run import allocator, process_memory
from hetero.run.devices import places, workdir
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
RETURNED_STEPS = "freed memory returned"  # the progress phase of returned.ReturnedSteps
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
        """The warm-up steps on `device`: as asked, else enough that the plain step time is steady (a GPU's first
        steps pay for handles, autotuning and the allocator's growth; a CPU's steps are long already)."""
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
    """Profile `script args`: its layers, the links between its ranks, then the machine. HeteroError if it crashes
    or ends too early. Under torchrun every rank calls this; rank 0 measures the machine and returns the profile,
    the other ranks None."""
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
    # Under a budget that leaves less than the machine's measurements hold by default, their buffers fit under the
    # training's own peak (the training was released): the profile needs no more than the run it plans for.
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
    unmeasured = machine.unmeasured(run.device, run.layers, measured_machine.tiers)
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
    session = _Session(options, progress or (lambda *a: None))
    session.cwd = os.getcwd()  # before the script can change it
    session.capture = Capture(session.found, script, options.model_name)
    budget = session.budget = returned.budget_of(options.dram_budget_bytes)
    session.budgeted = returned.Budgeted(budget) if budget is not None else None
    try:
        try:
            with _watch_grad_edits(session.capture) as edits, session.capture:  # its hook first: the capture's removes itself
                if budget is not None:
                    session.conservative = Conservative(budget[0], options.nvme_dir or tempfile.gettempdir(),
                                                        session.progress)
                    session.conservative.install(session.capture.resolve,
                                                 session.capture.every_optimizer_has_a_model)
                    session.pressure = UnderPressure(budget[0], session.progress)
                try:
                    result = run_script(script, args)
                finally:  # before the clipping watch is undone: the optimizer's patches wrap it
                    if session.conservative is not None:
                        session.conservative.close()
        finally:
            disk_beside = session.close()
        return _measured(script, args, options, session, result, edits, session.budget, disk_beside)
    finally:  # after the blocks' check, whose forward the overrides keep under the budget too
        if session.pressure is not None:
            session.pressure.close()


def _measured(script: str, args: list[str], options: ProfileOptions, session: _Session, result, edits,
              budget: tuple[int, str] | None, disk_beside: tier_steps.DiskBeside | None) -> ScriptMeasurement:
    """What the stopped script's session measured; the fresh processes, where they run."""
    if not result.stopped and (result.exit_code != 0 or session.summary is None):
        if result.exit_code == 0 and session.model is None:
            raise capture.no_training()
        raise _ended_early(result.exit_code, session.steps_done, options.warmup_on(session.device), options.steps)
    summary = session.summary  # set once the measured steps ended, which the check above ensures
    layers = dha.measure_layers(session.model, session.replay, summary.layers, options.granularity) \
        if session.replay is not None else summary.layers  # T_FP^H, T_BP^H, T_GBP: each layer replayed alone
    if session.pressure is not None and session.pressure.engaged:  # measured in parts: the rest from twins
        moved = session.conservative is not None and session.conservative.moved_params > 0
        layers, added = session.pressure.fill(layers, session.output_bytes, grads_gone=moved)
        memory = session.memory
        memory.dram_peak_bytes += added
        memory.dram_peak_returned_bytes = memory.dram_peak_bytes
        memory.profiled_under = f"{memory.profiled_under}; {session.pressure.described(added)}"
    layers = [replace(x, model=part_of(session.model, x.name)) for x in layers]
    if session.pressure is not None:
        session.pressure.least()  # the check's forward under the budget too
    model_info = _model_info(session.model, session.optimizers, script, args, session.cwd)
    _release_training(session.model, session.optimizers)  # the check needs the weights only
    blocks = recompute.check(session.model, session.recompute)  # one more forward: after every profiler hook
    out = ScriptMeasurement(model=model_info, training=session.training(summary, edits_grads=edits["edited"] > 0),
                            layers=layers, device=session.device, disk_beside=disk_beside, memory=session.memory,
                            compiled=session.compiled, budget_bytes=budget[0] if budget is not None else None,
                            moved_tensors=session.conservative.moved_tensors if session.conservative else 0,
                            blocks=blocks)
    _release(session.model)  # before the machine is measured: it must not come on top of it
    found = session.returned.result if session.returned is not None else None
    if found is not None:  # plain training's peak and step with freed memory returned, against the measured steps'
        session.memory.dram_peak_returned_bytes, step_s = found
        session.memory.returned_step_s = measured(step_s)
        session.memory.default_step_s = out.training.iteration_s
    return out


def _release(model: nn.Module) -> None:
    """Free the stopped script's weights and buffers (`_release_training` freed its gradients and optimizer states)
    before the machine is measured, and give the freed memory back: the script never runs again, and the hooks the
    profile and its instruments registered on the parameters (held by torch beyond the reach of Python's garbage
    collector) would otherwise keep all of it alive, so that the machine's buffers came on top of the training's
    peak."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.grad = None
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    gc.collect()
    allocator.trim()


def _release_training(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Free the stopped script's gradients and optimizer states (its weights stay): under a budget the blocks' check
    must not come on top of them."""
    for p in model.parameters():
        p.grad = None
    for optimizer in optimizers:
        optimizer.state.clear()
    gc.collect()
    allocator.trim()


class _Session:
    """The hooks that follow the script's steps and switch the layer profiler on and off."""

    def __init__(self, options: ProfileOptions, progress: Progress):
        self.options, self.progress = options, progress
        self.model: nn.Module | None = None
        self.optimizers: list[torch.optim.Optimizer] = []  # the models' optimizers, the first to step first
        self.optimizer_names: list[str] = []
        self.profiler: LayerProfiler | None = None
        self.replay: dha.RootInputs | None = None  # on CUDA: the model's last call, for the DHA measurements
        self.recompute: dha.RootInputs | None = None  # the model's last call, to check its blocks' recomputation
        self.device = torch.device("cpu")
        self.steps_done = 0
        self.summary: Summary | None = None  # the measured steps', once they are all done
        self.memory: Memory | None = None  # the process's peaks once the warm-up steps are done
        self.tier_steps: tier_steps.TierSteps | None = None
        self.returned: returned.ReturnedSteps | None = None  # the steps with freed memory returned, once started
        self.budget: tuple[int, str] | None = None  # the budget the profile keeps, and where it came from
        self.budgeted: returned.Budgeted | None = None  # the whole profile under a budget
        self.conservative: Conservative | None = None  # under a budget: the optimizer, moved if plain won't fit
        self.pressure: UnderPressure | None = None  # under a budget: blocks recomputed near it
        self.others: capture.OtherOptimizers | None = None
        self.capture: Capture | None = None
        self.compiled = False  # the script calls the model through torch.compile
        self.kept: dict[int, str] = {}  # optimizer id -> why hetero's Adam cannot take its place
        self.step_marks: list[tuple] = []  # (end, previous step's end, [(start, end) of each optimizer step])
        self.spans: list[tuple] = []  # this step's optimizer steps so far
        self.handles: list = []
        self.warm_ends: list = []  # clock tokens at the end of each warm-up step (no profiler hooks then)
        self.output_bytes = 0  # the most the model's training forward returned with gradients
        self.warmup = options.warmup_on(torch.device("cpu"))  # set for the model's device once it is found
        self._start = self._previous_end = None
        self.cwd = ""  # where the script started

    def _unbudgeted(self) -> None:
        """The memory cgroup's limit binds nothing (Conservative.ample): the rest of the profile measures as without
        one, plain training's peak in fresh processes included. The optimizer stays torch's. (`--dram-budget` is kept
        however ample: the user asked for it.)"""
        self.budget = None
        self.budgeted.close()
        self.budgeted = None
        self.pressure.close()
        self.pressure = None

    @property
    def steps_from(self) -> str:
        return "optimizer" if self.optimizers or self.model is None else "backward"

    def found(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        if self.conservative is not None:
            self.conservative.bind(model)
            if self.conservative.ample and self.options.dram_budget_bytes is None and not self.pressure.engaged:
                self._unbudgeted()
        self.model, self.optimizers = model, optimizers
        self.optimizer_names = names(optimizers, self.capture.script)  # now: the script's frames are alive
        self.device = next(model.parameters()).device
        self.warmup = self.options.warmup_on(self.device)
        self.replay = dha.RootInputs(model) if self.device.type == "cuda" and len(roots(model)) == 1 else None
        clock = CudaClock() if self.device.type == "cuda" else CpuClock()
        self.compiled = capture.compiled(model, self.capture.roots)
        if not self.compiled:  # a compiled model would trace the hook into its graph (layer_timing.COMPILED)
            self.handles.append(hooks.forward(model, self._returned))
        self.recompute = None if self.compiled else recompute.watch(model)
        self.profiler = LayerProfiler(model, select_layers(model, self.options.granularity), clock,
                                      compiled=self.compiled)
        if self.compiled and peers.rank() == 0:
            print(f"hetero: note: {COMPILED}; the plan leaves activations in place", file=sys.stderr)
        for opt in optimizers:
            self.handles += [opt.register_step_pre_hook(self._step_start), opt.register_step_post_hook(self._step_end)]
            kept = capture.offloadable(opt, model)
            if kept is not None:
                self.kept[id(opt)] = kept
                if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and peers.rank() == 0:
                    print(f"hetero: note: {kept}: the plan leaves the optimizer to the script", file=sys.stderr)
        # an optimizer of no model found now stepping ends the profile
        self.others = capture.OtherOptimizers(optimizers, model, chosen=self.options.model_name is not None)
        if not optimizers:  # steps are backward calls; this one was the first
            self.handles.append(watch.backward_calls(self._step_ended))
            self._step_ended()

    def _returned(self, module: nn.Module, args, output) -> None:
        if torch.is_grad_enabled():
            returned_bytes = sum(t.untyped_storage().nbytes() for t in unique_storages(tensors(output))
                                 if t.requires_grad)
            self.output_bytes = max(self.output_bytes, returned_bytes)

    def _step_start(self, optimizer, args, kwargs):
        if closure_of(args, kwargs) is not None:  # the step's own work starts once its forward and backward ran
            self._start = None
            return after_closure(args, kwargs, self._mark_start)
        self._mark_start()
        return None

    def _mark_start(self) -> None:
        self._start = self.profiler.clock.mark()

    def _step_end(self, optimizer, args, kwargs) -> None:
        if self._start is not None:  # None: the model was found inside this step's closure
            self.spans.append((self._start, self.profiler.clock.mark()))
        self._start = None
        if optimizer is self.optimizers[0]:
            self._step_ended()

    def _step_ended(self) -> None:
        if self.tier_steps is not None:
            done = self.tier_steps.step_ended()
            self.progress("disk beside training", self.tier_steps.steps, tier_steps.STEPS)
            if done:
                raise StopScript()
            return
        if self.returned is not None and self.returned.result is None:
            if self.returned.step_ended():
                self.returned.close()  # malloc's defaults again for the disk's steps
                self._start_tier_steps() or self._stop()
            self.progress(RETURNED_STEPS, len(self.returned.ends), self.returned.STEPS)
            return
        self.steps_done += 1
        end = self.profiler.clock.mark()
        warmup, total = self.warmup, self.warmup + self.options.steps
        if self.steps_done <= warmup:
            self.warm_ends.append(end)
        else:
            self.step_marks.append((end, self._previous_end, self.spans))
        self._previous_end, self.spans = end, []
        self.progress(phases.WARMUP if self.steps_done <= warmup else phases.MEASURED,
                      min(self.steps_done, warmup) if self.steps_done <= warmup else self.steps_done - warmup,
                      warmup if self.steps_done <= warmup else self.options.steps)
        if self.steps_done == warmup:
            # the warm-up steps ran untouched: plain's own peaks
            self.memory = _memory(self.device, self.budgeted, self.conservative)
            self.profiler.attach()
        elif self.steps_done == total:
            self.profiler.detach()
            if self.device.type == "cpu":
                # the measured steps count too: a process goes on growing after its first steps (malloc's heap,
                # first NVMe updates under a budget), and on a CPU the hooks' records are small beside a step's
                self.memory = _memory(self.device, self.budgeted, self.conservative)
            self.summary = summarize(self.profiler)
            self._start_returned_steps() or self._start_tier_steps() or self._stop()

    def _start_tier_steps(self) -> bool:
        """Time the disk beside training where the planner needs it: the CPU computes (a GPU's kernels share no
        cores with the disk's workers), some layer saves a storage the runtime would move, and the budget leaves
        room for the store beside the training (`tier_steps.room_beside`)."""
        if self.device.type != "cpu" or not tier_steps.room_beside(self.budget):
            return False
        steps = tier_steps.TierSteps(self.summary.layers, self.options.nvme_dir or tempfile.gettempdir(),
                                     machine.NVME_TIER, self._iteration_s())
        if not steps.useful:
            return False
        self.tier_steps = steps
        steps.start(self.model)
        self.progress("disk beside training", 0, tier_steps.STEPS)
        return True

    def _start_returned_steps(self) -> bool:
        """Right after the measured steps, the steps with freed memory returned, where they measure what a plan
        would pay for it: the CPU trains plainly in one process (under a budget the profile returned memory
        throughout: its peak is that one)."""
        if self.device.type != "cpu" or self.budgeted is not None or os.environ.get("WORLD_SIZE", "1") != "1":
            return False
        steps = returned.ReturnedSteps()
        if not steps.start():
            return False
        self.returned = steps
        self.progress(RETURNED_STEPS, 0, steps.STEPS)
        return True

    @staticmethod
    def _stop() -> None:
        raise StopScript()

    def close(self) -> tier_steps.DiskBeside | None:
        """Unbind the disk timing, if it ran; what it measured (None if the script ended first)."""
        if self.budgeted is not None:
            self.budgeted.close()
        if self.returned is not None:
            self.returned.close()
        if self.recompute is not None and self.summary is None:  # ended early: nothing will check the blocks
            self.recompute.close()
        if self.others is not None:
            self.others.close()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.profiler is not None:  # a script that ended inside the measured steps leaves no hook behind
            self.profiler.detach()
        if self.tier_steps is None:
            return None
        self.tier_steps.close()
        return self.tier_steps.measured()

    def _iteration_s(self) -> float:
        """The measured steps' mean, from one step's end to the next one's."""
        clock = self.profiler.clock
        return sum(clock.seconds(prev, end) for end, prev, _ in self.step_marks) / len(self.step_marks)

    def training(self, summary: Summary, edits_grads: bool) -> Training:
        clock, steps, iteration = self.profiler.clock, len(self.step_marks), self._iteration_s()
        micro = summary.micro_batches / steps
        backwards = self.profiler.backward_calls / steps or micro  # several models: forwards outnumber them
        step_s = sum(clock.seconds(s, e) for _, _, spans in self.step_marks for s, e in spans) / steps
        return Training(
            optimizer=self._kind(), grad_accumulation=max(1, round(backwards)),
            edits_grads=edits_grads, warmup_steps=self.warmup, steps_measured=steps,
            granularity=self.options.granularity, iteration_s=measured(iteration),
            forward_s=measured(summary.forward_s * micro), backward_s=measured(summary.backward_s * micro),
            optimizer_step_s=measured(step_s), overhead=round(self.profiler.hook_s / (iteration * steps), 4),
            steps_from=self.steps_from, updates_wait=self._updates_wait(), optimizers=self._optimizers(),
            plain_iteration_s=self._plain_iteration_s(), output_bytes=self.output_bytes)

    def _updates_wait(self) -> str | None:
        if len(self.optimizers) > 1:
            return (f"the script steps {len(self.optimizers)} optimizers, and each model's gradients also "
                    "accumulate in the backward of another's loss")
        if self.others.others_stepped:
            return ("another model's optimizer steps too, and the backward of its loss also reaches this model's "
                    "gradients")
        return None

    def _kind(self) -> str:
        """`none`; `other` where hetero's Adam can take no optimizer's place; else the first such one's class."""
        if not self.optimizers:
            return "none"
        placed = [opt for opt in self.optimizers if id(opt) not in self.kept]
        return _optimizer_kind(placed[0]) if placed else "other"

    def _optimizers(self) -> list[ScriptOptimizer]:
        out = []
        for opt, name in zip(self.optimizers, self.optimizer_names):
            params = [p for g in opt.param_groups for p in g["params"]]
            part = next((x for x in roots(self.model) if any(p is q for q in x.parameters() for p in params[:1])),
                        self.model)
            out.append(ScriptOptimizer(name=name, kind=_optimizer_kind(opt), model=part_name(self.model, part),
                                       num_params=sum(p.numel() for p in params), kept=self.kept.get(id(opt))))
        return out

    def _plain_iteration_s(self) -> float | None:
        """On a GPU, the median of the warm-up steps after the first, end to end, without the profiler's hooks:
        what an iteration of plain training costs (the hooked steps' layer times include the hooks' launch gaps).
        None on a CPU, whose hooks cost little against its kernels, or with a single warm-up step."""
        if self.device.type != "cuda" or len(self.warm_ends) < 2:
            return None
        clock = self.profiler.clock
        return measured(statistics.median(clock.seconds(a, b) for a, b in itertools.pairwise(self.warm_ends)))


def _memory(device: torch.device, budgeted: returned.Budgeted | None, conservative: Conservative | None) -> Memory:
    gpu = process_memory.gpu_peak(device)
    measured_peak = process_memory.dram_peak_bytes()
    moved = conservative is not None and conservative.moved_params > 0
    peak = conservative.plain_estimate(measured_peak) if moved else measured_peak
    estimated = (budgeted is not None and budgeted.applied) or moved
    under = budgeted.profiled_under if budgeted is not None else None
    if moved:
        under = f"{conservative.described()}; {under}; the peak measured that way: {SIZE.format_short(measured_peak)}"
    return Memory(dram_peak_bytes=peak, gpu_allocated_peak_bytes=gpu.allocated_bytes if gpu else None,
                  gpu_reserved_peak_bytes=gpu.reserved_bytes if gpu else None, dram_peak_estimated=estimated,
                  dram_peak_returned_bytes=peak if estimated else None, profiled_under=under)


def _plain_step(training: Training, tensors: int, params: int, measured_machine: Machine) -> Training:
    """The profile's steps updated states on NVMe (Conservative): plain training's step is timed instead at the host
    Adam rate the machine phase measured, and the iteration by as much less."""
    cpu = measured_machine.cpu
    step = tensors * (cpu.adam_launch_s or 0.0) + params / cpu.adam_params_per_s
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
    """Of the torch class the script built (hetero's profile may have stood in for it, see Conservative)."""
    built = getattr(optimizer, "replaces", None) or type(optimizer)
    return {torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}.get(built, "other")


@contextlib.contextmanager
def _watch_grad_edits(capture: Capture) -> Iterator[Counter]:
    """Count the optimizer steps whose gradients the script changed after backward (clipping, unscaling, any
    in-place op: hetero.harness.grads) while it runs: an update overlapped with backward, or run in it, would have
    used the gradients before the change."""
    steps: Counter = Counter()
    edits = GradEdits(lambda: (p for opt in capture.optimizers() for group in opt.param_groups
                               for p in group["params"]), by_value=True)

    def check(optimizer: torch.optim.Optimizer) -> None:
        if edits.edited(p for group in optimizer.param_groups for p in group["params"]):
            steps["edited"] += 1

    def step_pre(optimizer, args, kwargs):
        if closure_of(args, kwargs) is not None:  # its backward runs inside step(): check once it returned
            return after_closure(args, kwargs, lambda: check(optimizer))
        check(optimizer)
        return None

    handle = register_optimizer_step_pre_hook(step_pre)
    try:
        yield steps
    finally:
        handle.remove()
        edits.close()


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
