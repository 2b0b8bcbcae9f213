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
from typing import Any, NamedTuple

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
    recorded: Any = field(default=None, repr=False, compare=False)
    """Where read from spans: every clock the ranks recorded (`labkit.spans.read.Recorded`: each span with its
    scheduler clocks and the kit's own time around it, each rank's per-step lines: wall and CPU time, load,
    dynamo's counts). What the actions alone cannot say (the run queue between actions, which steps compiled)
    is read from it (`labkit.timeline.explain_slowdown`); it travels with the timeline's steps and pipelines
    (`one_step`, `compute_steps`, `split_pipelines`), which keep their own actions' share of it. None for
    logs, profiler traces and theory."""

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
        busy = {r: float(union_length([(a.start, a.end) for a in comp if a.rank == r])) for r in ranks}
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

    @property
    def pipelines(self) -> list[list[int]]:
        """The pipelines (replicas) the ranks form, each a list of ranks in their pipeline's order
        (`meta["pipelines"]`: recorded by the run, `labkit.spans` / result.json); one pipeline of every
        rank when the run did not record any (a plain pipeline). Notebook 12."""
        recorded = self.meta.get("pipelines")
        present = set(self.ranks)
        if recorded:
            parts = [p for p in ([r for r in p if r in present] for p in recorded) if p]
            rest = sorted(present - {r for p in parts for r in p})  # ranks that recorded no group: kept together
            return parts + [rest] if rest else parts
        return [self.ranks] if present else []

    def pipeline_of(self) -> dict[int, int]:
        """{rank: the index of its pipeline in `pipelines`}."""
        return {r: i for i, p in enumerate(self.pipelines) for r in p}

    def split_pipelines(self) -> list["Timeline"]:
        """One Timeline per pipeline (`split_timeline`): each replica's ranks, every kind of action."""
        return split_timeline(self, self.pipelines)

    def to_json(self) -> dict:
        """`actions`: compute only (F/B/I/W); `comms`: SEND/RECV where the logs show them; times from
        the first action, in seconds for measured timelines."""
        t = self.shifted()
        return {"actions": [a._asdict() for a in t.actions if a.kind in COMPUTE_KINDS],
                "comms": [a._asdict() for a in t.actions if a.kind not in COMPUTE_KINDS],
                "metrics": t.metrics(), "source": self.source, "meta": self.meta}


def union_length(intervals, lo: float | None = None, hi: float | None = None):
    """Total length covered by (start, end) intervals, overlaps counted once: a rank's busy time, the
    bytes a tensor's views cover (`labkit.worker.memory`), the part of an idle gap a wait covers
    (`labkit.logs.gaps`, `labkit.spans.idle`). With `lo` / `hi`, only the part inside [lo, hi].
    Empty intervals (end <= start) cover nothing; whole numbers in give a whole number out."""
    if lo is not None or hi is not None:
        intervals = [(a if lo is None else max(a, lo), b if hi is None else min(b, hi)) for a, b in intervals]
    total, end = 0, None
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if end is None or a >= end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def group_pipelines(groups: dict[int, list[int]]) -> list[list[int]]:
    """The pipelines of a run, from what each rank recorded as its stages' process group.

    `groups`: {rank: the global ranks of its stage's group, in group-rank order} (torch's
    `PipelineStage(..., group=)`: `dist.get_process_group_ranks(stage.group)`, recorded by
    `labkit.spans`). Returns the distinct groups (pipelines), ordered by their first rank; a rank
    in no recorded group (it recorded nothing) is in none. Raises ValueError when the records
    contradict each other (a rank outside its own group, two ranks of one group naming different
    groups, a rank in two pipelines): then the ranks did not form pipelines."""
    pipelines: list[list[int]] = []
    owner: dict[int, list[int]] = {}
    for rank in sorted(groups):
        group = [int(r) for r in groups[rank]]
        if rank not in group:
            raise ValueError(f"rank {rank} recorded its stage's group as ranks {group}, which does not hold it.")
        if len(set(group)) != len(group):
            raise ValueError(f"rank {rank} recorded a group that names a rank twice: {group}.")
        for other in group:
            if other in groups and sorted(groups[other]) != sorted(group):
                raise ValueError(f"ranks {rank} and {other} disagree on their pipeline: rank {rank} recorded "
                                 f"{group}, rank {other} recorded {list(groups[other])}.")
            if other in owner and sorted(owner[other]) != sorted(group):
                raise ValueError(f"rank {other} is in two pipelines: {owner[other]} and {group}.")
        if not any(sorted(p) == sorted(group) for p in pipelines):
            pipelines.append(group)
            for other in group:
                owner[other] = group
    return sorted(pipelines, key=min)


def split_timeline(timeline: Timeline, pipelines: list[list[int]]) -> list[Timeline]:
    """One Timeline per pipeline: the actions of its ranks (compute, transfers, FSDP's collectives),
    the timeline's source, and its meta with `pipelines` = [that pipeline] and `pipeline` = its
    index. Every action of a rank in some pipeline lands in exactly one part."""
    parts = []
    for i, ranks in enumerate(pipelines):
        keep = set(ranks)
        meta = {**timeline.meta, "pipelines": [list(ranks)], "pipeline": i}
        if isinstance(meta.get("steps_per_rank"), dict):
            meta["steps_per_rank"] = {k: v for k, v in meta["steps_per_rank"].items() if int(k) in keep}
        parts.append(Timeline([a for a in timeline.actions if a.rank in keep], timeline.source, meta,
                              timeline.recorded))
    return parts
