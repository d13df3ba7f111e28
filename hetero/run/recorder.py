"""`hetero run --trace`: what happened in a window of optimizer steps, as a Chrome trace and run.yaml.

Compute is measured by the profiler's own layer hooks (hetero.harness.layers), so `hetero plan --from-run` can use a
measured layer time; on a GPU their CUDA events are read once after the window and placed on the host's timeline
through one anchor event. Workers report spans through `hetero.run.spans`, one lane per thread. Memory is every
mechanism's own accounting by tier, sampled as each recorded step ends, plus the tiering ledger's change events.
The window is `steps` optimizer steps after `warmup`; then every hook comes off. Only rank 0 records.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hetero import __version__
from hetero.errors import HeteroError
from hetero.harness import hooks
from hetero.harness.layer_timing import CpuClock, CudaClock, LayerProfiler, PassTokens, resolve, summarize
from hetero.harness.layers import layers_named
from hetero.run import process_memory, spans
from hetero.run.devices.residency import UNTIERED
from hetero.run.mechanism import Mechanism
from hetero.run.tiering import ACTIVATIONS, ActivationTiering
from hetero.run.torch_optim import ids, updates_any
from hetero.schema import files, trace
from hetero.schema.plan import ActivationPrediction, Plan
from hetero.schema.run import Run, RunLayer, RunSource, RunTiming, StepEnd
from hetero.schema.series import sweep
from hetero.schema.tiers import plan_tiers
from hetero.units import measured


@dataclass(kw_only=True)
class Outputs:
    trace: Path  # the Chrome trace; run.yaml goes beside it
    plan_path: str
    script: str
    warmup: int = 1
    steps: int = 10

    @property
    def summary(self) -> Path:
        return self.trace.with_suffix(".yaml")


class StepMarks(NamedTuple):
    """Clock tokens of one recorded `optimizer.step()` call."""

    start: Any
    end: Any
    previous_end: Any  # the step before's end: start of this iteration


class Sample(NamedTuple):
    """Every tier's bytes by source when a recorded step ended."""

    step: int
    at: float  # perf_counter seconds
    resident: dict[str, dict[str, int]]  # tier -> source -> bytes
    late_prefetches: int  # the tiering ledger's count so far


class Recorder(spans.Sink, Mechanism):
    """A runtime mechanism that records; it changes nothing the script computes. `plan`: the whole plan, whose
    digest and layers the run's summary names; `others`: the run's other mechanisms, whose bytes it samples."""

    def __init__(self, plan: Plan, out: Outputs, others: list[Mechanism]):
        super().__init__()
        self.plan, self.out, self.others = plan, out, others
        self.tiering = next((m for m in others if isinstance(m, ActivationTiering)), None)
        self.marks: list[StepMarks] = []  # the recorded steps'
        self.ends: list[Sample] = []  # every tier's bytes as the window opened and as each recorded step ended
        self.opened = 0.0  # perf_counter seconds when the window opened
        self.model: nn.Module | None = None
        self.model_ids: set[int] = set()
        self.optimizer: torch.optim.Optimizer | None = None
        self.profiler: LayerProfiler | None = None
        self.clock: CpuClock | CudaClock = CpuClock()
        self.anchor: tuple[float, torch.cuda.Event] | None = None  # (host time, event) of the same moment
        self.step, self._start, self._previous = 0, None, None
        self.index: dict[str, int] = {}
        self.handles: list = []

    def install(self, patches, need_model) -> None:
        spans.active = self
        self.handles = [register_optimizer_step_pre_hook(self._step_start),
                        register_optimizer_step_post_hook(self._step_end)]

    def bind(self, model: nn.Module) -> None:
        self.model, self.model_ids = model, ids(model.parameters())
        self.clock = CudaClock() if next(model.parameters()).device.type == "cuda" else CpuClock()
        schedule = self.plan.activations.schedule if self.plan.activations else []
        layers, _ = layers_named(model, {x.name for x in self.plan.layers} | {e.layer for e in schedule})
        # Only the innermost pair of saved-tensor hooks runs: where tiering owns them, saved bytes go unmeasured and
        # tiering reports each unpack instead, so a backward starts where the profiler would have seen it start.
        self.profiler = LayerProfiler(model, layers, self.clock, saved_tensors=self.tiering is None)
        self.index = {spec.name: i for i, spec in enumerate(layers)}
        if self.tiering is not None:
            self.tiering.on_unpack(self._unpacked)

    def close(self) -> None:
        self._stop()
        self.handles = hooks.removed(self.handles)
        spans.active = None
        if self.profiler is None or not self.marks:
            print(f"hetero: no trace written: no step was recorded (the window starts after {self.out.warmup} "
                  f"warm-up step(s))", file=sys.stderr)
            return
        run = self._write()
        print(f"hetero: trace of {len(self.marks)} steps in {self.out.trace}, summary in {self.out.summary} "
              f"(recording overhead {run.timing.overhead:.1%}); compare with the plan: hetero report "
              f"{self.out.summary} --plan {self.out.plan_path}", file=sys.stderr)

    # -- the window ----------------------------------------------------------------------------------------------

    def _unpacked(self, layer: str) -> None:
        mb = self.profiler.last_forward if self.recording else None
        i = self.index.get(layer)
        if mb is not None and i is not None and i not in mb.first_unpack:
            mb.first_unpack[i] = self.clock.mark()

    def _ours(self, optimizer) -> bool:
        if self.optimizer is None and self.model is not None and updates_any(optimizer, self.model_ids):
            self.optimizer = optimizer
        return optimizer is self.optimizer

    def _step_start(self, optimizer, args, kwargs) -> None:
        if self._ours(optimizer):
            self._start = self.clock.mark()

    def _step_end(self, optimizer, args, kwargs) -> None:
        if not self._ours(optimizer):
            return
        self.step += 1
        end = self.clock.mark()
        if self.recording:
            self.marks.append(StepMarks(self._start, end, self._previous))
            self._sample()
        self._previous = end
        if self.step == self.out.warmup:
            self._open()
        elif self.step == self.out.warmup + self.out.steps:
            self._stop()

    def _open(self) -> None:
        if isinstance(self.clock, CudaClock):  # once, between steps: the GPU timeline's origin on the host's
            torch.cuda.synchronize()
            event = self.clock.mark()
            torch.cuda.synchronize()
            self.anchor = (perf_counter(), event)
        self.opened = perf_counter()
        self.recording = True
        self.profiler.attach()
        self._sample()

    def _stop(self) -> None:
        if self.recording:
            self.recording = False
            self.profiler.detach()

    def _sample(self) -> None:
        """Every tier's bytes now, read under the tiering ledger's lock so its change events agree with it."""
        with self.tiering.lock if self.tiering is not None else contextlib.nullcontext():
            resident = self._resident()
            late = self.tiering.ledger.late if self.tiering is not None else 0
            self.ends.append(Sample(self.step, perf_counter(), resident, late))

    def _resident(self) -> dict[str, dict[str, int]]:
        names = plan_tiers(self.plan)
        out: dict[str, dict[str, int]] = {}
        for m in [self, *self.others]:
            for role, sources in m.resident_bytes().items():
                out.setdefault(names.get(role, role), {}).update(sources)
        if not self.plan.layers:  # without a shadow model the script's parameters and gradients stay where it put them
            for p in self.model.parameters():
                tier = out.setdefault(names["gpu" if p.is_cuda else "host"], {})
                tier["parameters"] = tier.get("parameters", 0) + p.numel() * p.element_size()
                if p.grad is not None:
                    tier["gradients"] = tier.get("gradients", 0) + p.grad.numel() * p.grad.element_size()
        return out

    # -- outputs ---------------------------------------------------------------------------------------------------

    def _write(self) -> Run:
        self.clock.finish()
        steps = [trace.Span("optimizer.step", "optimizer.step", self._absolute(m.start), self._absolute(m.end))
                 for m in self.marks]
        recorded = self._compute_spans() + steps + self.spans
        origin, counters = self.opened, self._counters()
        run = self._run(summarize(self.profiler), counters)
        meta = {"hetero": __version__, "plan": self.out.plan_path, "script": self.out.script,
                "iteration_s": run.timing.iteration_s}
        data = trace.chrome([s._replace(start_s=s.start_s - origin, end_s=s.end_s - origin) for s in recorded],
                            [c._replace(time_s=c.time_s - origin) for c in counters], meta)
        header = (f"hetero run of {self.out.script} under {self.out.plan_path}",
                  f"Compare: hetero report {self.out.summary} --plan {self.out.plan_path}")
        try:
            files.write_text(self.out.trace, json.dumps(data))
            files.save(run, self.out.summary, header)
        except OSError as e:
            raise HeteroError(f"cannot write the trace {self.out.trace}: {e.strerror}",
                              hint="pass --trace with a writable path that has room") from None
        return run

    def _absolute(self, token) -> float:
        if self.anchor is None:
            return token
        host, event = self.anchor
        return host + event.elapsed_time(token) / 1e3

    def _micro_batches(self) -> list[PassTokens]:
        return [mb for mb in self.profiler.micro_batches if mb.backward_end is not None]

    def _compute_spans(self) -> list[trace.Span]:
        """Each layer's own forward time and its backward region, on the compute lane."""
        names = [spec.name for spec in self.profiler.layers]
        out: list[trace.Span] = []
        for mb in self._micro_batches():
            intervals = [(x.layer, self._absolute(x.start), self._absolute(x.end)) for x in mb.intervals]
            out += [trace.Span("compute", f"fp {names[i]}", s, e) for i, s, e in own_segments(intervals)]
            t = resolve(mb, self.clock, len(names))
            base = self._absolute(mb.start)
            out += [trace.Span("compute", f"bp {names[i]}", base + t.bp_start[i], base + t.bp_start[i] + t.bp[i])
                    for i in range(len(names)) if t.bp[i] > 0]
        return out

    def _counters(self) -> list[trace.Count]:
        """Counter samples per tier, each carrying every source's latest bytes (a viewer stacks them)."""
        changes = [(e.at, tier, source, n) for e in self.ends
                   for tier, sources in e.resident.items() for source, n in sources.items()]
        if self.tiering is not None:
            end = self.ends[-1].at
            changes += [(t, tier, ACTIVATIONS, n) for tier, points in self.tiering.ledger.series().items()
                        if tier != UNTIERED for t, n in points if self.opened <= t <= end]
        current: dict[str, dict[str, int]] = {}
        out: list[trace.Count] = []
        for t, tier, source, n in sorted(changes, key=lambda c: c[0]):
            current.setdefault(tier, {})[source] = n
            sample = trace.Count(t, trace.memory_track(tier), dict(current[tier]))
            # several sources sampled at one moment: one event
            if out and (out[-1].time_s, out[-1].track) == (sample.time_s, sample.track):
                out[-1] = sample
            else:
                out.append(sample)
        return out

    def _run(self, summary, counters: list[trace.Count]) -> Run:
        steps = len(self.marks)
        seconds = lambda a, b: self._absolute(b) - self._absolute(a)  # noqa: E731
        iteration = sum(seconds(m.previous_end, m.end) for m in self.marks) / steps
        step_call = sum(seconds(m.start, m.end) for m in self.marks) / steps
        mbs = self._micro_batches()
        busy = sum(seconds(mb.start, mb.backward_end) for mb in mbs) / steps
        micro = max(1, round(len(mbs) / steps))
        timing = RunTiming(
            device=torch.cuda.get_device_name() if self.anchor else "cpu", warmup_steps=self.out.warmup,
            steps_recorded=steps, micro_batches=micro, iteration_s=measured(iteration),
            forward_s=measured(summary.forward_s * micro), backward_s=measured(summary.backward_s * micro),
            optimizer_step_s=measured(step_call), other_s=measured(max(0.0, iteration - busy - step_call)),
            overhead=round(self.profiler.hook_s / (iteration * steps), 4))
        layers = [RunLayer(name=x.name, fp_s=x.fp_s, bp_s=x.bp_s, fp_end_s=x.fp_end_s, bp_start_s=x.bp_start_s,
                           saved_bytes=x.saved_bytes if self.tiering is None else None) for x in summary.layers]
        # Absolute: `hetero report` and `hetero plan --from-run` find them from any directory.
        source = RunSource(plan=str(Path(self.out.plan_path).resolve()), plan_sha256=files.content_sha256(self.plan),
                           model_fingerprint=self.plan.source.model_fingerprint, script=self.out.script,
                           trace=str(self.out.trace.resolve()))
        ends = self.ends
        return Run(source=source, timing=timing, peak_bytes=_peaks(counters), activations=self._activations(),
                   late_prefetches=ends[-1].late_prefetches - ends[0].late_prefetches, layers=layers,
                   steps=[StepEnd(step=e.step, at_s=measured(e.at - self.opened),
                                  resident_bytes={tier: sum(s.values()) for tier, s in e.resident.items()})
                          for e in ends[1:]], process=process_memory.peaks(self.model))

    def _activations(self) -> ActivationPrediction | None:
        """Time-averaged and peak saved bytes in the fast tier over the window, with the tiering and without."""
        if self.tiering is None:
            return None
        series, start, end = self.tiering.ledger.series(), self.opened, self.ends[-1].at
        fast, untiered = (sweep(series[k], start, end) for k in (self.tiering.plan.fast, UNTIERED))
        return ActivationPrediction(avg_fast_bytes=fast.avg_bytes, peak_fast_bytes=fast.peak_bytes,
                                    avg_fast_untiered_bytes=untiered.avg_bytes,
                                    peak_fast_untiered_bytes=untiered.peak_bytes)


def own_segments(intervals: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """Nested (layer, start, end) intervals cut into non-overlapping pieces, each owned by the innermost layer
    running then: a parent's time is split around its children."""
    out: list[tuple[int, float, float]] = []
    stack: list[list] = []  # [layer, resumed at, end]

    def pop() -> None:
        layer, resumed, end = stack.pop()
        if end > resumed:
            out.append((layer, resumed, end))
        if stack:
            stack[-1][1] = end

    for layer, start, end in sorted(intervals, key=lambda x: (x[1], -x[2])):
        while stack and stack[-1][2] <= start:
            pop()
        if stack and start > stack[-1][1]:
            out.append((stack[-1][0], stack[-1][1], start))
        stack.append([layer, start, end])
    while stack:
        pop()
    return sorted(out, key=lambda x: x[1])


def _peaks(counters: list[trace.Count]) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for _, track, values in counters:
        tier = track.removeprefix("memory ")
        peaks[tier] = max(peaks.get(tier, 0), sum(values.values()))
    return peaks
