"""Why is this step slower: two measurements of the same schedule, the change in their mean step time
split into causes that add up to it exactly, and how sure that is (`explain_slowdown`, `pool.compare`,
`labkit timeline --compare A B`: one function, one verdict, `Slowdown.text`).

Each step is read along its critical path (`labkit.timeline.critical_path`): from the action that ends
the step back through what each action waited for last (its rank's previous action, or the input it
needed from another stage: an F's from the stage before, a B's or I's from the stage after, a W's from
its own I), down to the step's start. The path's pieces tile the step, so they add up to its time; each
moment of it gets one cause (`CAUSES`):

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
CPU. A heavier action also waits longer for a CPU at the same load, so the machine is judged by its
growth beyond the load the before side had (`Slowdown.machine_excess`). Without scheduler clocks (older
spans, CUDA's device time, logs) the machine's share is unknown (None, said in `notes`) and stays
inside the other causes; so does the kit's where it was not measured.

How sure: the verdict weighs each cause's change against its own noise over units of measurement
(`Slowdown.unit`): rounds (lists of measurements, paired in order: `pool.rounds` interleaves them), or,
for two single measurements (yesterday's run and today's, never interleaved), their steps, paired in
order. A step in which torch.compile compiled times the compiler, not the code, and a schedule object's
first step in its process (its stages infer their shapes and set up their transfers, the allocator warms
up) times that set-up: each is left out where the measurement has warm steps, and named apart ("after's
step 1 compiled for 2.9 s", "before's step 1 warmed up for 183 ms": `Slowdown.left_out`).
A cause changed when its mean change exceeds `NOISE_Z` standard errors of its per-unit changes and
`FLOOR` of the step. The headline names EVERY such cause, largest first (`Slowdown.named`), and
always a stage whose compute (less descheduling) changed; when the units disagree on which cause
changed most it says so and about how many units would settle it (`Slowdown.agreement`); and it says
whether the before side was a quiet baseline (`labkit.spans.quiet`): on a busy one, that the verdict
is given on a busy baseline and what it rests on. Taught in notebook 06b.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import ceil, sqrt
from statistics import mean, stdev
from typing import NamedTuple

from ..spans.quiet import Quiet, quiet_from_loads
from .critical_path import CAUSES, _load, _reading, _Reading
from .slowdown_text import SlowdownText, _ms

__all__ = ["CAUSES", "LeftOut", "Slowdown", "explain_slowdown"]

COLOURS = {"machine": "#CC79A7", "compute": "#0072B2", "waiting": "#56B4E9", "communication": "#999999",
           "kit": "#F0E442"}  # as `labkit.timeline.plot.CAUSE_COLOURS` draws the idle causes
NOISE_Z = 2.0
"""A cause changed when its mean change exceeds this many standard errors of its per-unit changes (~95%)..."""
FLOOR = 0.02
"""... and this share of the before step: a steadier, smaller change is not worth naming."""
ACTION_FLOOR = 0.1
"""A stage is named when its compute on the critical path changed so AND one of its actions (less
descheduling) by more than this share (and its noise): not where the path merely moved between stages."""
ALIKE = 1.5
"""Every stage and kind changed by factors within this of each other, beside a busier machine: `Slowdown.alike`."""
MAX_UNITS = 1000
"""Beyond this many rounds (steps) to settle which cause changed most, the kit says they changed alike."""
Pair = tuple  # (before, after)


class LeftOut(NamedTuple):
    """A step left out of the comparison because torch.compile compiled in it (it times the compiler), or
    because it was its schedule object's first step in the process (a warm-up: it times the set-up)."""

    side: str
    """"before" or "after"."""
    round: int | None
    """Which round of that side (1 for the first), None for a single measurement."""
    step: int
    """Which step of that measurement (1 for its first)."""
    seconds: float
    """Its time (its first action's start to its last action's end)."""
    counts: dict
    """{rank: dynamo's counts in it} (`labkit.spans.compiled.COUNTS`) of the ranks that compiled; {} for a
    warm-up."""
    why: str = "compiled"
    """"compiled" (torch.compile compiled in it, on any rank) or "warm-up" (its schedule object's first step
    in the process, on any rank, `labkit.spans.recorder`); a step that did both is "compiled"."""


class Agreement(NamedTuple):
    """Which cause each unit (round or step) says changed most, and whether the units' mean settles it."""

    tops: dict
    """{cause: how many units name it the cause that changed most}, most first."""
    first: str
    """The verdict's leading cause."""
    second: str | None
    """The cause it is weighed against: the one other units name (None: every unit names `first`)."""
    lead: float
    """`first`'s mean lead over `second` per unit, seconds (0.0 when every unit agrees)."""
    settled: bool
    """The lead exceeds `NOISE_Z` standard errors (True when every unit agrees)."""
    needed: int | None
    """About how many units would settle it (None: settled, or not within `MAX_UNITS`)."""


@dataclass
class Slowdown(SlowdownText):
    """The change between two measurements of a step, by cause. Times are seconds per step: each
    measurement's mean over its steps (then over rounds); every cause's pair adds up to the step's.
    In words: `text()`, `report()`, `table()` (`labkit.timeline.slowdown_text`)."""

    _floor = FLOOR  # (not a field) the words say it

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
    """With several units: {"step" or cause: (smallest, largest) change of one unit}; empty for one."""
    rounds: int = 1
    """How many pairs of measurements were compared."""
    notes: list[str] = field(default_factory=list)
    """What could not be read (no scheduler clocks, no kit measurement) and so is not a cause here."""
    machine_in_actions: Pair = (None, None)
    """(before_s, after_s): the part of the machine cause inside the path's actions (the rest is between them)."""
    changes: dict[str, list[float]] = field(default_factory=dict)
    """Each unit's change, in order: {"step", each known cause, "excess" (the machine's beyond its load)};
    what the noise is read from. Empty when made by hand."""
    stage_changes: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    """Each unit's change of each (stage, kind)'s compute on the critical path."""
    action_changes: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    """Each unit's change of one such action's time less its descheduling (`per_action`)."""
    unit: str = "round"
    """What one unit of `changes` is: "round" (rounds given, paired in order) or "step" (two measurements:
    their steps, paired in order)."""
    baseline: Quiet | None = None
    """The quiet rule (`labkit.spans.quiet`) over the before side's steps; None where not measured."""
    left_out: list[LeftOut] = field(default_factory=list)
    """The steps left out because torch.compile compiled in them or they warmed up (before's, then after's,
    in order): the warm steps are compared. A measurement with no warm step keeps them (`unwarm`, `cold`)."""
    unwarm: list[str] = field(default_factory=list)
    """The sides ("before", "after"; "after (round 2)" among rounds) whose every step compiled: compared as
    they are, there being no warm step."""
    cold: list[str] = field(default_factory=list)
    """The sides whose every step warmed up (or compiled), not every one compiled (a measurement of one
    step, its schedule's first): compared as they are, there being no warm step."""

    @property
    def delta(self) -> dict[str, float | None]:
        """{cause: after_s - before_s} (None where unknown)."""
        return {c: None if b is None else a - b for c, (b, a) in self.causes.items()}

    @property
    def machine_excess(self) -> float | None:
        """The machine's change beyond the load the before side already had (None where unknown). A longer
        action waits longer for a CPU on a machine as busy, so after's path is expected to be descheduled
        as much per second of its own work as before's in its actions (machine in them / compute, before,
        times compute after), and as much as before between them: a hand-off waits for a CPU once per
        wakeup, and the schedule's hand-offs are the same (scaled by the time between actions, a busy
        machine's own longer hand-offs hid it: 06b's busy rounds named communication or waiting first in 4
        of 8 sets); the excess is what the machine added beyond that."""
        return _excess(self.before, self.after, self.causes["machine"], self.machine_in_actions,
                       self.causes["compute"])

    # ---- how sure

    @property
    def units(self) -> int:
        """How many units (rounds, or steps paired in order) the noise is read over (0: made by hand)."""
        return len(self.changes.get("step", []))

    def noise(self, what, raw: bool = False) -> float | None:
        """`NOISE_Z` standard errors of `what`'s mean change over the units: "step", a cause (the machine's
        excess for "machine", unless `raw`) or a (stage, kind). None with fewer than two units."""
        if isinstance(what, tuple):
            return _noise(self.stage_changes.get(what))
        return _noise(self.changes.get("excess" if what == "machine" and not raw else what))

    def _limit(self, what) -> float:
        """What a change must exceed to count: its noise, and `FLOOR` of the step."""
        return max(FLOOR * self.before, self.noise(what) or 0.0)

    @property
    def _sign(self) -> int:
        return 1 if self.after >= self.before else -1

    def _size(self, what) -> float | None:
        """The change the verdict weighs: a cause's (the machine by its excess) or a (stage, kind)'s compute."""
        if isinstance(what, tuple):
            b, a = self.by_stage[what]
            return a - b
        return self.machine_excess if what == "machine" else self.delta[what]

    def _beyond(self, what, way: int) -> bool:
        size = self._size(what)
        return size is not None and way * size > self._limit(what)

    def _stages(self, way: int) -> list[tuple[int, str]]:
        def action(k) -> bool:
            b, a = self.per_action.get(k, (0.0, 0.0))
            if b <= 0:
                return way * a > 0
            return way * (a - b) > max(ACTION_FLOOR * b, _noise(self.action_changes.get(k)) or 0.0)
        return sorted((k for k in self.by_stage if self._beyond(k, way) and action(k)),
                      key=lambda k: -way * self._size(k))

    def _named(self, way: int) -> list[str]:
        stages = self._stages(way)
        out = [c for c in CAUSES if c != "compute" and self._beyond(c, way)]
        if stages or self._beyond("compute", way):
            out.append("compute")

        def size(c):
            if c == "compute":
                return max([way * self._size("compute")] + [way * self._size(k) for k in stages])
            return way * self._size(c)
        # a cause beyond its noise but smaller than a change that is not (a machine whose rounds scatter) is not
        # what made the step slower: not headlined (a stage that grew always is: `stages`)
        unsettled = max((way * d for c in CAUSES if c not in out and (d := self._size(c)) is not None), default=0.0)
        out = [c for c in out if (c == "compute" and stages) or size(c) >= unsettled]
        return sorted(out, key=size, reverse=True)

    @property
    def stages(self) -> list[tuple[int, str]]:
        """Every (stage, kind) whose compute on the critical path (less descheduling) changed beyond its
        noise the way the step did, and one of whose actions did too (by over `ACTION_FLOOR`), largest first."""
        return self._stages(self._sign)

    @property
    def alike(self) -> bool:
        """Every stage and kind on the path changed the way the step did, by factors within `ALIKE` of each
        other, at least two of them beyond their noise, while the machine did too: what a core shared with
        other work does to every action (its caches, its clock), not only a change to every stage's code."""
        way, stages = self._sign, self.stages
        if len(stages) < 2 or "machine" not in self.named:
            return False
        ratios = [(a / b) ** way for b, a in (self.per_action.get(k, (0.0, 0.0)) for k in self.by_stage)
                  if b > 0 and a > 0]
        return len(ratios) == len(self.by_stage) and min(ratios) > 1 and max(ratios) <= ALIKE * min(ratios)

    @property
    def named(self) -> list[str]:
        """Every cause that changed beyond its noise the way the step did (grew when it got slower), largest
        first; compute whenever a stage's did (`stages`). What the headline names."""
        return self._named(self._sign)

    @property
    def against(self) -> list[str]:
        """The causes that changed beyond their noise the other way (a stage that grew in a step that got
        faster, as a busy machine became less busy), largest first: the headline names them too."""
        return self._named(-self._sign)

    @property
    def main(self) -> str:
        """The cause that grew most (that shrank most when the step got faster) beyond its noise, else
        the one that changed most: the machine by its `machine_excess`, not by what a heavier action
        waits for a CPU at the load it had."""
        named = self.named
        if named:
            return named[0]
        known = {c: d for c, d in self.delta.items() if d is not None}
        if "machine" in known:
            known["machine"] = self.machine_excess
        return (min if self.after < self.before else max)(known, key=known.get)

    @property
    def agreement(self) -> Agreement | None:
        """Which cause each unit says changed most, and whether the units' mean settles the verdict's
        lead over the cause other units name; None with fewer than two units."""
        n = self.units
        if n < 2:
            return None
        key = {c: "excess" if c == "machine" else c for c in CAUSES}
        known = [c for c in CAUSES if key[c] in self.changes]

        def at(c, i):
            return self._sign * self.changes[key[c]][i]
        tops = dict(Counter(max(known, key=lambda c: at(c, i)) for i in range(n)).most_common())
        first = self.main
        others = [c for c in tops if c != first]
        if not others:
            return Agreement(tops, first, None, 0.0, True, None)
        second = max(others, key=lambda c: (tops[c], self._sign * (self._size(c) or 0.0)))
        diffs = [at(first, i) - at(second, i) for i in range(n)]
        lead, sd = mean(diffs), stdev(diffs)
        settled = lead > NOISE_Z * sd / sqrt(n)
        needed = None
        if not settled and lead > 0:
            k = ceil((NOISE_Z * sd / lead) ** 2)
            needed = max(k, n + 1) if k <= MAX_UNITS else None
        return Agreement(tops, first, second, lead, settled, needed)

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


def _noise(xs) -> float | None:
    return NOISE_Z * stdev(xs) / sqrt(len(xs)) if xs and len(xs) > 1 else None


def _same_share(queued: float, before: float, after: float) -> float:
    """`queued` seconds without a CPU over `before` seconds of work: as many per second over `after`."""
    return queued / before * after if before > 0 else queued


def _excess(before: float, after: float, machine: Pair, in_actions: Pair, compute: Pair) -> float | None:
    """`Slowdown.machine_excess` of one pair of steps (or of the means)."""
    (mb, ma), (ib, ia), (cb, ca) = machine, in_actions, compute
    if mb is None:
        return None
    if ib is None:  # made by hand: the whole step at one share
        return ma - _same_share(mb, before - mb, after - ma)
    return ma - _same_share(ib, cb, ca) - (mb - ib)


def explain_slowdown(before, after, source: str = "auto") -> Slowdown:
    """Why `after`'s steps take longer than `before`'s (or less), by cause, over all their steps, and how
    sure that is (`Slowdown.text`).

    Each side is a `Timeline`, a run directory, a live-ranks cell directory or a spans file, or a list of
    them: several rounds, paired in order, whose per-round changes give the noise each cause is weighed
    against. Two single measurements (two runs, never interleaved) are weighed over their steps, paired in
    order. Both sides should run the same schedule. Every kind of side is read one way: as its Timeline
    (`timeline_from_spans` where it has spans, else `load_timeline(path, source)`), from every clock that
    Timeline carries (`Timeline.recorded`), so a directory, its Timeline (`pool.timeline(cell)`) and the
    cell (`pool.compare`) give the same text. Steps in which torch.compile compiled (dynamo's counts per
    step), and steps that warmed up (a schedule object's first step in its process, marked by the recorder),
    are left out where a measurement has warm ones, and named apart (`Slowdown.left_out`). Notebook 06b."""
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
    read = [[_reading(m, clocked, kit) for m in side] for side in loaded]
    b, a = ([mean_step for mean_step, _ in side] for side in read)
    if len(b) > 1:
        units, unit = list(zip(b, a)), "round"
    else:
        (_, steps_b), (_, steps_a) = read[0][0], read[1][0]
        units, unit = list(zip(steps_b, steps_a)), "step"
        if len(steps_b) != len(steps_a):
            notes.append(f"steps: before has {len(steps_b)}, after {len(steps_a)}: the first {len(units)} of each "
                         f"are paired for the noise; the means are over all of them.")
    baseline = quiet_from_loads([m.load for m in loaded[0]]) if all(m.load for m in loaded[0]) else None
    out = _compare(b, a, notes, {c for c, known in (("machine", clocked), ("kit", kit)) if not known},
                   units, unit, baseline)
    for name, side in zip(("before", "after"), loaded):
        for i, m in enumerate(side):
            out.left_out += [LeftOut(name, i + 1 if len(side) > 1 else None, k, t, counts, why)
                             for k, t, counts, why in m.left_out]
            if m.every_step_compiled:
                out.unwarm.append(f"{name} (round {i + 1})" if len(side) > 1 else name)
            if m.every_step_cold:
                out.cold.append(f"{name} (round {i + 1})" if len(side) > 1 else name)
    return out


def _compare(before: list[_Reading], after: list[_Reading], notes: list[str], unknown: set[str],
             units: list[tuple[_Reading, _Reading]], unit: str, baseline: Quiet | None) -> Slowdown:
    """Each side's mean over its rounds, and each unit's change (rounds, or steps paired in order)."""
    def pair(get) -> Pair:
        return mean(get(x) for x in before), mean(get(x) for x in after)

    stages = sorted({k for x in before + after for k in x.by_stage})
    kinds = sorted({k for x in before + after for k in x.per_action})
    causes = {c: (None, None) if c in unknown else pair(lambda x, c=c: x.causes[c]) for c in CAUSES}
    changes = {"step": [a.step - b.step for b, a in units]}
    changes.update({c: [a.causes[c] - b.causes[c] for b, a in units] for c in CAUSES if c not in unknown})
    if "machine" not in unknown:
        changes["excess"] = [_excess(b.step, a.step, (b.causes["machine"], a.causes["machine"]),
                                     (b.in_actions, a.in_actions), (b.causes["compute"], a.causes["compute"]))
                             for b, a in units]
    stage_changes = {k: [a.by_stage.get(k, 0.0) - b.by_stage.get(k, 0.0) for b, a in units] for k in stages}
    action_changes = {k: [a.per_action[k] - b.per_action[k] for b, a in units
                          if k in a.per_action and k in b.per_action] for k in kinds}
    spread = {name: (min(xs), max(xs)) for name, xs in changes.items() if name != "excess"} if len(units) > 1 else {}
    return Slowdown(*pair(lambda x: x.step), causes,
                    {k: pair(lambda x, k=k: x.by_stage.get(k, 0.0)) for k in stages},
                    {k: tuple(mean([x.per_action[k] for x in side if k in x.per_action] or [0.0])
                              for side in (before, after)) for k in kinds},  # over the rounds that ran it
                    spread, len(before), notes,
                    (None, None) if "machine" in unknown else pair(lambda x: x.in_actions),
                    changes, stage_changes, action_changes, unit, baseline)
