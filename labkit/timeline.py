"""The timeline data model shared by measured runs (pplog, profiler traces) and theory (simulator).

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
    source: str = "measured"  # measured (pp logs) | profiler | theory
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
        busy = {r: _union_length([(a.start, a.end) for a in comp if a.rank == r]) for r in ranks}
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

    def trim_waits(self) -> "Timeline":
        """Take the waiting out of log-measured actions: start = max(start, end - d(stage, kind)).

        torch logs mark when work ENDS (GPipe/1F1B) or when an action is picked (the runtime), and the
        wait for an incoming activation or gradient happens inside the action: read naively, a rank
        is never idle and the bubble is hidden. `d(stage, kind)` is the shortest duration that kind
        of action took on that stage in this run, i.e. one that did not wait. This is an estimate: it
        needs at least one action of each (stage, kind) that did not wait (true for m >= 2), and it
        takes the variation of compute time for waiting. Profiler traces (`--profile`) measure instead.
        """
        shortest: dict[tuple[int, str], float] = {}
        for a in self.compute():
            key = (a.stage, a.kind)
            shortest[key] = min(shortest.get(key, a.duration), a.duration)
        acts = [Action(a.rank, a.stage, a.microbatch, a.kind, max(a.start, a.end - shortest[(a.stage, a.kind)]), a.end)
                if a.kind in COMPUTE_KINDS else a for a in self.actions]
        meta = {**self.meta, "waits": "trimmed: start = max(logged start, end - shortest duration of that kind on that stage)"}
        return Timeline(acts, self.source, meta)

    def to_json(self) -> dict:
        """`actions`: compute only (F/B/I/W); `comms`: SEND/RECV where the logs show them; times from
        the first action, in seconds for measured timelines."""
        t = self.shifted()
        return {"actions": [a._asdict() for a in t.actions if a.kind in COMPUTE_KINDS],
                "comms": [a._asdict() for a in t.actions if a.kind not in COMPUTE_KINDS],
                "metrics": t.metrics(), "source": self.source, "meta": self.meta}


def _union_length(intervals: list[tuple[float, float]]) -> float:
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
