"""The timeline data model shared by measured runs (`labkit.spans`; `labkit.logs`: PP logs, profiler
traces) and theory. It depends on nothing else in the kit: readers build on it, never the reverse
(trimming a log timeline's waits is `labkit.logs.trim_waits(timeline)`).

An `Action` is one piece of work of one stage on one microbatch: kind F (forward), B (full
backward), I (backward for inputs), W (backward for weights), or SEND/RECV. A `Timeline` is a
list of them plus metrics. Taught in notebooks 04-06.

Bubble, two definitions (always say which one a number is):
- `bubble_fraction` = idle / (ranks x makespan): the idle share of wall time.
  GPipe and 1F1B with F+B per microbatch: (p-1)/(m+p-1).
- `bubble_ratio` = idle / busy: idle over the ideal compute. GPipe and 1F1B: (p-1)/m.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND", "RECV")
FSDP_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")  # FSDP2's collectives under pipelining (spans)


class Action(NamedTuple):
    """One piece of work (a NamedTuple: the parser makes millions, and tuples are cheap to build)."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    actions: list[Action]
    source: str = "measured"  # spans | measured (pp logs) | profiler | theory
    meta: dict = field(default_factory=dict)

    def compute(self) -> list[Action]:
        return [a for a in self.actions if a.kind in COMPUTE_KINDS]

    @property
    def ranks(self) -> list[int]:
        return sorted({a.rank for a in self.actions})

    def shifted(self) -> "Timeline":
        """Times relative to the first action's start (what `labkit timeline --json` prints)."""
        if not self.actions:
            return self
        t0 = min(a.start for a in self.actions)
        acts = [Action(a.rank, a.stage, a.microbatch, a.kind, a.start - t0, a.end - t0) for a in self.actions]
        return Timeline(sorted(acts, key=lambda a: (a.start, a.rank)), self.source, dict(self.meta))

    def counts(self) -> dict[tuple[int, str], int]:
        """{(stage, kind): number of actions}: what the schedule planned must equal what ran."""
        c: dict[tuple[int, str], int] = defaultdict(int)
        for a in self.compute():
            c[(a.stage, a.kind)] += 1
        return dict(c)

    def metrics(self) -> dict:
        comp = self.compute()
        if not comp:
            return {"makespan": 0.0, "bubble_fraction": 0.0, "bubble_ratio": 0.0, "busy": {}, "idle": {},
                    "n_actions": 0}
        start = min(a.start for a in comp)
        makespan = max(a.end for a in comp) - start
        ranks = sorted({a.rank for a in comp})
        busy = {r: union_length([(a.start, a.end) for a in comp if a.rank == r]) for r in ranks}
        idle = {r: makespan - busy[r] for r in ranks}
        total_busy, total_idle = sum(busy.values()), sum(idle.values())
        durations: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for a in comp:
            durations[str(a.stage)][a.kind].append(a.duration)
        mean = {s: {k: sum(v) / len(v) for k, v in kinds.items()} for s, kinds in durations.items()}
        return {
            "makespan": makespan,
            "bubble_fraction": total_idle / (len(ranks) * makespan) if makespan > 0 else 0.0,
            "bubble_ratio": total_idle / total_busy if total_busy > 0 else 0.0,
            "busy": {str(r): v for r, v in busy.items()},
            "idle": {str(r): v for r, v in idle.items()},
            "mean_duration": mean,
            "n_actions": len(comp),
            "n_ranks": len(ranks),
        }

    def to_json(self) -> dict:
        """`actions`: compute only (F/B/I/W); `comms`: SEND/RECV where the logs show them; times from
        the first action, in seconds for measured timelines."""
        t = self.shifted()
        return {"actions": [a._asdict() for a in t.actions if a.kind in COMPUTE_KINDS],
                "comms": [a._asdict() for a in t.actions if a.kind not in COMPUTE_KINDS],
                "metrics": t.metrics(), "source": self.source, "meta": self.meta}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by intervals (overlaps counted once: a rank is busy or not)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
