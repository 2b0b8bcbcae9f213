"""Where a step's idle time went, measured from spans: every gap of every rank, by cause.

A rank is idle whenever none of its compute spans covers the moment. Each idle moment gets one cause
(`SPAN_CAUSES`: the four of the log-based reading, `labkit.logs.gaps.CAUSES`, and the kit's own),
here from measurements:

- **fill / drain**: before the rank's first compute of the step or after its last;
- **waiting for a neighbour**: inside a WAIT span for a receive (torch waiting for an activation or
  a gradient that another rank had not sent yet);
- **sends and receives**: inside a SEND / RECV span (posting them), a WAIT for sends only, or FSDP2's
  collectives under pipelining (UNSHARD: all-gather, RESHARD, REDUCE_GRAD: reduce-scatter);
- **instrument overhead**: the kit's own wrappers (`labkit.spans.record`): each one's time around
  torch's call, measured by the wrapper itself on entry and exit, where it falls in a gap between two
  actions (before a rank's first action and after its last, the step's bookkeeping is fill / drain:
  the rank has nothing of its own to run then; `instrument_overhead` of the timeline counts it all);
- **descheduled: the machine was busy** (spans with scheduler clocks, `labkit.spans.record`): time
  between two actions that the rank's thread was runnable but had no CPU (Linux's run-queue clock;
  a sleep or a blocking wait is not counted), taken out of the cause it would otherwise inflate: a
  wait's tail after its data came, a send's or receive's post, the runtime's Python between them;
- **runtime overhead**: the rest: time between two actions that is neither a wait nor a transfer
  (the schedule's Python, the loss on the last stage, bookkeeping; without CPU clocks, on a machine
  with fewer cores than ranks, waiting for a core too).

Descheduled time inside actions is not idle time (the action is running, slowly): the report carries
it apart, per rank (`descheduled_in_actions`), with the machine's load at each step's end (`load`).

The causes add up to the spans' idle time exactly (the bubble). Where a compiled stage fell back to
eager in the steps read (a recompile limit reached, a frame dynamo could not compile), the report's
text says so per rank (`notes`, `labkit.spans.compiled.compile_notes`): its actions ran uncompiled.
Taught in notebook 06b.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.actions import COMPUTE_KINDS, union_length
from ..logs.gaps import CAUSES, IdleReport, idle_gaps
from .compiled import compile_notes
from .read import Span, compile_counts, read_spans, recorded_pipelines, select_step

__all__ = ["SPAN_CAUSES", "CPU_CAUSES", "DESCHEDULED", "explain_idle_spans", "explain_idle_by_pipeline",
           "IdleByPipeline"]

COLLECTIVE_KINDS = ("SEND", "RECV", "UNSHARD", "RESHARD", "REDUCE_GRAD")  # counted as "sends and receives"
INSTRUMENT = "instrument overhead"
DESCHEDULED = "descheduled: the machine was busy"
SPAN_CAUSES = (*CAUSES[:-1], INSTRUMENT, CAUSES[-1])  # the kit's own before the runtime's (the rest)
CPU_CAUSES = (*CAUSES[:-1], INSTRUMENT, DESCHEDULED, CAUSES[-1])  # spans with CPU clocks


def explain_idle_spans(spans_or_path, which: str | int = "last", cores: int | None = None,
                       ranks_per_machine: int | None = None, ranks=None, meta: dict | None = None) -> IdleReport:
    """Every rank's idle time in one step (`which`: last by default), by cause, with each gap listed
    (`report.gap_list[rank]`: start, end and seconds per cause, times from the step's start).
    `ranks`: only these ranks (one pipeline of several: `explain_idle_by_pipeline`); `meta`: the spans
    files' meta (`read_spans`; read with them from a path), where the machine's load at each step's end is,
    and what torch.compile did: a frame that fell back to eager in any step recorded keeps running eagerly
    in the steps after it, with no count moving then, so the report's notes say it for every step read."""
    if isinstance(spans_or_path, list):
        spans, meta = spans_or_path, meta or {}
    else:
        spans, meta = read_spans(spans_or_path)
    spans = select_step(spans, which)
    if ranks is not None:
        spans = [s for s in spans if s.rank in set(ranks)]
    comp = [s for s in spans if s.kind in COMPUTE_KINDS]
    clocked = bool(comp) and all(s.rq for s in comp)  # scheduler clocks: run-queue time known
    report = IdleReport(makespan=0.0, cores=cores, ranks_per_machine=ranks_per_machine, source="spans",
                        causes=CPU_CAUSES if clocked else SPAN_CAUSES,
                        notes=compile_notes(compile_counts(meta, {s.rank for s in spans}), fell_back_only=True))
    if not comp:
        return report
    start, end = min(s.start for s in comp), max(s.end for s in comp)
    report.makespan = end - start
    for rank in sorted({s.rank for s in comp}):
        mine = sorted((s for s in comp if s.rank == rank), key=lambda s: (s.start, s.end))
        theirs = [s for s in spans if s.rank == rank]
        all_waits = [(s.start, s.end) for s in theirs if s.kind == "WAIT" and s.what in ("recv", "both")]
        all_comm = [(s.start, s.end) for s in theirs
                    if s.kind in COLLECTIVE_KINDS or (s.kind == "WAIT" and s.what not in ("recv", "both"))]
        all_kit = [piece for s in theirs for piece in s.own()]
        all_posts = [x for x in theirs if x.kind not in COMPUTE_KINDS and x.queued]
        causes = dict.fromkeys(report.causes, 0.0)
        causes["fill / drain"] = (mine[0].start - start) + (end - max(s.end for s in mine))
        gaps = []
        for g0, g1, last, s in idle_gaps(mine):
            queued = (s.rq[0] - last.rq[1]) if clocked else 0.0  # seconds in the gap runnable without a CPU
            # only what reaches into the gap counts in it: filtered first, the pairwise overlap stays small
            # (every interval against every gap and pair made a 10-step cell's report take 1.7 s)
            waits, comm, kit = ([iv for iv in ivs if iv[1] > g0 and iv[0] < g1]
                                for ivs in (all_waits, all_comm, all_kit))
            wait = union_length(waits, g0, g1)
            in_comm = union_length(comm, g0, g1) - _overlap(waits, comm, g0, g1)
            own = union_length(waits + comm + kit, g0, g1) - (wait + in_comm)  # none of it inside a wait or a post
            rest = (g1 - g0) - wait - in_comm - own
            gap = {"start": g0 - start, "end": g1 - start, "before": f"{s.stage}{s.kind}{s.mb}",
                   "waiting for a neighbour": wait, "sends and receives": in_comm, INSTRUMENT: own}
            if clocked:  # the run-queue time, out of the cause it would otherwise inflate
                posts = [x for x in all_posts if g0 <= x.start and x.end <= g1]
                recv = lambda x: x.kind == "WAIT" and x.what in ("recv", "both")  # noqa: E731
                inside = {"waiting for a neighbour": sum(x.queued for x in posts if recv(x)),
                          "sends and receives": sum(x.queued for x in posts if not recv(x))}
                away = 0.0
                for cause, q in inside.items():  # a wait's tail after the data came, a post's: no CPU to run on
                    moved = min(gap[cause], q)
                    gap[cause] -= moved
                    away += moved
                moved = min(rest, max(0.0, queued - sum(inside.values())))  # between them: the runtime's share
                gap[DESCHEDULED], rest = away + moved, rest - moved
            gap["runtime overhead"] = rest
            gaps.append(gap)
            for cause in report.causes[1:]:
                causes[cause] += gap[cause]
        report.idle[rank] = causes
        if clocked:
            report.descheduled_in_actions[rank] = sum(s.queued for s in mine)
            report.load[rank] = _load_of(rank, spans, meta)
        report.gaps[rank] = len(gaps)
        report.gap_list[rank] = gaps
    return report


def _load_of(rank: int, spans: list[Span], meta: dict) -> dict:
    """The machine's load the rank recorded at the end of the steps in `spans` (its `end_step` lines)."""
    rows = meta.get(rank, {}).get("instrument", {})
    mine = [rows[k] for k in sorted({s.step for s in spans if s.rank == rank}) if k in rows and "cpu" in rows[k]]
    if not mine:
        return {}
    wall = sum(r["wall"] for r in mine)
    return {"load1": max((r.get("load1") or 0.0) for r in mine),
            "runnable": max((r.get("runnable") or 0) for r in mine), "cores": mine[0].get("cores"),
            "share": sum(r["cpu"] for r in mine) / wall if wall > 0 else None}


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of [lo, hi] covered by both unions (a wait inside a post, which nesting cannot make: 0
    in practice; kept so that the causes never count a moment twice)."""
    both = [(max(x0, y0), min(x1, y1)) for x0, x1 in a for y0, y1 in b if min(x1, y1) > max(x0, y0)]
    return union_length(both, lo, hi)


@dataclass
class IdleByPipeline:
    """The idle reports of a step whose ranks formed several pipelines (pp x dp): one `IdleReport`
    per pipeline, each over its own ranks and its own makespan (a replica's bubble is its own)."""

    pipelines: list[list[int]]
    reports: list[IdleReport]

    def __len__(self) -> int:
        return len(self.reports)

    def __getitem__(self, i: int) -> IdleReport:
        return self.reports[i]

    def __iter__(self):
        return iter(self.reports)

    def text(self) -> str:
        parts = [f"{len(self.reports)} pipelines (replicas), each over its own step:"]
        for i, (ranks, rep) in enumerate(zip(self.pipelines, self.reports)):
            parts.append(f"pipeline {i} (ranks {', '.join(map(str, ranks))}): " + rep.text())
        return "\n".join(parts)


def explain_idle_by_pipeline(spans_or_path, which: str | int = "last", cores: int | None = None,
                             ranks_per_machine: int | None = None) -> IdleReport | IdleByPipeline:
    """`explain_idle_spans` per pipeline: an `IdleByPipeline` when the ranks recorded several
    pipelines (their stages' process groups, `labkit.spans.record`), else the one `IdleReport`.
    What `pool.idle()` and `labkit timeline --idle` give. Notebook 12."""
    if isinstance(spans_or_path, list):
        spans, meta = spans_or_path, {}
    else:
        spans, meta = read_spans(spans_or_path)
    step = select_step(spans, which)
    pipelines = recorded_pipelines(step, meta)
    if not pipelines or len(pipelines) < 2:
        return explain_idle_spans(step, "all", cores, ranks_per_machine, meta=meta)
    return IdleByPipeline(pipelines, [explain_idle_spans(step, "all", cores, ranks_per_machine, ranks=p, meta=meta)
                                      for p in pipelines])
