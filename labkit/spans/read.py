"""Spans files back into a `Timeline` (source "spans"): every action with its measured start and end.

A spans file (`labkit.spans.record`) holds one JSON line per span: compute (F, B, I, W: stage,
microbatch), posting sends / receives (SEND, RECV) and waiting for them (WAIT, with `what`:
recv, send or both), numbered by step, on one clock per machine (device time on CUDA). On the
timeline, a WAIT is drawn as the transfer it waited for (RECV when it waited for a receive, else
SEND); `labkit.spans.idle` reads the raw spans to say where idle time went. The kit's own time
around each span (`pre`, `post`, `kit`) and each step's `end_step` line give `instrument_overhead`
(`meta["instrument_overhead"]` of the timeline: what `labkit timeline --json` prints per rank).
A step in which torch.compile did anything gives its counts per rank (`meta["compile"]`:
`compile_counts`, `labkit.spans.compiled`); a schedule object's first step in its process (a warm-up)
is marked (`meta[rank]["first"]`: those steps). The timeline carries the spans and per-step lines themselves
too (`Timeline.recorded`, a `Recorded`): every clock the ranks recorded, for `explain_slowdown`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from ..core.actions import COMPUTE_KINDS, Action, Timeline, union_length
from .paths import span_files

__all__ = ["Span", "Recorded", "KindTimes", "read_spans", "timeline_from_spans", "has_spans", "time_by_kind",
           "instrument_overhead", "recorded_pipelines", "machine_load", "compile_counts", "without_descheduling",
           "makespan_without_load"]


class Span(NamedTuple):
    rank: int
    step: int
    kind: str      # F B I W | SEND RECV (posting) | WAIT | UNSHARD RESHARD REDUCE_GRAD (FSDP2)
    stage: int     # -1 for communication
    mb: int        # -1 for communication
    start: float
    end: float
    what: str = ""  # WAIT / SEND / RECV: recv, send or both
    pre: float = 0.0   # seconds the kit's wrapper ran before `start` (host clock; 0 when not recorded)
    post: float = 0.0  # ... and after `end`
    kit: tuple = ()    # other pieces of the kit's own code just before this span: ((start, end), ...)
    cpu: tuple = ()    # the rank thread's CPU clock at both ends (host-clock spans; () when not recorded)
    rq: tuple = ()     # its run-queue clock at both ends: seconds runnable but waiting for a CPU (Linux)

    @property
    def ran(self) -> float | None:
        """CPU seconds the rank's thread ran inside the span (None when not recorded)."""
        return self.cpu[1] - self.cpu[0] if self.cpu else None

    @property
    def queued(self) -> float | None:
        """Seconds inside the span the thread was runnable but had no CPU: the machine was busy."""
        return self.rq[1] - self.rq[0] if self.rq else None

    def own(self) -> list[tuple[float, float]]:
        """The kit's own intervals around this span (`labkit.spans.record`: measured, host clock)."""
        out = [(a, b) for a, b in self.kit]
        if self.pre > 0:
            out.append((self.start - self.pre, self.start))
        if self.post > 0:
            out.append((self.end, self.end + self.post))
        return out


class Recorded(NamedTuple):
    """Every clock a run's or cell's ranks recorded, as `read_spans` gives it: what a `Timeline` read from
    spans carries (`Timeline.recorded`) beside its actions."""

    spans: list[Span]
    """Every span, each with its scheduler clocks (`cpu`, `rq`) and the kit's own time around it."""
    meta: dict[int, dict]
    """{rank: its file's meta line, with its per-step lines: `instrument` (wall, CPU and run-queue seconds,
    the kit's own, the load at the step's end), `schedules`, `pipelines`, `compile` (dynamo's counts), `first`
    (the steps that were their schedule object's first in the process: warm-ups)}."""

    def of(self, tl: Timeline) -> "Recorded | None":
        """What `tl` (this recording's timeline, or one step or pipeline of it) was read from: every span of
        each of its ranks' steps whose actions it holds (a step's transfers and waits with them); None when
        one of its compute actions is not a recorded one (times shifted or shortened: made anew)."""
        ranks = set(tl.ranks)
        step_of = {(s.rank, s.stage, s.kind, s.mb, s.start, s.end): s.step for s in self.spans
                   if s.kind in COMPUTE_KINDS and s.rank in ranks}
        held = set()
        for a in tl.compute():
            step = step_of.get((a.rank, a.stage, a.kind, a.microbatch, a.start, a.end))
            if step is None:
                return None
            held.add((a.rank, step))
        computed = {(s.rank, s.step) for s in self.spans if s.kind in COMPUTE_KINDS}
        return Recorded([s for s in self.spans if s.rank in ranks
                         and ((s.rank, s.step) in held or (s.rank, s.step) not in computed)], self.meta)


def has_spans(path) -> bool:
    return bool(span_files(path))


def read_spans(path) -> tuple[list[Span], dict[int, dict]]:
    """(spans sorted by rank and start, {rank: the file's meta line}) of a run / cell directory or file."""
    files = span_files(path)
    if not files:
        raise FileNotFoundError(f"No spans in {path}: expected spans/rank<N>.jsonl (recorded by every rank the kit "
                                f"starts with torch's pipelining imported; see labkit.spans).")
    spans, meta = [], {}
    for rank, f in files.items():
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a rank that died mid-write
            if "meta" in row:
                meta[rank] = row["meta"]
                continue
            if "end_step" in row:  # the step's wall time and the kit's own seconds in it (measured)
                meta.setdefault(rank, {}).setdefault("instrument", {})[int(row["end_step"])] = row
                continue
            if "begin_step" in row:
                meta.setdefault(rank, {}).setdefault("schedules", {})[int(row["begin_step"])] = row.get("schedule", "")
                if row.get("pipeline"):  # the ranks of this rank's pipeline in that step (its stage's group)
                    meta[rank].setdefault("pipelines", {})[int(row["begin_step"])] = row["pipeline"]
                if row.get("compile"):  # what torch.compile did in that step (labkit.spans.compiled)
                    meta[rank].setdefault("compile", {})[int(row["begin_step"])] = row["compile"]
                if row.get("first"):  # its schedule object's first step in the process: a warm-up
                    meta[rank].setdefault("first", []).append(int(row["begin_step"]))
                continue
            spans.append(Span(int(row.get("rank", rank)), int(row["step"]), row["kind"], int(row["stage"]),
                              int(row["mb"]), float(row["start"]), float(row["end"]), row.get("what", ""),
                              float(row.get("pre", 0.0)), float(row.get("post", 0.0)),
                              tuple((float(a), float(b)) for a, b in row.get("kit", ())),
                              tuple(float(c) for c in row.get("cpu", ())), tuple(float(c) for c in row.get("rq", ()))))
    spans.sort(key=lambda s: (s.rank, s.start, s.end))
    return spans, meta


def _steps(spans: list[Span]) -> list[int]:
    return sorted({s.step for s in spans if s.kind in COMPUTE_KINDS})


def select_step(spans: list[Span], which: str | int = "all") -> list[Span]:
    """`all`, `last` / `first` (per rank: the rank's last or first step with compute), or a step index."""
    if which == "all":
        return spans
    out = []
    for rank in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == rank]
        steps = _steps(mine)
        if not steps:
            continue
        k = steps[-1] if which == "last" else steps[0] if which == "first" else int(which)
        out += [s for s in mine if s.step == k]
    return out


def recorded_pipelines(spans: list[Span], meta: dict[int, dict]) -> list[list[int]] | None:
    """The pipelines the ranks of `spans` formed (`labkit.core.actions.group_pipelines` over the group each
    rank recorded for its last step among `spans`), or None when no rank recorded one (spans from
    before the kit recorded it)."""
    from ..core.actions import group_pipelines

    groups = {}
    for rank in sorted({s.rank for s in spans}):
        recorded = meta.get(rank, {}).get("pipelines", {})
        steps = [k for k in sorted({s.step for s in spans if s.rank == rank}) if k in recorded]
        if steps:
            groups[rank] = recorded[steps[-1]]
    return group_pipelines(groups) if groups else None


def instrument_overhead(spans: list[Span], meta: dict[int, dict]) -> dict[str, dict]:
    """Per rank (str keys, as in JSON), the kit's own time in the steps of `spans`, as each rank
    measured it (`labkit.spans.record`, the `end_step` lines): `seconds` (its wrappers around torch's
    calls plus the step's bookkeeping), `share` of `step_s` (the steps' wall time as the caller of
    `step()` saw it), and the parts. Ranks whose spans predate the measurement are left out."""
    out = {}
    for rank in sorted({s.rank for s in spans}):
        rows = meta.get(rank, {}).get("instrument", {})
        mine = [rows[k] for k in sorted({s.step for s in spans if s.rank == rank}) if k in rows]
        if not mine:
            continue
        kit, wall = sum(r["kit"] for r in mine), sum(r["wall"] for r in mine)
        out[str(rank)] = {"seconds": round(kit, 9), "share": round(kit / wall, 6) if wall > 0 else 0.0,
                          "step_s": round(wall, 9), "steps": len(mine),
                          "wrappers_s": round(sum(r["wrappers"] for r in mine), 9),
                          "bookkeeping_s": round(sum(r["bookkeeping"] for r in mine), 9),
                          "calls": sum(r["calls"] for r in mine)}
    return out


def compile_counts(meta: dict[int, dict], ranks=None, kept: set | None = None) -> dict[str, dict]:
    """Per rank (str keys, as in JSON), what torch.compile did (`labkit.spans.compiled.COUNTS`: frames
    compiled, graphs, graph breaks, recompiles, frames that fell back to eager), summed over the
    steps `kept` ({(rank, step)}; None: every step recorded) of `ranks` (None: every rank in `meta`),
    with each compiled stage's state at the last of them (`stages`: whether its compiled code ran,
    carried over cells and steps). {} when dynamo did nothing in them and no compiled stage ran; else
    every rank, those that compiled nothing at 0."""
    from .compiled import add, any_counts, zero

    ranks = sorted(meta) if ranks is None else sorted(ranks)
    out = {}
    for rank in ranks:
        steps = meta.get(rank, {}).get("compile", {})
        out[str(rank)] = zero()
        for k, counts in sorted(steps.items()):
            if kept is None or (rank, k) in kept:
                out[str(rank)] = add(out[str(rank)], counts)
    return out if any(any_counts(v) or v.get("stages") for v in out.values()) else {}


def machine_load(spans: list[Span], meta: dict[int, dict]) -> dict[str, dict]:
    """Per rank (str keys, as in JSON), how busy the machine was in the steps of `spans`: the seconds
    its thread was runnable but had no CPU inside its compute actions (`descheduled_in_actions_s`) and
    over its whole steps (`descheduled_in_steps_s`), its steps' wall and CPU seconds and CPU `share`,
    and at each step's end the load average and the runnable processes on `cores` cores
    (`labkit.spans.record`). Ranks recorded without scheduler clocks are left out; on CUDA
    (device-time spans) too: a kernel already queued is not descheduled with its host thread, what
    the host loses shows as later launches (gaps) instead."""
    out = {}
    for rank in sorted({s.rank for s in spans}):
        comp = [s for s in spans if s.rank == rank and s.kind in COMPUTE_KINDS and s.queued is not None]
        if not comp:
            continue
        rows = meta.get(rank, {}).get("instrument", {})
        mine = [rows[k] for k in sorted({s.step for s in spans if s.rank == rank}) if k in rows and "cpu" in rows[k]]
        wall, cpu = sum(r["wall"] for r in mine), sum(r["cpu"] for r in mine)
        out[str(rank)] = {
            "descheduled_in_actions_s": round(sum(s.queued for s in comp), 9),
            "descheduled_in_steps_s": round(sum(r.get("queued", 0.0) for r in mine), 9),
            "compute_s": round(sum(s.end - s.start for s in comp), 9),
            "step_s": round(wall, 9), "cpu_s": round(cpu, 9), "share": round(cpu / wall, 4) if wall > 0 else None,
            "load1": [r.get("load1") for r in mine], "runnable": [r.get("runnable") for r in mine],
            "cores": next((r.get("cores") for r in mine), None)}
    return out


def _key(rank, stage, kind, mb, start) -> str:
    return f"{rank}:{stage}:{kind}:{mb}:{start!r}"


def without_descheduling(tl: Timeline) -> Timeline:
    """`tl` with each compute action shortened by the seconds its rank waited for a CPU inside it
    (spans with scheduler clocks): the costs a fitted ideal reads from it leave out what a busy
    machine added (`labkit.timeline.compare.fitted_ideal(without_descheduling(tl), shape)`)."""
    queued = tl.meta.get("queued_s", {})
    acts = [a._replace(end=a.end - min(a.duration,
                                       queued.get(_key(a.rank, a.stage, a.kind, a.microbatch, a.start), 0.0)))
            if a.kind in COMPUTE_KINDS else a for a in tl.actions]
    return Timeline(acts, source=tl.source, meta={**tl.meta, "costs_from": "wall time less descheduled time"})


def makespan_without_load(tl: Timeline) -> float:
    """One step's makespan less the longest time one of its ranks waited for a CPU in it (spans with
    scheduler clocks: `machine_load`'s `descheduled_in_steps_s`; the plain makespan without them):
    what a busy machine added to that step, taken out, so that steps measured at different moments
    of a laptop's load compare (notebook 13). A rank that waits for a core delays the ranks after it
    too, so this is the least that load added."""
    load = tl.meta.get("machine_load", {})
    return tl.metrics()["makespan"] - max((r["descheduled_in_steps_s"] for r in load.values()), default=0.0)


def timeline_from_spans(path, which: str | int = "all") -> Timeline:
    """The measured timeline of a run directory, a live-ranks cell directory, or spans files."""
    spans, meta = read_spans(path)
    spans = select_step(spans, which)
    acts = []
    for rank in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == rank]  # in start order (read_spans sorts)
        last_stage = next((s.stage for s in reversed(mine) if s.kind in COMPUTE_KINDS), 0)
        row = last_stage  # a transfer is drawn in the row of the stage that computes next (last at the end)
        for s in reversed(mine):
            if s.kind in COMPUTE_KINDS:
                row = s.stage
                acts.append(Action(s.rank, s.stage, s.mb, s.kind, s.start, s.end))
            else:
                kind = s.kind if s.kind != "WAIT" else ("RECV" if s.what in ("recv", "both") else "SEND")
                acts.append(Action(s.rank, s.stage if s.stage >= 0 else row, -1, kind, s.start, s.end))
    steps_per_rank = {str(r): len(_steps([s for s in spans if s.rank == r])) for r in sorted({s.rank for s in spans})}
    clocks = sorted({m.get("clock", "?") for m in meta.values()})
    kept = {(s.rank, s.step) for s in spans}
    names = [name for r, m in sorted(meta.items()) for k, name in sorted(m.get("schedules", {}).items())
             if (r, k) in kept and name]
    tl = Timeline(sorted(acts, key=lambda a: (a.start, a.rank)), source="spans", meta={
        "schedule": names[-1] if names else None, "steps": max(steps_per_rank.values(), default=0),
        "steps_per_rank": steps_per_rank, "clock": clocks[0] if len(clocks) == 1 else clocks,
        "torch": next((m.get("torch") for m in meta.values()), None),
        "files": [str(f) for f in span_files(path).values()],
        "starts": "measured: both ends of every action (labkit.spans)"},
        recorded=Recorded(spans, meta))  # every clock, for what the actions cannot say (explain_slowdown)
    own = instrument_overhead(spans, meta)
    if own:  # the kit's share of each rank's steps, measured in the rank
        tl.meta["instrument_overhead"] = own
    load = machine_load(spans, meta)
    if load:  # how busy the machine was: descheduled time and load, per rank
        tl.meta["machine_load"] = load
    queued = {_key(s.rank, s.stage, s.kind, s.mb, s.start): s.queued for s in spans
              if s.kind in COMPUTE_KINDS and s.queued}
    if queued:  # each compute action's seconds without a CPU (`without_descheduling`)
        tl.meta["queued_s"] = queued
    dynamo = compile_counts(meta, {s.rank for s in spans}, kept)
    if dynamo:  # what torch.compile did in these steps, per rank (labkit.spans.compiled)
        tl.meta["compile"] = dynamo
    pipelines = recorded_pipelines(spans, meta)
    if pipelines and len(pipelines) > 1:  # several pipelines (pp x dp, pp x dp x tp): Timeline.split_pipelines
        tl.meta["pipelines"] = pipelines
    return tl



class KindTimes(NamedTuple):
    """One rank's step by kind of span (`time_by_kind`), in seconds."""

    step: float    # the rank's window: its first span's start to its last span's end
    busy: float    # covered by any span (step - busy: between spans, the runtime's own Python)
    kinds: dict    # {kind: seconds covered by that kind's spans}

    def shares(self) -> dict[str, float]:
        """{kind: its share of the step}."""
        return {k: (t / self.step if self.step > 0 else 0.0) for k, t in self.kinds.items()}


def time_by_kind(spans_or_path, which: str | int = "last") -> dict[int, KindTimes]:
    """Per rank, how one step's time (`which`: last by default, as `select_step`) splits by kind of
    span: F, B, I, W, SEND, RECV, WAIT, and FSDP2's UNSHARD, RESHARD, REDUCE_GRAD (notebook 12:
    what FSDP costs). A kind's time is the union of its spans, so nested or repeated calls count once
    (torch 2.15's perform_reduce_grad is a REDUCE_GRAD around its own start and wait). Pure: takes
    spans or a path `read_spans` reads."""
    spans = spans_or_path if isinstance(spans_or_path, list) else read_spans(spans_or_path)[0]
    spans = select_step(spans, which)
    out = {}
    for rank in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == rank]
        kinds = {k: union_length([(s.start, s.end) for s in mine if s.kind == k])
                 for k in sorted({s.kind for s in mine})}
        out[rank] = KindTimes(max(s.end for s in mine) - min(s.start for s in mine),
                              union_length([(s.start, s.end) for s in mine]), kinds)
    return out
