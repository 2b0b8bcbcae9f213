"""From parsed log events to a measured `Timeline`: the one home of the interval and wait policy.

This module owns how work intervals are built from the marks torch logs (START lines of the
multi-stage runtime, completion lines of GPipe / 1F1B, OVERLAP_F_B splits, forward-only runs) and
how the time a rank spends waiting for a neighbour is taken out of them (`WAITS`):

- `fold`: as logged; every wait is inside the action that follows it, so the bubble is hidden.
- `split`: an action that needs a neighbour's tensor starts no earlier than that neighbour's
  `Sending ...` line (evidence from the logs; it only moves starts later).
- `trim`: `split`, then `trim_waits`: what waiting is left is cut to the shortest duration of that
  kind of action on that stage (an estimate). What `labkit.timeline.compare.load_timeline` reads by default.

The events come from `labkit.logs.parse`; what each message means is `labkit.logs.messages`'s.
Taught in notebook 06 (reading PP logs); notebooks 04-05 compare these timelines with theory.
"""

from __future__ import annotations

import bisect
import operator
import os
import time as _time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable

from ..core.actions import COMPUTE_KINDS, Action, Timeline
from .messages import END, TIMELINE_KINDS, Event
from .files import log_files, parse_files
from .parse import gc_paused

__all__ = ["WAITS", "to_timeline", "timeline_from_path", "trim_waits"]

WAITS = ("fold", "split", "trim")


def _by_rank(events: list[Event]) -> dict[int, list[Event]]:
    out: dict = defaultdict(list)
    for e in events:
        out[e.rank].append(e)
    lone = out.pop(None, None)
    if lone is not None and not out:
        out[0] = lone  # one file and no rank anywhere: it is rank 0
    for evs in out.values():
        # Several files for one rank (or a clock step): order by time, stable for equal stamps.
        times = [e.time for e in evs]
        if any(map(operator.gt, times, times[1:])):
            evs.sort(key=operator.attrgetter("time"))
    return dict(out)


_BACKWARD_FAMILY = ("B", "I", "W")


def _runtime_actions(rank: int, evs: list[Event], other: Counter, notes: list[str]) -> tuple[list[Action], int]:
    """Runtime schedules: an action runs from its "running ... action" line to the next one; a
    step's last action (the next line restarts time_step) ends at its completion line, else at the
    last line before the next step."""
    acts: list[Action] = []
    # Forward-only runs (loss_fn=None) still step through the planned B/I/W/SEND_B/RECV_B actions,
    # which return at once: with no "Backwarded chunk" line on the rank, they are dropped.
    ran_backward = any(e.origin == "stage" and e.kind == "B" for e in evs)
    dropped = 0
    steps = 0
    pending: Event | None = None
    p_last = p_done = 0.0
    p_found = False
    inside: list[Event] | None = None  # completion lines inside an OVERLAP_F_B action

    def emit(e: Event, end: float) -> None:
        nonlocal dropped
        if end < e.time:
            end = e.time
        kind = e.kind
        if not ran_backward and (kind in _BACKWARD_FAMILY or (kind in ("SEND", "RECV") and "_B" in e.action)):
            dropped += 1
        elif e.sub:
            subs = _split_overlap(rank, e, inside or [], end)
            if not ran_backward:
                dropped += sum(1 for a in subs if a.kind in _BACKWARD_FAMILY)
                subs = [a for a in subs if a.kind not in _BACKWARD_FAMILY]
            acts.extend(subs)
        elif kind in TIMELINE_KINDS:
            acts.append(Action(rank, e.stage, e.microbatch, kind, e.time, end))
        else:
            other[kind or (e.action or "?")] += 1

    for e in evs:
        if e.origin == "runtime":
            if pending is None:
                steps += 1
            elif e.time_step > pending.time_step:
                emit(pending, e.time)
            else:  # time_step restarted: a new schedule.step()
                emit(pending, p_done if p_found else p_last)
                steps += 1
            pending, p_last, p_found = e, e.time, False
            inside = [] if e.sub else None
        elif pending is not None:
            if e.time > p_last:
                p_last = e.time
            if e.mark == END:
                if inside is not None:
                    inside.append(e)
                if not p_found and e.stage == pending.stage and e.microbatch == pending.microbatch and \
                        _same_family(e.kind, pending.kind):
                    p_done, p_found = e.time, True
    if pending is not None:
        emit(pending, p_done if p_found else p_last)
    if dropped:
        notes.append(f"rank {rank}: {dropped} backward actions (B/I/W/SEND_B/RECV_B) ran without any backward "
                     f"(forward-only run) and were dropped")
    return acts, steps


def _same_family(done_kind: str | None, kind: str | None) -> bool:
    """A completion line's kind (F, or B for any backward) matches an action's kind."""
    return done_kind == kind or (done_kind == "B" and kind in ("I", "B"))


def _split_overlap(rank: int, e: Event, inside: list[Event], end: float) -> list[Action]:
    """OVERLAP_F_B runs its sub-actions one after the other: each ends at its completion line."""
    acts, t = [], e.time
    subs = list(e.sub)
    for n, (kind, stage, mb) in enumerate(subs):
        if n == len(subs) - 1:
            stop = end
        else:
            hit = next((x.time for x in inside if x.mark == END and x.stage == stage and x.microbatch == mb
                        and _same_family(x.kind, kind) and x.time >= t), None)
            stop = hit if hit is not None else t + (end - t) / (len(subs) - n)
        stop = min(max(stop, t), end)
        acts.append(Action(rank, stage, mb, kind, t, stop))
        t = stop
    return acts


def _completion_actions(rank: int, evs: list[Event], meta_notes: list[str]) -> tuple[list[Action], int]:
    """GPipe / 1F1B: only completion lines. An action starts where the previous one on the rank
    ended (recv waits fold into the compute); the first starts at the step's set-up line."""
    use = "schedule" if any(e.origin == "schedule" for e in evs) else "stage"
    done = [e for e in evs if e.origin == use and e.mark == END and e.kind in ("F", "B", "I", "W")]
    if use == "schedule" and not any(e.origin == "stage" and e.kind == "B" for e in evs):
        # GPipe logs "Backwarded microbatch" even when no backward ran (loss_fn=None).
        dropped = sum(1 for e in done if e.kind == "B")
        if dropped:
            meta_notes.append(f"rank {rank}: {dropped} 'Backwarded microbatch' lines without any backward "
                              f"(forward-only run) were dropped")
        done = [e for e in done if e.kind != "B"]
    if not done:
        return [], 0
    first = done[0]
    before = evs[:next(i for i, e in enumerate(evs) if e is first)]
    setup = [e for e in before if e.kind in ("SCHEDULE", "INIT")]
    prev = setup[-1].time if setup else first.time
    acts, seen, steps = [], set(), 1
    for e in done:
        key = (e.stage, e.kind, e.microbatch)
        if key in seen:  # the same work again: the next schedule.step()
            seen.clear()
            steps += 1
        seen.add(key)
        acts.append(Action(rank, e.stage, e.microbatch, e.kind, min(prev, e.time), e.time))
        prev = e.time
    return acts, steps


def _send_times(by_rank: dict[int, list[Event]]) -> dict[tuple, list[float]]:
    """{("F" | "B", receiving stage, microbatch): [times its input was sent]} from the
    `Sending tensor|gradient` lines. The microbatch is the runtime SEND action's, or (single-stage
    schedules) the one the sending stage finished last."""
    sent: dict[tuple, list[float]] = defaultdict(list)
    for evs in by_rank.values():
        last: dict[tuple, int] = {}
        cur: Event | None = None
        for e in evs:
            if e.origin == "runtime":
                cur = e
            elif e.mark == END:
                last[(e.stage, "F" if e.kind == "F" else "B")] = e.microbatch
            elif e.kind == "P2P":
                fam = e.action[-1]
                if cur is not None and cur.kind == "SEND" and cur.stage == e.stage and f"SEND_{fam}" in cur.action:
                    mb = cur.microbatch
                else:
                    mb = last.get((e.stage, fam))
                if mb is not None:
                    sent[(fam, e.stage + 1 if fam == "F" else e.stage - 1, mb)].append(e.time)
    for ts in sent.values():
        ts.sort()
    return sent


def _split_waits(acts: list[Action], sent: dict[tuple, list[float]]) -> list[Action]:
    """Start each F / B / I no earlier than its input left the neighbouring rank."""
    out = []
    for a in acts:
        if a.kind in ("F", "B", "I"):
            ts = sent.get(("F" if a.kind == "F" else "B", a.stage, a.microbatch))
            if ts:
                i = bisect.bisect_right(ts, a.end) - 1  # this step's send: the last one before the work ended
                if i >= 0 and ts[i] > a.start:
                    a = Action(a.rank, a.stage, a.microbatch, a.kind, ts[i], a.end)
        out.append(a)
    return out


def to_timeline(events: list[Event], source: str = "measured", waits: str = "fold") -> Timeline:
    """Per-rank, per-stage work intervals from parsed events.

    Multi-stage (runtime) schedules print `running time_step t, action a` BEFORE each action: an
    action starts at its line and ends at the next action's line on the same rank, so the rank's
    intervals tile its time; a step's last action ends at its completion line (or the step's last
    line). `(F;B)OVERLAP_F_B` is split into its sub-actions at the first one's completion line.
    SEND and RECV actions only post the p2p ops and are kept with kind SEND / RECV; the wait for a
    RECV happens at the start of the F / B / I that needs it, so it folds into that compute.
    UNSHARD, RESHARD, REDUCE_GRAD are counted in `meta["other_actions"]`, and so are torch 2.15's
    waits (`1WAIT_SEND_F0`, `1WAIT_SEND_B0`, `0WAIT_REDUCE_GRAD`: the runtime waiting for a send it
    posted, or for a gradient reduction, to complete): waiting is not compute, so the action before
    a wait ends where the wait begins and the wait itself is idle time on the timeline.

    GPipe and 1F1B print only completion lines (`Forwarded microbatch` / `Forwarded chunk`): an
    action starts at the previous completion on its rank (the first one at the `Using ...` /
    `inference_mode` set-up line), so time spent waiting for a recv folds into the compute that
    follows it, and from the second step on the first action also holds the time between steps.

    With the default `waits="fold"` the bubble a rank spends waiting for its neighbour is therefore
    counted as compute (GPipe's measured bubble comes out far below (p-1)/(m+p-1)).

    `waits="split"` takes the waits out of the compute: an F (B, I) whose input comes from another
    rank starts no earlier than that rank's `Sending tensor` (`Sending gradient`) line for the same
    microbatch, so the wait shows as idle time (the bubble). The data cannot have arrived before
    it was sent, so this only moves starts later; it needs one clock for all ranks (one machine,
    or well-synchronised nodes) and, in the default format, has millisecond resolution.
    `waits="trim"` then applies `trim_waits` to what waiting is left.

    Forward-only runs (loss_fn=None) still log the backward actions they skip (GPipe's
    `Backwarded microbatch`, the runtime's B/I/W/SEND_B/RECV_B): on a rank with no
    `Backwarded chunk` line at all they are dropped, and `meta["notes"]` says so.

    Runs of several steps hold every step's actions (`meta["steps"]` says how many). `meta` also
    holds the schedule class, the timing rule used per rank ("runtime" or "completion") and the
    other runtime actions seen. Times are seconds as logged (epoch; local time for the default
    format): `Timeline.shifted()` makes them start at 0.
    """
    if waits not in WAITS:
        raise ValueError(f"waits must be 'fold' (recv waits inside the compute), 'split' (waits shown "
                         f"as idle time) or 'trim' (split, then trim_waits), got {waits!r}.")
    with gc_paused():
        tl = _to_timeline(events, source, "split" if waits == "trim" else waits)
    return trim_waits(tl) if waits == "trim" else tl


def _to_timeline(events: list[Event], source: str, waits: str) -> Timeline:
    notes: list[str] = []
    other: Counter = Counter()
    acts: list[Action] = []
    timing: dict[str, str] = {}
    steps: dict[str, int] = {}
    schedule = None
    by_rank = _by_rank(events)
    for rank, evs in sorted(by_rank.items()):
        schedule = schedule or next((e.action for e in evs if e.kind == "SCHEDULE"), None)
        if any(e.origin == "runtime" for e in evs):
            a, n = _runtime_actions(rank, evs, other, notes)
            timing[str(rank)] = "runtime"
        else:
            a, n = _completion_actions(rank, evs, notes)
            timing[str(rank)] = "completion"
        steps[str(rank)] = n
        acts += a
    # Each rank's actions are already in time order, and ranks come in order.
    if waits == "split":
        acts = _split_waits(acts, _send_times(by_rank))
    meta = {"schedule": schedule, "timing": timing, "waits": waits, "steps": max(steps.values(), default=0),
            "steps_per_rank": steps, "other_actions": dict(other), "notes": notes,
            "n_events": len(events)}
    return Timeline(acts, source=source, meta=meta)


def timeline_from_path(paths: str | os.PathLike | Iterable[str | os.PathLike], year: int | None = None,
                       waits: str = "fold") -> Timeline:
    """A measured Timeline from a run directory, or from one or more log files (either format);
    `waits` as in `to_timeline`."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = log_files(p)
            if not found:
                raise FileNotFoundError(f"No logs in {p}: expected logs/<id>/attempt_0/<rank>/stderr.log "
                                        "or *.log files.")
            files += found
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p} does not exist: pass a run directory or log files.")
    t0 = _time.perf_counter()
    tl = to_timeline(parse_files(files, year, meaning_only=True), waits=waits)
    tl.meta["files"] = [str(f) for f in files]
    tl.meta["parse_s"] = _time.perf_counter() - t0
    return tl


def trim_waits(tl: Timeline) -> Timeline:
    """Take the waiting out of log-measured actions: start = max(start, end - d(stage, kind)).

    torch logs mark when work ENDS (GPipe/1F1B) or when an action is picked (the runtime), and the
    wait for an incoming activation or gradient happens inside the action: read naively, a rank
    is never idle and the bubble is hidden. `d(stage, kind)` is the shortest duration that kind
    of action took on that stage in this run, i.e. one that did not wait. This is an estimate: it
    needs at least one action of each (stage, kind) that did not wait (true for m >= 2), and it
    takes the variation of compute time for waiting. Profiler traces (`--profile`) measure instead.
    """
    shortest: dict[tuple[int, str], float] = {}
    for a in tl.compute():
        key = (a.stage, a.kind)
        shortest[key] = min(shortest.get(key, a.duration), a.duration)
    acts = [Action(a.rank, a.stage, a.microbatch, a.kind, max(a.start, a.end - shortest[(a.stage, a.kind)]), a.end)
            if a.kind in COMPUTE_KINDS else a for a in tl.actions]
    meta = {**tl.meta,
            "waits": "trimmed: start = max(logged start, end - shortest duration of that kind on that stage)"}
    return Timeline(acts, tl.source, meta)
