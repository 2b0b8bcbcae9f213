"""Whether an order can finish, from the plan alone, and if not the wait cycle in words (`find_deadlock`).

A rank runs its actions in its order and blocks until each action's inputs exist: a stage's F of
microbatch i needs the previous stage's F of i; its B (or I) needs its own F of i and the next stage's
B or I of i; W needs its I (`needs`: the rules `labkit.theory.simulate` replays with times too). Sends
do not block (torch posts them and moves on). Replaying an order without times (`blocked`) tells
whether it finishes; when it cannot, each stuck rank waits for an action of another rank (or its own,
planned later): following those waits gives a cycle (`Deadlock.cycle`), or an action no rank plans
(ranks whose orders disagree: one plans 4 microbatches, another 8). The kit refuses such an order
before the first step (`labkit run --schedule-csv`, `labkit.config.run.validate_order_csv`;
notebooks/scripts/custom_schedule.py). torch's own check (`_simulate_comms_compute`, private) lowers
an order with its sends and receives and prints, then raises a bare ValueError; for a compute-only
order its rules are these, so the kit's own replay, which says who waits for whom, is used. A hung job's
wait cycle is named only where this replay of the ranks' orders finds one (`labkit.timeline.stuck_causes`).
Taught in notebook 08 (a deadlocking custom order) and 09.

May import: labkit.core (within labkit.schedules: orders).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .orders import PlannedAction, ScheduleError, check_order, normalize_order

__all__ = ["Deadlock", "blocked", "find_deadlock", "needs", "refuse_deadlock"]


def needs(a: PlannedAction, n_stages: int) -> list[tuple[PlannedAction, ...]]:
    """What action `a` waits for, as groups of alternatives: every group must be done, any member of a
    group satisfies it (the next stage's B or I both send the gradient)."""
    kind, stage, mb = a
    if kind == "F":
        return [(("F", stage - 1, mb),)] if stage > 0 else []
    if kind in ("B", "I"):
        deps = [(("F", stage, mb),)]  # the stage's own saved activations
        if stage < n_stages - 1:  # the gradient of the stage's output, from the next stage
            deps.append((("B", stage + 1, mb), ("I", stage + 1, mb)))
        return deps
    return [(("I", stage, mb),)]  # W


def blocked(order: dict, n_stages: int) -> tuple[dict[int, int], set]:
    """Replay `order` (normalised) without times: ({rank: the position it stops at}, the actions done).
    A rank whose position is its order's length finished."""
    pos = {r: 0 for r in order}
    done: set = set()
    moved = True
    while moved:
        moved = False
        for r, acts in order.items():
            while pos[r] < len(acts) and all(any(d in done for d in g) for g in needs(acts[pos[r]], n_stages)):
                done.add(acts[pos[r]])
                pos[r] += 1
                moved = True
    return pos, done


def _words(d: PlannedAction) -> str:
    return f"stage {d[1]}'s {d[0]} of microbatch {d[2]}"


@dataclass
class Deadlock:
    """An order that cannot finish: where each stuck rank stops, whom it waits for, and the cycle."""

    stuck: dict = field(default_factory=dict)
    """{rank: (position, the action it stops at, [the actions it waits for])}."""
    waits_for: dict = field(default_factory=dict)
    """{rank: the rank planning what it waits for (None: no rank plans it)}."""
    cycle: list = field(default_factory=list)
    """Ranks, each waiting for the next, the first again at the end ([] when a wait leads to no rank)."""
    hops: dict = field(default_factory=dict)
    """{rank: one sentence}: `rank 0 waits, at B(stage 0, mb 0), for stage 1's B of microbatch 0 (rank 1)`."""

    def text(self) -> str:
        if self.cycle:
            on = [self.hops[r] for r in self.cycle[:-1]]
            head = ("a wait cycle: " if len(self.cycle) > 2 else "a rank waits for itself: ") + "; ".join(on)
            fix = "Reorder the actions so that every input is produced before a rank blocks on it"
        else:
            on = [h for r, h in sorted(self.hops.items()) if self.waits_for[r] is None]
            head = "a rank waits for an action no rank plans: " + "; ".join(on)
            fix = ("Plan every action a rank waits for: the ranks' orders disagree (give every rank the same "
                   "schedule, n_microbatches and stages)")
        behind = [h for r, h in sorted(self.hops.items()) if h not in on]
        head += ("; behind it: " + "; ".join(behind)) if behind else ""
        return f"This order deadlocks before its end ({head}). {fix} (labkit.theory.simulate_order replays it)."

    def __str__(self) -> str:
        return self.text()


def find_deadlock(order, n_stages: int | None = None) -> Deadlock | None:
    """None when `order` ({rank: [(kind, stage, microbatch), ...]}, torch's "0F1" strings, or a list of
    rows) can finish; else its `Deadlock`. Raises `ScheduleError` for a malformed order (`check_order`)."""
    norm = normalize_order(order)
    if n_stages is None:
        n_stages = 1 + max((s for acts in norm.values() for _, s, _ in acts), default=-1)
    problems = check_order(norm, n_stages)
    if problems:
        raise ScheduleError("This order cannot be checked for deadlocks:\n- " + "\n- ".join(problems))
    pos, done = blocked(norm, n_stages)
    stuck = {r: p for r, p in pos.items() if p < len(norm[r])}
    return wait_cycle(norm, stuck, done, n_stages) if stuck else None


def wait_cycle(norm: dict, stuck: dict[int, int], done: set, n_stages: int) -> Deadlock:
    """The `Deadlock` of a replay that stopped: `stuck` {rank: position}, `done` the actions it ran."""
    where = {a: (r, i) for r, acts in norm.items() for i, a in enumerate(acts)}
    out = Deadlock()
    for r, i in sorted(stuck.items()):
        a = norm[r][i]
        missing = [g for g in needs(a, n_stages) if not any(d in done for d in g)]
        group = missing[0]
        planned = [d for d in group if d in where]
        d = planned[0] if planned else group[0]
        owner = where[d][0] if planned else None
        out.stuck[r] = (i, a, [x for g in missing for x in g])
        out.waits_for[r] = owner
        at = f"{a[0]}(stage {a[1]}, mb {a[2]})"
        if owner is None:
            out.hops[r] = f"rank {r} waits, at {at}, for {_words(d)}, which no rank plans"
        elif owner == r:
            out.hops[r] = (f"rank {r} waits, at {at}, for {_words(d)}, which it plans itself later "
                           f"(position {where[d][1]})")
        else:
            out.hops[r] = f"rank {r} waits, at {at}, for {_words(d)} (rank {owner})"
    out.cycle = _follow(out.waits_for)
    return out


def _follow(waits_for: dict) -> list:
    """The first cycle reached by following each rank's wait, as [r0, r1, ..., r0]; [] if none."""
    for start in sorted(waits_for):
        path, r = [], start
        while r is not None and r not in path:
            path.append(r)
            r = waits_for.get(r)
        if r is not None:
            return path[path.index(r):] + [r]
    return []


def refuse_deadlock(order, n_stages: int | None = None, where: str = "") -> None:
    """Raise `ScheduleError` with the wait cycle when `order` deadlocks (`where` names the order: a
    CSV's path); nothing when it can finish."""
    found = find_deadlock(order, n_stages)
    if found is not None:
        raise ScheduleError((f"{where}: " if where else "") + found.text())
