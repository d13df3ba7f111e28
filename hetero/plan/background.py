"""How background lanes slow compute on a machine without a GPU (the simulator's CPU contention model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.plan.model import Choices, Costs


@dataclass(slots=True)
class Lane:
    """A lane whose worker keeps `share` of a core busy while it works."""

    share: float
    tasks: list[tuple[float, float]] = field(default_factory=list)  # (start, end), in issue order: time order
    first_open: int = 0  # the first task not ended before the last compute start


@dataclass(slots=True)
class Background:
    """While lanes whose workers keep shares s_k of a core busy are working, compute advances at
    1 / (1 + (f - 1) * sum s_k) of its profiled speed, f being the profile's background_slowdown: w seconds of
    compute beside a worker of share s take (f - 1) * s * w longer; beside one streaming throughout, f * w."""

    extra: float  # f - 1
    lanes: dict[str, Lane]  # the lanes that slow compute

    @classmethod
    def of(cls, costs: Costs, ch: Choices) -> Background | None:
        f = costs.background_slowdown
        lanes = {lane: Lane(share) for lane, share in ch.cpu_share.items() if share > 0}
        if costs.has_gpu or f is None or f <= 1 or not lanes:
            return None
        return cls(extra=f - 1, lanes=lanes)

    def add(self, lane: str, start: float, end: float) -> None:
        if end > start and (busy := self.lanes.get(lane)) is not None:
            busy.tasks.append((start, end))

    def finish(self, start: float, work: float) -> float:
        """When `work` seconds of compute started at `start` end. Compute starts never go back in time, so tasks
        ended by `start` are skipped for good."""
        if work <= 0:
            return start
        first = float("inf")
        for busy in self.lanes.values():
            tasks, k = busy.tasks, busy.first_open
            n = len(tasks)
            while k < n and tasks[k][1] <= start:
                k += 1
            busy.first_open = k
            if k < n and tasks[k][0] < first:
                first = tasks[k][0]
        if first >= start + work:  # nothing runs beside it
            return start + work
        t = start
        at = [busy.first_open for busy in self.lanes.values()]  # this walk's own place in each lane
        while True:
            load, change = 0.0, float("inf")  # the load from t on, and when it next changes
            for j, lane in enumerate(self.lanes.values()):
                share, tasks = lane.share, lane.tasks
                k, n = at[j], len(tasks)
                while k < n and tasks[k][1] <= t:
                    k += 1
                at[j] = k
                if k < n:
                    begin, end = tasks[k]
                    if begin <= t:
                        load += share
                        change = min(change, end)
                    elif begin < change:
                        change = begin
            slow = 1 + self.extra * load
            if t + work * slow <= change:
                return t + work * slow
            work -= (change - t) / slow
            t = change
