"""The disk tier timed as `hetero run` drives it, beside the script's own training.

For a few steps after the measured ones, the runtime's activation tiering evicts every layer's saved storages to
disk as its forward ends and brings them back as backward reaches it. Out come the median write, read and delete
of each storage size (the curves the planner times disk trips by when the CPU computes), and the compute those
workers cost: the steps' extra time over the measured steps', late prefetches' waits taken out, per busy second.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from hetero.plan.policy import POLICY
from hetero.profile.instruments import Instrument
from hetero.run import process_memory, spans
from hetero.run.tiering import ActivationTiering
from hetero.schema.plan import ActivationPlan, Eviction
from hetero.schema.profile import CurvePoint, Layer
from hetero.units import measured

STEPS = 4  # the first creates the store's files and buffers; the others are timed
MIN_TENSOR_BYTES = 64 * 1024  # the smallest size the profile times a disk trip at (machine.BESIDE_SIZES)
IDLE_WAIT_S = 10.0  # at most this long for the last deletes to finish after the timed steps
LANES = ("evict", "prefetch")  # the writer's (evictions, deletes) and the reader's spans


@dataclass(frozen=True, slots=True)
class DiskBeside:
    """What the timed steps measured."""

    read: list[CurvePoint]  # by storage size, each read with the delete of its file (the writer's, right after)
    write: list[CurvePoint]
    stretch: float  # compute seconds the steps lost per second a disk worker was busy (>= 0)


def room_beside(budget: tuple[int, str] | None) -> bool:
    """Whether the process's peak so far and the store's bounce buffers stay within the room of `budget` (None: no
    budget); else the disk is timed beside a GEMM loop instead (hetero.profile.machine)."""
    return budget is None or process_memory.dram_peak_bytes() + ActivationPlan.STORE_BYTES <= POLICY.room_of(budget[0])


class TierSteps(Instrument):
    """Tiering bound to the script's model for STEPS steps; `measured` reads what the timed ones showed.
    `clean_step_s`: the measured steps' mean time."""

    PHASE = "disk beside training"  # the profile's progress phase

    def __init__(self, layers: list[Layer], directory: str, tier: str, clean_step_s: float):
        plan = ActivationPlan(fast="dram", slow=tier, slow_path=directory, stay_time_s=0.0,
                              min_tensor_bytes=MIN_TENSOR_BYTES, schedule=schedule(layers))
        self.tiering = ActivationTiering(plan)
        self.sink = spans.Sink()
        self.clean_step_s = clean_step_s
        self._previous: spans.Sink | None = None
        self.steps = 0
        self._ends: list[tuple[float, float]] = []  # (time, the ledger's total wait) at each step's end

    @property
    def useful(self) -> bool:
        """Some layer saves a storage the runtime would move."""
        return bool(self.tiering.plan.schedule)

    def bind(self, model: nn.Module) -> None:
        self._previous, spans.active = spans.active, self.sink
        self.tiering.bind(model)

    def step_ended(self) -> bool:
        """Count an optimizer step; true once the last timed one has ended."""
        self.steps += 1
        self._ends.append((time.perf_counter(), self.tiering.ledger.waited_s))
        self.sink.recording = True  # from the warm step's end
        if self.steps < STEPS:
            return False
        mover = self.tiering.mover  # still recording: the last step's deletes are queued on the writer
        deadline = time.perf_counter() + IDLE_WAIT_S
        while not (mover.writer.idle() and mover.reader.idle()) and time.perf_counter() < deadline:
            time.sleep(0.005)
        self.sink.recording = False
        return True

    def close(self) -> None:
        self.tiering.close()
        if spans.active is self.sink:
            spans.active = self._previous

    def measured(self) -> DiskBeside | None:
        """None when the script ended before the last timed step, or the timed steps moved nothing."""
        if self.steps < STEPS:
            return None
        found = curves(self.sink.spans)
        busy_s = sum(end - start for lane, _, start, end, _ in self.sink.spans if lane in LANES)
        if found is None or busy_s <= 0:
            return None
        (first, waited_first), (last, waited_last) = self._ends[0], self._ends[-1]
        lost_s = last - first - (STEPS - 1) * self.clean_step_s - (waited_last - waited_first)
        return DiskBeside(read=found[0], write=found[1], stretch=round(max(0.0, lost_s) / busy_s, 3))


def schedule(layers: list[Layer]) -> list[Eviction]:
    """Every layer with a movable storage evicts all it saved and is fetched when the next layer's backward starts."""
    return [Eviction(layer=layer.name, evict_bytes=layer.saved_bytes, prefetch_at_s=0.0, prefetch_after=after.name)
            for layer, after in zip(layers, layers[1:])
            if any(size >= MIN_TENSOR_BYTES for size in layer.saved_storages_bytes)]


def curves(recorded: list[spans.Span]) -> tuple[list[CurvePoint], list[CurvePoint]] | None:
    times: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for lane, name, start, end, args in recorded:
        kind = name.split(" ", 1)[0]
        if lane in LANES and kind in ("evict", "prefetch", "delete") and args.get("bytes"):
            times[kind][args["bytes"]].append(end - start)
    median = {kind: {size: statistics.median(ts) for size, ts in by_size.items()} for kind, by_size in times.items()}
    writes, reads, deletes = median.get("evict", {}), median.get("prefetch", {}), median.get("delete", {})
    if not writes or not reads:
        return None
    any_delete = statistics.median(deletes.values()) if deletes else 0.0
    read = [CurvePoint(size_bytes=size, time_s=measured(t + deletes.get(size, any_delete)))
            for size, t in sorted(reads.items())]
    write = [CurvePoint(size_bytes=size, time_s=measured(t)) for size, t in sorted(writes.items())]
    return read, write
