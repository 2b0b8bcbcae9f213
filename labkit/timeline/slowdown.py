"""Why is this step slower: two measurements of the same schedule, the change in their mean step time
split into causes that add up to it exactly (`explain_slowdown`, `labkit timeline --compare A B`).

Each step is read along its critical path: from the action that ends the step back through what each
action waited for last (its rank's previous action, or the input it needed from another stage: an
F's from the stage before, a B's or I's from the stage after, a W's from its own I), down to the
step's start. The path's pieces tile the step, so they add up to its time; each moment of it gets one
cause (`CAUSES`):

- **machine**: its rank was runnable but had no CPU (the run-queue clock of spans with scheduler
  clocks, `labkit.spans.read.Span.queued`), inside an action or between two; where the path crosses
  from one rank to the next, so was the sending rank while it handed its output on (from its action's
  end to its next action: posting and waiting for its sends);
- **compute**: the path's actions less that, per stage and kind (`Slowdown.by_stage`);
- **communication**: between two actions, posting sends and receives, waits for sends, FSDP2's
  collectives, and where the path crosses from one rank to the next, the wait for the receive that
  brings the input (its producer is done: the data is in flight);
- **waiting**: between two actions, in no span at all (the schedule's own Python, the loss, the
  pipeline's fill) or in a wait for a receive the path does not trace to its producer;
- **kit**: the kit's own wrappers around torch's calls (`Span.own`, measured by `labkit.spans.record`).

A slower stage shows as its own compute wherever it sits in the pipeline, not as its neighbours'
waiting; the time between two ranks is read on the receiving rank, less the sender's time without a
CPU. A heavier action also waits longer for a CPU at the same load, so `Slowdown.main` judges the
machine by its growth beyond the load the before side had (`Slowdown.machine_excess`). A run directory
with spans is read from its spans (they hold the run queue between actions and the kit's own time,
which a `Timeline` does not); anything else through `load_timeline`. Without scheduler clocks (older
spans, CUDA's device time, logs) the machine's share is unknown (None, said in `notes`) and stays
inside the other causes; so does the kit's where it was not measured.
Taught in notebook 06b.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from dataclasses import dataclass, field
from statistics import mean
from typing import NamedTuple

from ..core.actions import COMPUTE_KINDS, Timeline
from ..spans.read import Span, has_spans, read_spans, recorded_pipelines, without_descheduling
from .rank_time import _merged, _minus, _Rank

__all__ = ["CAUSES", "Slowdown", "explain_slowdown"]

CAUSES = ("machine", "compute", "waiting", "communication", "kit")
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input backward", "W": "weight backward"}
COLOURS = {"machine": "#CC79A7", "compute": "#0072B2", "waiting": "#56B4E9", "communication": "#999999",
           "kit": "#F0E442"}  # as `labkit.timeline.plot.CAUSE_COLOURS` draws the idle causes
Pair = tuple  # (before, after)


@dataclass
class Slowdown:
    """The change between two measurements of a step, by cause. Times are seconds per step: each
    measurement's mean over its steps (then over rounds); every cause's pair adds up to the step's."""

    before: float
    """Mean step time before (each step's makespan: its first action's start to its last action's end)."""
    after: float
    """Mean step time after."""
    causes: dict[str, Pair]
    """{cause: (before_s, after_s)} for each of `CAUSES`; (None, None) where unknown (see `notes`)."""
    by_stage: dict[tuple[int, str], Pair]
    """{(stage, kind): (before_s, after_s)}: the compute cause split by stage and action kind."""
    per_action: dict[tuple[int, str], Pair] = field(default_factory=dict)
    """{(stage, kind): (before_s, after_s)}: ONE such action's mean time less its descheduling, over every
    rank and step (what "takes 1.6x as long" compares)."""
    spread: dict[str, Pair] = field(default_factory=dict)
    """With several rounds: {"step" or cause: (smallest, largest) change of one round}; empty for one."""
    rounds: int = 1
    """How many pairs of measurements were compared."""
    notes: list[str] = field(default_factory=list)
    """What could not be read (no scheduler clocks, no kit measurement) and so is not a cause here."""
    machine_in_actions: Pair = (None, None)
    """(before_s, after_s): the part of the machine cause inside the path's actions (the rest is between them)."""

    @property
    def delta(self) -> dict[str, float | None]:
        """{cause: after_s - before_s} (None where unknown)."""
        return {c: None if b is None else a - b for c, (b, a) in self.causes.items()}

    @property
    def machine_excess(self) -> float | None:
        """The machine's change beyond the load the before side already had (None where unknown). A longer
        action waits longer for a CPU on a machine as busy, so after's path is expected to be descheduled
        as much per second of its own work as before's: its actions (machine in them / compute, before,
        times compute after) and the time between them (the same with the rest of the step); the excess
        is what the machine added beyond that."""
        (mb, ma), (ib, ia), (cb, ca) = self.causes["machine"], self.machine_in_actions, self.causes["compute"]
        if mb is None:
            return None
        if ib is None:  # made by hand: the whole step at one share
            return ma - _same_share(mb, self.before - mb, self.after - ma)
        return ma - _same_share(ib, cb, ca) - _same_share(mb - ib, self.before - mb - cb, self.after - ma - ca)

    @property
    def main(self) -> str:
        """The cause that grew most (that shrank most when the step got faster), the machine by its
        `machine_excess`: not by what a heavier action waits for a CPU at the load it had."""
        known = {c: d for c, d in self.delta.items() if d is not None}
        if "machine" in known:
            known["machine"] = self.machine_excess
        return (min if self.after < self.before else max)(known, key=known.get)

    def text(self) -> str:
        """What changed, in one sentence a learner can act on (with the rounds' spread when there are several)."""
        d = self.after - self.before
        out = (f"The step takes {_ms(self.after)} against {_ms(self.before)} ({_ms(d, sign=True)}"
               + (f", {self.after / self.before:.2f}x" if self.before > 0 else "") + "): " + self._why() + ".")
        if self.rounds > 1:
            lo, hi = self.spread["step"]
            out += (f" Over {self.rounds} rounds one round's change ran from {_ms(lo, sign=True)} to "
                    f"{_ms(hi, sign=True)}" + ("; every round agrees." if lo * hi > 0 else
                                               "; the rounds disagree on its sign: measure more before acting on it."))
        return out

    def _why(self) -> str:
        cause, d = self.main, self.delta[self.main]
        if not any(self.delta.values()):
            return "no cause changed"
        more, load = "more" if d >= 0 else "less", self._load()
        if cause == "compute":
            stage, kind = max(self.by_stage, key=lambda k: (1 if d >= 0 else -1) * (self.by_stage[k][1]
                                                                                   - self.by_stage[k][0]))
            b, a = self.per_action.get((stage, kind), (0.0, 0.0))
            took = f"take {a / b:.1f}x as long" if b > 0 else "appear"
            return (f"stage {stage}'s {KIND_NAMES.get(kind, kind)}s {took} ({_ms(abs(d))} {more} compute per step "
                    f"on the critical path): the code" + (load or ", not the machine"))
        return {"machine": f"the ranks waited {_ms(abs(d))} {more} for a CPU: the machine, not your code (other "
                           f"processes held the cores" + (f"; {self._shares()[2]}" if self.causes["machine"][0] else "")
                           + ")",
                "waiting": f"the critical path spent {_ms(abs(d))} {more} between actions outside any transfer "
                           f"(the schedule's own Python, the loss, a wait for data it did not trace), not in any "
                           f"stage's compute",
                "communication": f"sends and receives on the critical path took {_ms(abs(d))} {more}: the "
                                 f"transfers between ranks (their size, the backend, the link)",
                "kit": f"the kit's own instrumentation took {_ms(abs(d))} {more}: the measurement, not your code",
                }[cause] + ("" if cause == "compute" else load)

    def _shares(self, actions: bool = False) -> tuple[float, float, str]:
        """(before, after, in words): the share of the step (of the path's actions' time) without a CPU."""
        (mb, ma), (ib, ia), (cb, ca) = self.causes["machine"], self.machine_in_actions, self.causes["compute"]
        pb, pa, of = mb / self.before, ma / self.after, "the step"
        if actions and ib is not None and ib + cb > 0 and ia + ca > 0:
            pb, pa, of = ib / (ib + cb), ia / (ia + ca), "the actions' time"
        same = f"{pb:.0%}" == f"{pa:.0%}"
        return pb, pa, f"descheduled {pa:.0%} of {of} " + ("both times" if same else f"against {pb:.0%}")

    def _load(self) -> str:
        """Where the machine, busy before too, changed with the step but is not `main`: how busy it was ('' else)."""
        (mb, ma), d = self.causes["machine"], self.after - self.before
        if self.main == "machine" or not mb or (ma - mb) * d <= 0:
            return ""
        (pb, pa, shares), excess = self._shares(actions=True), self.machine_excess
        longer = "longer" if d > 0 else "shorter"
        if abs(pa - pb) < 0.05:
            return (f"; the machine was as busy as before ({shares}): its {_ms(abs(ma - mb))} "
                    f"{'more' if d > 0 else 'less'} for a CPU came with the {longer} step")
        return (f"; the machine was {'busier than before too' if excess > 0 else 'less busy than before'} "
                f"({shares}: {_ms(abs(excess))} {'beyond' if excess > 0 else 'short of'} what the "
                f"{longer} step would wait for a CPU at the load it had)")

    def table(self) -> str:
        """Per cause (and compute per stage and kind): before, after and the change, in ms."""
        rows = [("step", (self.before, self.after))] + [(c, self.causes[c]) for c in CAUSES]
        rows[3:3] = [(f"  stage {s} {k}", v) for (s, k), v in sorted(self.by_stage.items())]
        lines = [f"{'cause':16s} {'before ms':>10s} {'after ms':>10s} {'change ms':>10s}"]
        for name, (b, a) in rows:
            cells = ("unknown",) * 3 if b is None else (f"{1e3 * b:.3f}", f"{1e3 * a:.3f}",
                                                        f"{round(1e3 * (a - b), 3) + 0.0:+.3f}")  # no "-0.000"
            lines.append(f"{name:16s} " + " ".join(f"{c:>10s}" for c in cells))
        return "\n".join(lines)

    def plot(self, ax) -> list:
        """Before and after side by side, each a bar of the mean step stacked by cause (ms); returns the artists."""
        artists, bottom = [], [0.0, 0.0]
        for cause in CAUSES:
            b, a = self.causes[cause]
            if b is None:
                continue
            heights = [1e3 * b, 1e3 * a]
            artists.append(ax.bar([0, 1], heights, bottom=bottom, width=0.6, color=COLOURS[cause], label=cause))
            bottom = [x + y for x, y in zip(bottom, heights)]
        ax.set_ylim(0, 1.3 * max(bottom, default=0.0) or 1.0)  # room for the legend above the bars
        ax.set_xticks([0, 1], ["before", "after"])
        ax.set_ylabel("mean step time (ms)")
        ax.set_title(f"{self.main} changed most ({_ms(self.delta[self.main], sign=True)})", fontsize="medium")
        artists.append(ax.legend(fontsize="small", loc="upper left"))
        return artists


def _same_share(queued: float, before: float, after: float) -> float:
    """`queued` seconds without a CPU over `before` seconds of work: as many per second over `after`."""
    return queued / before * after if before > 0 else queued


def _ms(seconds: float, sign: bool = False) -> str:
    return f"{1e3 * seconds:{'+' if sign else ''}.3g} ms"


def explain_slowdown(before, after, source: str = "auto") -> Slowdown:
    """Why `after`'s steps take longer than `before`'s (or less), by cause, over all their steps.

    Each side is a `Timeline`, a run directory, a live-ranks cell directory or a spans file (read from
    its spans where it has them, else with `load_timeline(path, source)`), or a list of them: several
    rounds, paired in order, whose per-round changes give `spread` ("how sure is this?"). Both sides
    should run the same schedule. Notebook 06b."""
    sides = [list(x) if isinstance(x, (list, tuple)) else [x] for x in (before, after)]
    if len(sides[0]) != len(sides[1]) or not sides[0]:
        raise ValueError(f"Give as many rounds before as after (got {len(sides[0])} and {len(sides[1])}): "
                         f"round i of one is compared with round i of the other.")
    loaded = [[_load(x, source, f"{name} (round {i + 1})" if len(side) > 1 else name) for i, x in enumerate(side)]
              for name, side in zip(("before", "after"), sides)]
    clocked = all(m.clocked for side in loaded for m in side)
    kit = all(m.kit for side in loaded for m in side)
    notes = list(dict.fromkeys(n for side in loaded for m in side for n in m.notes))
    if not clocked:
        notes.append("machine: unknown, as not every measurement has scheduler clocks; the time its ranks waited "
                     "for a CPU is inside the other causes.")
    if not kit:
        notes.append("kit: unknown, as not every measurement holds the kit's own time (spans record it); it is "
                     "inside the causes between actions, mostly waiting.")
    b, a = ([_reading(m, clocked, kit) for m in side] for side in loaded)
    return _compare(b, a, notes, unknown={c for c, known in (("machine", clocked), ("kit", kit)) if not known})


class _Loaded(NamedTuple):
    """One measurement as spans (a `Timeline`'s actions made into spans), before it is read."""

    spans: list[Span]
    pipeline_of: dict[int, int]
    clocked: bool   # every compute span has its run-queue clock
    kit: bool       # the kit's own time was measured
    notes: list[str]


def _load(x, source: str, name: str) -> _Loaded:
    if isinstance(x, Timeline):
        return _from_timeline(x, name)
    if not isinstance(x, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a Timeline, a run directory or a spans file, got {type(x).__name__}.")
    if source not in ("auto", "spans") or not has_spans(x):
        from .compare import load_timeline

        return _from_timeline(load_timeline(x, source), name)
    spans, meta = read_spans(x)
    comp = [s for s in spans if s.kind in COMPUTE_KINDS]
    clocked = bool(comp) and all(s.rq for s in comp)
    notes = []
    if not clocked:
        cuda = any(str(m.get("clock", "")).startswith("cuda") for m in meta.values())
        notes.append(f"{name}: no scheduler clocks in its spans (" + ("CUDA spans time the device, not the host's "
                     "run queue" if cuda else "recorded before the kit read the run queue, or not on Linux") + ").")
    kit = any(s.own() for s in spans) or any("instrument" in m for m in meta.values())
    pipes = enumerate(recorded_pipelines(spans, meta) or [])
    return _Loaded(spans, {r: i for i, p in pipes for r in p}, clocked, kit, notes)


def _from_timeline(tl: Timeline, name: str) -> _Loaded:
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
        notes.append(f"{name}: a Timeline keeps each action's descheduled time, not the time between actions nor "
                     f"the kit's; pass its run directory for both.")
    return _Loaded(spans, tl.pipeline_of(), clocked, False, notes)


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
    step: float
    causes: dict[str, float]
    by_stage: dict[tuple[int, str], float]
    per_action: dict[tuple[int, str], float]
    in_actions: float


def _reading(m: _Loaded, clocked: bool, kit: bool) -> _Reading:
    """One measurement's mean step, causes and compute per stage, over all its steps."""
    ranks = {r: _Rank([s for s in m.spans if s.rank == r], clocked, kit) for r in sorted({s.rank for s in m.spans})}
    steps: dict[int, dict[int, list[Span]]] = {}
    own: dict[tuple[int, str], list[float]] = {}
    for r in ranks:
        comp = [s for s in m.spans if s.rank == r and s.kind in COMPUTE_KINDS]
        numbers = {n: i for i, n in enumerate(sorted({s.step for s in comp}))}  # the rank's k-th step
        for s in sorted(comp, key=lambda x: (x.start, x.end)):
            steps.setdefault(numbers[s.step], {}).setdefault(r, []).append(s)
            own.setdefault((s.stage, s.kind), []).append(s.end - s.start - ranks[r].queued(s.start, s.end))
    if not steps:
        raise ValueError("This measurement has no compute actions (F, B, I, W): nothing to compare.")
    times, read = zip(*(_critical_path(comp, ranks, m.pipeline_of) for _, comp in sorted(steps.items())))
    stages = sorted({k for x in read for k in x.by_stage})
    return _Reading(mean(times), {c: mean(x.causes[c] for x in read) for c in CAUSES},
                    {k: mean(x.by_stage.get(k, 0.0) for x in read) for k in stages},
                    {k: mean(v) for k, v in sorted(own.items())}, mean(x.in_actions for x in read))


def _compare(before: list[_Reading], after: list[_Reading], notes: list[str], unknown: set[str]) -> Slowdown:
    """Rounds paired in order: each side's mean over its rounds, and the spread of one round's change."""
    def pair(get) -> Pair:
        return mean(get(x) for x in before), mean(get(x) for x in after)

    stages = sorted({k for x in before + after for k in x.by_stage})
    kinds = sorted({k for x in before + after for k in x.per_action})
    causes = {c: (None, None) if c in unknown else pair(lambda x, c=c: x.causes[c]) for c in CAUSES}
    spread = {}
    if len(before) > 1:
        for name in ("step", *(c for c in CAUSES if c not in unknown)):
            get = (lambda x: x.step) if name == "step" else (lambda x, c=name: x.causes[c])
            changes = [get(a) - get(b) for b, a in zip(before, after)]
            spread[name] = (min(changes), max(changes))
    return Slowdown(*pair(lambda x: x.step), causes,
                    {k: pair(lambda x, k=k: x.by_stage.get(k, 0.0)) for k in stages},
                    {k: tuple(mean([x.per_action[k] for x in side if k in x.per_action] or [0.0])
                              for side in (before, after)) for k in kinds},  # over the rounds that ran it
                    spread, len(before), notes,
                    (None, None) if "machine" in unknown else pair(lambda x: x.in_actions))
