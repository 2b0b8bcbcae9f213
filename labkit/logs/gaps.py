"""Where a measured step's idle time went, from the same log lines its timeline is built from.

A rank is idle whenever it is not computing. `explain_idle` gives every idle moment of every rank
one cause:

- **fill / drain**: before the rank's first compute action or after its last: the pipeline's ramp,
  which every schedule has (its ideal bubble is mostly this);
- **waiting for a neighbour**: the next action needs a tensor from another rank (an activation for a
  forward, a gradient for a backward), and the log says that rank sent it (`Sending tensor` /
  `Sending gradient`) only at the end of the wait. The neighbour was not ready, by the schedule's
  design or because of its own delays;
- **sends and receives**: time inside the multi-stage runtime's SEND / RECV actions (posting them,
  or a blocking send waiting for the peer to receive);
- **runtime overhead**: the input was already there (or comes from this rank): the runtime's own
  work between two actions (Python, bookkeeping, launching the next one), and on a machine with
  fewer cores than ranks, waiting for a core.

The causes are read from the logs, so they share the logs' limits (a line is written when the
runtime gets to it; see notebook 06). `IdleReport.text()` says it in words; notebooks 05, 06 and 06b use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..core.actions import Action, Timeline, union_length
from .intervals import _by_rank, _send_times, to_timeline
from .messages import Event

CAUSES = ("fill / drain", "waiting for a neighbour", "sends and receives", "runtime overhead")


@dataclass
class IdleReport:
    makespan: float
    idle: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per rank, seconds idle per cause (`CAUSES`)."""
    gaps: dict[int, int] = field(default_factory=dict)
    """Per rank, how many gaps between two compute actions it had (for per-action overhead)."""
    gap_list: dict[int, list[dict]] = field(default_factory=dict)
    """Per rank, each gap (start, end from the step's start; seconds per cause): spans only."""
    source: str = "logs"
    cores: int | None = None
    ranks_per_machine: int | None = None
    causes: tuple = CAUSES
    """The causes this report splits idle time into (spans add "instrument overhead", and with CPU clocks
    "descheduled: the machine was busy": `labkit.spans.idle`)."""
    descheduled_in_actions: dict[int, float] = field(default_factory=dict)
    """Per rank, wall seconds inside its compute actions that its thread did not run (spans with CPU
    clocks): not idle time, the actions ran slower."""
    load: dict[int, dict] = field(default_factory=dict)
    """Per rank, the machine's load at its steps' ends: load1, runnable, cores, the rank's CPU share."""
    notes: list[str] = field(default_factory=list)
    """What else the reading knows that changes what the step means, one sentence each, said at the
    end of `text()` (spans: a compiled stage that ran eagerly, `labkit.spans.compiled.compile_notes`)."""

    def descheduled(self, rank: int | None = None) -> float:
        """Share of the step a rank (or the mean rank) was descheduled: between actions and inside them."""
        ranks = [rank] if rank is not None else sorted(self.descheduled_in_actions)
        if not ranks or self.makespan <= 0:
            return 0.0
        cause = "descheduled: the machine was busy"
        return sum(self.idle[r].get(cause, 0.0) + self.descheduled_in_actions.get(r, 0.0)
                   for r in ranks) / (len(ranks) * self.makespan)

    def share(self, rank: int, cause: str | None = None) -> float:
        """Idle share of the makespan for `rank` (one cause, or all)."""
        causes = self.idle[rank]
        total = causes[cause] if cause else sum(causes.values())
        return total / self.makespan if self.makespan > 0 else 0.0

    def total(self, cause: str | None = None) -> float:
        """Idle share of ranks x makespan (the bubble fraction, when `cause` is None)."""
        if not self.idle or self.makespan <= 0:
            return 0.0
        return sum(self.share(r, cause) for r in self.idle) / len(self.idle)

    def _load_text(self) -> str:
        """The machine's load at the step's end, as the ranks recorded it (one line's tail): the threads
        runnable and each rank's CPU share of its step; `load` keeps the load average too."""
        loads = [v for v in self.load.values() if v]
        if not loads:
            return ""
        share = [v["share"] for v in loads if v.get("share") is not None]
        ran = f", each rank ran {min(share):.0%}-{max(share):.0%} of its step" if share else ""
        # what the ranks measured of this step, not the 1-minute load average (blind to a 50 ms step)
        return (f"; at the step's end: {max(v['runnable'] for v in loads)} runnable on {loads[0]['cores']} cores"
                + ran)

    def text(self) -> str:
        measured = " (measured from spans)" if self.source == "spans" else ""
        lines = [f"idle {self.total():.1%} of ranks x makespan{measured}; per cause, share of the step:"]
        w = max(24, *(len(c) for c in self.causes))
        for cause in self.causes:
            lines.append(f"  {cause:{w}s} {self.total(cause):6.1%}   per rank: "
                         + ", ".join(f"{r}: {self.share(r, cause):.1%}" for r in sorted(self.idle)))
        overhead = sum(c["runtime overhead"] for c in self.idle.values())
        n_gaps = sum(self.gaps.values())
        if n_gaps:
            lines.append(f"  runtime overhead: {1000 * overhead / n_gaps:.2f} ms per gap between two actions "
                         f"({n_gaps} gaps)")
            if "instrument overhead" in self.causes:  # spans: the kit's wrappers, measured apart from the runtime
                own = sum(c["instrument overhead"] for c in self.idle.values())
                lines.append(f"  instrument overhead (the kit's own wrappers): {1000 * own / n_gaps:.3f} ms per gap")
        if self.descheduled_in_actions:
            inside = self.descheduled_in_actions
            lines.append(f"  {'descheduled inside actions':{w}s} "
                         f"{sum(inside.values()) / (len(self.idle) * self.makespan):6.1%}   per rank: "
                         + ", ".join(f"{r}: {v / self.makespan:.1%}" for r, v in sorted(inside.items()))
                         + "  (not idle: the actions ran slower)")
            lines.append(f"  the machine was busy for {self.descheduled():.1%} of the step (between and inside actions)"
                         + self._load_text())
        if self.cores is not None and self.ranks_per_machine is not None and self.ranks_per_machine > self.cores:
            lines.append(f"  {self.ranks_per_machine} ranks shared {self.cores} cores: part of every cause above is "
                         f"waiting for a core")
        lines += [f"  torch.compile, {note}" for note in self.notes]
        return "\n".join(lines)


def idle_gaps(actions) -> Iterator[tuple[float, float, object, object]]:
    """The gaps between one rank's actions (anything with `.start` and `.end`: an `Action`, a span), in
    time order, as (start, end, opened_by, closed_by): `opened_by` is the action whose end opens the gap
    (the latest-ending one so far), `closed_by` the one whose start ends it. Overlapping actions leave no
    gap; the time before the first and after the last (fill / drain) is not a gap. The one walk both
    idle readings share: `explain_idle` (logs) and `labkit.spans.idle.explain_idle_spans` (spans)."""
    mine = sorted(actions, key=lambda a: (a.start, a.end))
    latest = mine[0] if mine else None
    for a in mine[1:]:
        opened_by = latest
        if a.end > latest.end:
            latest = a
        if a.start > opened_by.end:
            yield opened_by.end, a.start, opened_by, a


def _needs_from(a: Action, n_stages: int) -> tuple[str, int] | None:
    """(family, receiving stage) of the tensor action `a` waits for, or None (first forward, last backward)."""
    if a.kind == "F":
        return ("F", a.stage) if a.stage > 0 else None
    if a.kind in ("B", "I"):
        return ("B", a.stage) if a.stage < n_stages - 1 else None
    return None  # W needs nothing from another rank


def explain_idle(events: list[Event], cores: int | None = None, ranks_per_machine: int | None = None,
                 timeline: Timeline | None = None) -> IdleReport:
    """Every rank's idle time in one step, by cause (module docstring). `events`: the step's parsed
    log lines (one step; a multi-step run: pass one step's events). `cores` / `ranks_per_machine`:
    say so when ranks outnumbered cores. `timeline`: the split-waits timeline of these events, if
    already built."""
    tl = timeline if timeline is not None else to_timeline(events, waits="split")
    comp = tl.compute()
    report = IdleReport(makespan=0.0, cores=cores, ranks_per_machine=ranks_per_machine)
    if not comp:
        return report
    start, end = min(a.start for a in comp), max(a.end for a in comp)
    report.makespan = end - start
    sent = _send_times(_by_rank(events))
    n_stages = max(a.stage for a in comp) + 1
    for rank in sorted({a.rank for a in comp}):
        mine = sorted((a for a in comp if a.rank == rank), key=lambda a: (a.start, a.end))
        comm = [(a.start, a.end) for a in tl.actions if a.rank == rank and a.kind in ("SEND", "RECV")]
        causes = dict.fromkeys(CAUSES, 0.0)
        causes["fill / drain"] = (mine[0].start - start) + (end - max(a.end for a in mine))
        gaps = 0
        for g0, g1, _, a in idle_gaps(mine):
            gaps += 1
            wait = 0.0
            need = _needs_from(a, n_stages)
            if need is not None:
                ts = [t for t in sent.get((need[0], need[1], a.microbatch), []) if t <= a.end]
                if ts and ts[-1] > g0:
                    wait = min(ts[-1], g1) - g0
            rest_start = g0 + wait
            in_comm = union_length(comm, rest_start, g1)
            causes["waiting for a neighbour"] += wait
            causes["sends and receives"] += in_comm
            causes["runtime overhead"] += (g1 - rest_start) - in_comm
        report.idle[rank] = causes
        report.gaps[rank] = gaps
    return report
