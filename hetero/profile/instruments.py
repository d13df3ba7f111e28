"""The seam every measurement of the profile's script sits behind: the `Instrument` base class, and the instruments of
the script's own steps (others live with their measurement: hetero.profile.returned, tier_steps, dha).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hetero.harness import hooks, watch
from hetero.harness.capture import OtherOptimizers
from hetero.harness.grads import GradEdits, after_closure, closure_of
from hetero.harness.layer_timing import CpuClock, CudaClock, LayerProfiler, Summary, summarize
from hetero.harness.layers import select_layers, tensors, unique_storages


class Instrument:
    """One measurement of the script. Every call is a no-op here: an instrument defines the ones it uses. What it
    measured is read from its own typed fields and methods once its phase is done."""

    def bind(self, model: nn.Module) -> None:
        """The model is known (found at its first optimizer step, or the instrument's phase starts later)."""

    def step_ended(self) -> bool:
        """A step of the phase the instrument measures ended; true once that phase is done."""
        return False

    def close(self) -> None:
        """Every hook and setting taken back; what it measured stays readable. Twice is harmless."""


class StepClock(Instrument):
    """The warm-up and measured steps on the layer profiler's clock: each step's end and its optimizer steps' spans.
    A step ends, calling `on_step()`, as the first optimizer's step returns (without one: as a backward call returns).
    An optimizer of no model found stepping ends the profile (hetero.harness.capture.OtherOptimizers)."""

    def __init__(self, clock: CpuClock | CudaClock, optimizers: list[torch.optim.Optimizer], warmup: int, steps: int,
                 on_step: Callable[[], None], chosen: bool):
        self.clock, self.optimizers, self.warmup, self.steps = clock, optimizers, warmup, steps
        self.on_step, self.chosen = on_step, chosen
        self.ends: list = []  # clock tokens at each step's end
        self.spans: list[list[tuple]] = [[]]  # each step's optimizer steps' (start, end), the current one's last
        self.others: OtherOptimizers | None = None
        self.handles: list = []
        self._start = None

    def bind(self, model: nn.Module) -> None:
        for opt in self.optimizers:
            self.handles += [opt.register_step_pre_hook(self._step_start), opt.register_step_post_hook(self._step_end)]
        self.others = OtherOptimizers(self.optimizers, model, chosen=self.chosen)
        if not self.optimizers:
            self.handles.append(watch.backward_calls(self.on_step))

    def _step_start(self, optimizer, args, kwargs):
        if closure_of(args, kwargs) is not None:  # the step's own work starts once its forward and backward ran
            self._start = None
            return after_closure(args, kwargs, self._mark_start)
        self._mark_start()
        return None

    def _mark_start(self) -> None:
        self._start = self.clock.mark()

    def _step_end(self, optimizer, args, kwargs) -> None:
        if self._start is not None:  # None: the model was found inside this step's closure
            self.spans[-1].append((self._start, self.clock.mark()))
        self._start = None
        if optimizer is self.optimizers[0]:
            self.on_step()

    def step_ended(self) -> bool:
        """True at the end of the warm-up steps and at the end of the measured ones."""
        self.ends.append(self.clock.mark())
        self.spans.append([])
        return len(self.ends) in (self.warmup, self.warmup + self.steps)

    def iteration_s(self) -> float:
        """The measured steps' mean, from one step's end to the next one's."""
        ends = self.ends[self.warmup - 1:self.warmup + self.steps]
        return sum(self.clock.seconds(a, b) for a, b in itertools.pairwise(ends)) / self.steps

    def optimizer_step_s(self) -> float:
        """The measured steps' mean time inside their optimizers' steps."""
        spans = self.spans[self.warmup:self.warmup + self.steps]
        return sum(self.clock.seconds(s, e) for step in spans for s, e in step) / self.steps

    def warm_median_s(self) -> float | None:
        """The warm-up steps' median after the first, end to end, without the profiler's hooks; None with one."""
        ends = self.ends[:self.warmup]
        return statistics.median(self.clock.seconds(a, b) for a, b in itertools.pairwise(ends)) \
            if len(ends) >= 2 else None

    def close(self) -> None:
        if self.others is not None:
            self.others.close()
        self.handles = hooks.removed(self.handles)


class LayerTimer(Instrument):
    """Each layer's times and saved bytes (hetero.harness.layer_timing) over the measured steps, not the warm-up."""

    def __init__(self, model: nn.Module, granularity: str, clock: CpuClock | CudaClock, compiled: bool):
        self.profiler = LayerProfiler(model, select_layers(model, granularity), clock, compiled=compiled)

    def attach(self) -> None:
        self.profiler.attach()

    def close(self) -> None:  # as the measured steps end, or as the script ends inside them
        self.profiler.detach()

    def summary(self) -> Summary:
        return summarize(self.profiler)


class OutputBytes(Instrument):
    """The most the model's training forward returned with gradients (`Training.output_bytes`)."""

    def __init__(self):
        self.most = 0
        self.handle = None

    def bind(self, model: nn.Module) -> None:
        self.handle = hooks.forward(model, self._returned)

    def _returned(self, module: nn.Module, args, output) -> None:
        if torch.is_grad_enabled():
            returned = sum(t.untyped_storage().nbytes() for t in unique_storages(tensors(output)) if t.requires_grad)
            self.most = max(self.most, returned)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()


class EditedGrads(Instrument):
    """Counts the optimizer steps whose gradients the script changed after backward (hetero.harness.grads); made
    before the capture's hooks (whose step hook removes itself)."""

    def __init__(self, optimizers: Callable[[], list[torch.optim.Optimizer]]):
        self.steps = 0
        self.edits = GradEdits(lambda: (p for opt in optimizers() for group in opt.param_groups
                                        for p in group["params"]), by_value=True)
        self.handle = register_optimizer_step_pre_hook(self._step)

    def _step(self, optimizer, args, kwargs):
        if closure_of(args, kwargs) is not None:  # its backward runs inside step(): check once it returned
            return after_closure(args, kwargs, lambda: self._check(optimizer))
        self._check(optimizer)
        return None

    def _check(self, optimizer: torch.optim.Optimizer) -> None:
        if self.edits.edited(p for group in optimizer.param_groups for p in group["params"]):
            self.steps += 1

    def close(self) -> None:
        self.handle.remove()
        self.edits.close()
