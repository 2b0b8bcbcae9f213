"""One measurement's steps read along their critical paths, for `labkit.timeline.slowdown`: each step's
time split into causes (`CAUSES`) that add up to it, one `_Reading` per step and their mean.

A measurement is a `Timeline`, a run directory, a live-ranks cell directory or a spans file (`_load`),
read one way: as a `Timeline` (`timeline_from_spans` where it has spans, else `load_timeline`), then from
every clock that Timeline carries (`Timeline.recorded`: the spans of its steps and ranks, with the run queue
between actions, the kit's own time, the load and dynamo's counts per step), or from its actions alone where
it carries none (logs, profiler traces, theory). Steps in which torch.compile compiled, and steps that warmed
up (a schedule object's first step in its process: its stages infer their shapes and set up their transfers,
the allocator warms up), are left out where the measurement has warm ones (`_warm`): they time the compiler
and the set-up, not the code. Each step is followed from the action
that ends it back through what each action waited for last (its rank's previous action, or the input it
needed from another stage) down to the step's start; every piece of that path gets one cause
(`_Tally`). How busy the machine was over the measurement's steps (`_Loaded.load`, the spans'
`machine_load`) travels with it, for the quiet rule (`labkit.spans.quiet`).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from statistics import mean
from typing import NamedTuple

from ..core.actions import COMPUTE_KINDS, Timeline
from ..spans.read import (Span, has_spans, machine_load, recorded_pipelines, timeline_from_spans,
                         without_descheduling)
from .rank_time import _merged, _minus, _Rank

CAUSES = ("machine", "compute", "waiting", "communication", "kit")


class _Loaded(NamedTuple):
    """One measurement as spans (a `Timeline`'s actions made into spans), before it is read."""

    spans: list[Span]
    pipeline_of: dict[int, int]
    clocked: bool   # every compute span has its run-queue clock
    kit: bool       # the kit's own time was measured
    notes: list[str]
    load: dict      # how busy the machine was over its steps, per rank (`labkit.spans.read.machine_load`; {}: not read)
    left_out: list[tuple[int, float, dict, str]] = []
    """The steps left out (`_warm`): (step, 1 for the first; its time in seconds; {rank: dynamo's counts in
    it}, {} for a warm-up; why: "compiled" or "warm-up")."""
    every_step_compiled: bool = False  # ... and none was left: every step compiled (no warm step to compare)
    every_step_cold: bool = False      # ... or every step warmed up or compiled, not every one compiled


def _load(x, source: str, name: str) -> _Loaded:
    """One measurement, however given, read the one way: as a `Timeline` (a run or cell directory, or a spans
    file, through `timeline_from_spans` where it has spans, else `load_timeline`), then `_from_timeline`."""
    if isinstance(x, Timeline):
        return _from_timeline(x, name)
    if not isinstance(x, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a Timeline, a run directory or a spans file, got {type(x).__name__}.")
    if source in ("auto", "spans") and has_spans(x):
        return _from_timeline(timeline_from_spans(x), name)
    from .compare import load_timeline

    return _from_timeline(load_timeline(x, source), name)


def _from_timeline(tl: Timeline, name: str) -> _Loaded:
    """A timeline's steps: from every clock its ranks recorded where it carries them (`Timeline.recorded`:
    the spans of the steps and ranks it holds), else from its actions alone (`_from_actions`)."""
    recorded = tl.recorded.of(tl) if tl.recorded is not None else None
    if recorded is None:
        return _from_actions(tl, name)
    spans, meta = recorded
    spans, left_out, every = _warm(spans, meta)
    comp = [s for s in spans if s.kind in COMPUTE_KINDS]
    clocked = bool(comp) and all(s.rq for s in comp)
    notes = []
    if not clocked:
        cuda = any(str(m.get("clock", "")).startswith("cuda") for m in meta.values())
        notes.append(f"{name}: no scheduler clocks in its spans (" + ("CUDA spans time the device, not the host's "
                     "run queue" if cuda else "recorded before the kit read the run queue, or not on Linux") + ").")
    compiled_all = bool(every) and all(why == "compiled" for why in every.values())
    if compiled_all:
        notes.append(f"{name}: torch.compile compiled in " + ("its only step" if len(every) == 1 else
                     f"each of its {len(every)} steps") + ": no warm step to compare, so it is compared as it is "
                     "(run more steps).")
    elif every:
        notes.append(f"{name}: " + ("its only step warmed up" if len(every) == 1 else f"each of its {len(every)} "
                     "steps warmed up" + (" or compiled" if "compiled" in every.values() else "")) + " (its "
                     "schedule's first step in the process: its stages set up their shapes and transfers): no warm "
                     "step to compare, so it is compared as it is (run more steps).")
    kit = any(s.own() for s in spans) or any("instrument" in m for m in meta.values())
    pipes = enumerate(recorded_pipelines(spans, meta) or [])
    return _Loaded(spans, {r: i for i, p in pipes for r in p}, clocked, kit, notes, machine_load(spans, meta),
                   left_out, compiled_all, bool(every) and not compiled_all)


def _compiling(counts: dict | None) -> bool:
    """Whether dynamo compiled (or tried to) in a step, by its counts (`labkit.spans.compiled`): frames or
    graphs made, recompiles, or frames it could not compile (those met at a recompile limit are not tried)."""
    c = counts or {}
    return bool(c.get("frames") or c.get("graphs") or c.get("recompiles")
                or c.get("fell_back", 0) > c.get("at_limit", 0))


def _warm(spans: list[Span], meta: dict) -> tuple[list[Span], list[tuple[int, float, dict, str]], dict[int, str]]:
    """(the spans of the warm steps, [(step, its time, {rank: counts}, why)] of the others, {}), or, when no
    step is warm, (every span, [], {step: why} for every step): the ranks' k-th steps together, a step left
    out when torch.compile compiled in it on any rank (dynamo's counts on its `begin_step` line: why
    "compiled") or, else, when it was its schedule object's first step in the process on any rank (its
    `"first"` mark, `labkit.spans.recorder`: why "warm-up", counts {})."""
    numbers: dict[tuple[int, int], int] = {}
    for r in sorted({s.rank for s in spans}):
        ids = sorted({s.step for s in spans if s.rank == r and s.kind in COMPUTE_KINDS})
        numbers.update({(r, step): k for k, step in enumerate(ids)})
    counts: dict[int, dict] = {}
    first: set[int] = set()
    for (r, step), k in numbers.items():
        c = meta.get(r, {}).get("compile", {}).get(step)
        if _compiling(c):
            counts.setdefault(k, {})[r] = c
        if step in meta.get(r, {}).get("first", ()):
            first.add(k)
    why = {k: "compiled" if k in counts else "warm-up" for k in sorted(first | set(counts))}
    if not why:
        return spans, [], {}
    if len(why) == len(set(numbers.values())):
        return spans, [], {k + 1: w for k, w in why.items()}
    out, times = [], {}
    for s in spans:
        k = numbers.get((s.rank, s.step))
        if k in why:
            if s.kind in COMPUTE_KINDS:
                lo, hi = times.get(k, (s.start, s.end))
                times[k] = (min(lo, s.start), max(hi, s.end))
        else:
            out.append(s)
    return out, [(k + 1, times[k][1] - times[k][0], counts.get(k, {}), w) for k, w in why.items()], {}


def _from_actions(tl: Timeline, name: str) -> _Loaded:
    """A timeline's actions as spans: each compute action with a run-queue clock made from its descheduled
    seconds (`without_descheduling`; none between actions), each receive as the wait for it (as
    `labkit.spans.read` draws one), cut into steps as `compute_steps` cuts them."""
    steps = max(1, int(tl.meta.get("steps") or 1))
    clocked = "queued_s" in tl.meta or bool(tl.meta.get("machine_load"))
    queued = {id(a): a.duration - s.duration for a, s in zip(tl.actions, without_descheduling(tl).actions)}
    spans = []
    for rank in tl.ranks:
        mine = sorted((a for a in tl.actions if a.rank == rank), key=lambda a: (a.start, a.end))
        comp = [a for a in mine if a.kind in COMPUTE_KINDS]
        n = max(1, len(comp) // steps)
        cuts = [comp[i * n].start for i in range(1, steps) if i * n < len(comp)]
        level = 0.0
        for a in mine:
            step = bisect_right(cuts, a.start)
            if a.kind in COMPUTE_KINDS:
                q = queued[id(a)]
                spans.append(Span(rank, step, a.kind, a.stage, a.microbatch, a.start, a.end,
                                  rq=(level, level + q) if clocked else ()))
                level += q
            else:
                kind, what = ("WAIT", "recv") if a.kind == "RECV" else (a.kind, "")
                spans.append(Span(rank, step, kind, -1, -1, a.start, a.end, what))
    notes = []
    if not clocked:
        origin = {"measured": "torch's PP logs", "profiler": "a profiler trace", "theory": "a simulation"}
        notes.append(f"{name}: a timeline from {origin.get(tl.source, tl.source)} has no scheduler clocks.")
    elif tl.source == "spans":
        notes.append(f"{name}: a Timeline made anew from its actions (or with its times moved) keeps each action's "
                     f"descheduled time, not the time between actions nor the kit's; pass its run directory, or "
                     f"the Timeline as it was read (it carries its clocks), for both.")
    return _Loaded(spans, tl.pipeline_of(), clocked, False, notes, dict(tl.meta.get("machine_load") or {}))


class _Tally:
    """The causes of one step's critical path, piece by piece."""

    def __init__(self):
        self.causes = dict.fromkeys(CAUSES, 0.0)
        self.by_stage: dict[tuple[int, str], float] = {}
        self.in_actions = 0.0  # the machine's part inside the path's actions

    def add(self, rank: _Rank, cause, pieces: list[tuple[float, float]], sender=None) -> None:
        """`pieces` of `rank`'s time, to `cause` (a (stage, kind) for compute) less the machine's part: its
        run-queue clock over them, and on a hand-off the `sender`'s ((its `_Rank`, until when) it had no CPU
        to send)."""
        length = sum(b - a for a, b in pieces)
        queued = sum(rank.queued(a, b) for a, b in pieces)
        if sender is not None:
            other, until = sender
            queued += sum(other.queued(a, min(b, until)) for a, b in pieces if a < until)
        machine = min(length, queued)
        self.causes["machine"] += machine
        if isinstance(cause, tuple):
            self.in_actions += machine
            self.by_stage[cause] = self.by_stage.get(cause, 0.0) + length - machine
            cause = "compute"
        self.causes[cause] += length - machine

    def between(self, rank: _Rank, lo: float, hi: float, sender=None) -> None:
        """[lo, hi] on `rank` between two actions: sends and receives, waits (for the input from another
        rank on a hop, from a `sender`: communication), the kit's own, the rest; on a hop, the time the
        sender was runnable without a CPU while handing its output on is the machine's."""
        taken: list[tuple[float, float]] = []
        waits = "communication" if sender else "waiting"
        for cause, covered in (("communication", rank.posts), (waits, rank.waits), ("kit", rank.kit)):
            pieces = _minus(_merged(covered.near(lo, hi), lo, hi), taken)
            self.add(rank, cause, pieces, None if cause == "kit" else sender)
            taken = _merged(taken + pieces, lo, hi)
        self.add(rank, "waiting", _minus([(lo, hi)] if hi > lo else [], taken), sender)


def _inputs(s: Span) -> list[tuple[int, int, str]]:
    """(stage, microbatch, kind) of the actions whose output `s` needs (`labkit.theory.simulate`'s rule)."""
    if s.kind == "F":
        return [(s.stage - 1, s.mb, "F")]
    if s.kind in ("B", "I"):
        return [(s.stage, s.mb, "F"), (s.stage + 1, s.mb, "B"), (s.stage + 1, s.mb, "I")]
    return [(s.stage, s.mb, "I")]


def _critical_path(comp: dict[int, list[Span]], ranks: dict[int, _Rank], pipeline_of: dict[int, int]):
    """(step time, `_Tally` of its causes) of one step (`comp`: each rank's compute spans in time order)."""
    every = [s for mine in comp.values() for s in mine]
    made = {(pipeline_of.get(s.rank, 0), s.stage, s.mb, s.kind): s for s in every}
    previous = {s: p for mine in comp.values() for p, s in zip(mine, mine[1:])}
    t0, t1 = min(s.start for s in every), max(s.end for s in every)
    tally, s, cursor = _Tally(), max(every, key=lambda x: x.end), t1
    while True:
        lo = min(s.start, cursor)
        tally.add(ranks[s.rank], (s.stage, s.kind), [(lo, cursor)])
        cursor = lo
        options = [previous.get(s)] + [made.get((pipeline_of.get(s.rank, 0), *k)) for k in _inputs(s)]
        options = [p for p in options if p is not None and p.start < s.start]
        if not options:
            break
        p = max(options, key=lambda x: x.end)  # what it waited for last (its own rank's on a tie)
        lo = min(p.end, cursor)
        sender = ranks[p.rank]  # on a hop, its clock until its next action (posting and waiting for sends)
        tally.between(ranks[s.rank], lo, cursor, (sender, sender.next_action(p.end)) if p.rank != s.rank else None)
        cursor, s = lo, p
    tally.between(ranks[s.rank], t0, cursor)
    return t1 - t0, tally


class _Reading(NamedTuple):
    """One step's (or a mean step's) time, its causes, compute per (stage, kind) on the critical path, one
    action's mean time less its descheduling per (stage, kind), and the machine's part inside actions."""

    step: float
    causes: dict[str, float]
    by_stage: dict[tuple[int, str], float]
    per_action: dict[tuple[int, str], float]
    in_actions: float


def _reading(m: _Loaded, clocked: bool, kit: bool) -> tuple[_Reading, list[_Reading]]:
    """One measurement read step by step: (its mean step, one `_Reading` per step in order). The mean's
    `per_action` is over every action of every step (a step's over its own)."""
    ranks = {r: _Rank([s for s in m.spans if s.rank == r], clocked, kit) for r in sorted({s.rank for s in m.spans})}
    steps: dict[int, dict[int, list[Span]]] = {}
    own: dict[int, dict[tuple[int, str], list[float]]] = {}
    for r in ranks:
        comp = [s for s in m.spans if s.rank == r and s.kind in COMPUTE_KINDS]
        numbers = {n: i for i, n in enumerate(sorted({s.step for s in comp}))}  # the rank's k-th step
        for s in sorted(comp, key=lambda x: (x.start, x.end)):
            k = numbers[s.step]
            steps.setdefault(k, {}).setdefault(r, []).append(s)
            own.setdefault(k, {}).setdefault((s.stage, s.kind), []).append(
                s.end - s.start - ranks[r].queued(s.start, s.end))
    if not steps:
        raise ValueError("This measurement has no compute actions (F, B, I, W): nothing to compare.")
    each = []
    for k, comp in sorted(steps.items()):
        time, tally = _critical_path(comp, ranks, m.pipeline_of)
        each.append(_Reading(time, dict(tally.causes), dict(tally.by_stage),
                             {key: mean(v) for key, v in sorted(own[k].items())}, tally.in_actions))
    pooled: dict[tuple[int, str], list[float]] = {}
    for per_step in own.values():
        for key, v in per_step.items():
            pooled.setdefault(key, []).extend(v)
    stages = sorted({k for x in each for k in x.by_stage})
    return _Reading(mean(x.step for x in each), {c: mean(x.causes[c] for x in each) for c in CAUSES},
                    {k: mean(x.by_stage.get(k, 0.0) for x in each) for k in stages},
                    {k: mean(v) for k, v in sorted(pooled.items())}, mean(x.in_actions for x in each)), each
