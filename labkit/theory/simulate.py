"""Replaying an order: the ideal timeline of a schedule, and deadlocks explained.

A rank runs its actions one after another, each as soon as the rank is free and its inputs have
arrived (+ `Cost.p2p` from another rank). The result is the same `Timeline` as a measured run
(source "theory"), so both can be drawn and compared with `labkit.timeline.plot`. An order that can never
finish raises `ScheduleDeadlock`, naming the stuck ranks and what they wait for. Taught in
notebooks 03 and 06 (`simulate`) and 08 (write your own schedule, `simulate_order`).
"""

from __future__ import annotations

from ..schedules.deadlock import needs, wait_cycle
from ..schedules.orders import PlannedAction, ScheduleError, check_order, describe, normalize_order
from ..core.actions import Action, Timeline
from .cost import Cost, StageCosts
from .plans import planned_actions, resolve, torch_version


class ScheduleDeadlock(ScheduleError):
    """No rank can make progress: every unfinished rank waits for something that never comes.

    `stuck` maps each stuck rank to `(position, action, missing)`: the index of its next action in
    its list, that action as `(kind, stage, microbatch)`, and the actions it still waits for.
    `deadlock` is the same replay read as a wait cycle (`labkit.schedules.deadlock.Deadlock`: `.cycle`,
    `.text()`), what the kit says when it refuses such an order before running it.
    """

    def __init__(self, message: str, stuck: dict[int, tuple[int, PlannedAction, list[PlannedAction]]],
                 deadlock=None):
        super().__init__(message)
        self.stuck = stuck
        self.deadlock = deadlock


def simulate_order(order, n_stages: int | None = None, n_microbatches: int | None = None,
                   cost: Cost | StageCosts | str = Cost(), *, meta: dict | None = None,
                   not_before: dict[PlannedAction, float] | None = None) -> Timeline:
    """Simulate a hand-written (or planned) order: `{rank: [(kind, stage, microbatch), ...]}`.

    Each rank runs its list in order; an action starts when the rank is free and its inputs are
    there (+ `cost.p2p` when they come from another rank), and not before `not_before[action]` when
    given (a placement found by `labkit.theory.exact`, whose ranks may wait on purpose). Raises
    `ScheduleError` for a malformed order (see `check_order`) and `ScheduleDeadlock` when no rank can
    progress. Notebook 08.
    """
    if isinstance(cost, str):
        cost = Cost.parse(cost)
    norm = normalize_order(order)
    if n_stages is None:
        n_stages = 1 + max((s for acts in norm.values() for _, s, _ in acts), default=-1)
    problems = check_order(norm, n_stages, n_microbatches)
    if problems:
        raise ScheduleError("This order cannot be simulated:\n- " + "\n- ".join(problems))

    stage_rank = {s: r for r, acts in norm.items() for _, s, _ in acts}
    position = {a: (r, i) for r, acts in norm.items() for i, a in enumerate(acts)}
    pos = {r: 0 for r in norm}
    free = {r: 0.0 for r in norm}
    done: dict[PlannedAction, float] = {}
    actions: list[Action] = []

    def ready_time(a: PlannedAction, rank: int) -> float | None:
        t = 0.0
        for group in needs(a, n_stages):
            ends = [done[d] + (cost.p2p if stage_rank[d[1]] != rank else 0.0) for d in group if d in done]
            if not ends:
                return None
            t = max(t, min(ends))
        return t

    # A rank's order is fixed, so an action's start only depends on its rank's previous action and
    # on its inputs: sweeping until nothing moves gives the event-driven result.
    progress = True
    while progress:
        progress = False
        for r, acts in norm.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                ready = ready_time(a, r)
                if ready is None:
                    break
                start = max(free[r], ready, not_before.get(a, 0.0) if not_before else 0.0)
                end = start + (cost.duration(a[0], a[1]) if isinstance(cost, StageCosts) else cost.duration(a[0]))
                done[a] = end
                free[r] = end
                actions.append(Action(r, a[1], a[2], a[0], start, end))
                pos[r] += 1
                progress = True

    stuck = {r: pos[r] for r, acts in norm.items() if pos[r] < len(acts)}
    if stuck:
        raise _deadlock(norm, stuck, done, position, n_stages)

    info = {"schedule": "custom", "pp_size": len(norm), "n_microbatches": n_microbatches,
            "stages_per_rank": None, "n_stages": n_stages, "cost": cost.to_dict(), "unit": cost.unit}
    info.update(meta or {})
    actions.sort(key=lambda x: (x.start, x.rank))
    return Timeline(actions, source="theory", meta=info)


def _deadlock(norm, stuck: dict[int, int], done, position, n_stages: int) -> ScheduleDeadlock:
    """The deadlock error: each stuck rank, its next action, and where what it waits for is planned."""
    details: dict[int, tuple[int, PlannedAction, list[PlannedAction]]] = {}
    lines = []
    for r, i in stuck.items():
        a = norm[r][i]
        missing = [g for g in needs(a, n_stages) if not any(d in done for d in g)]
        details[r] = (i, a, [d for g in missing for d in g])
        waits = []
        for group in missing:
            name = " or ".join(describe(d) for d in group)
            planned = [d for d in group if d in position]
            if not planned:
                waits.append(f"{name}, which no rank plans")
                continue
            pr, pi = position[planned[0]]  # not done, so rank pr is stuck at or before it
            if pi == stuck[pr]:
                waits.append(f"{name}, rank {pr}'s next action, itself stuck")
            else:
                who = "this rank" if pr == r else f"rank {pr}"
                waits.append(f"{name}, which {who} plans later (position {pi}, behind "
                             f"{describe(norm[pr][stuck[pr]])})")
        lines.append(f"rank {r} is stuck at position {i}, {describe(a)}: waits for " + "; ".join(waits))
    return ScheduleDeadlock(
        "Schedule deadlock: no rank can make progress.\n" + "\n".join(lines)
        + "\nReorder the actions so that every input is produced before a rank blocks on it.",
        details, wait_cycle(norm, stuck, set(done), n_stages),
    )


def simulate(schedule: str, pp_size: int, n_microbatches: int, stages_per_rank: int | None = None,
             cost: Cost | StageCosts | str = Cost()) -> Timeline:
    """The ideal timeline of a torch schedule under `cost` (source "theory"). Notebooks 03 and 06.

    Costs are per action of ONE stage (a `StageCosts` gives each stage its own). Cutting the same model
    into more stages makes each stage cheaper: to compare schedules at equal model size, divide F and
    B by `stages_per_rank` (e.g. Interleaved1F1B with 2 stages per rank: `Cost(F=0.5, B=1)` against
    GPipe's `Cost(F=1, B=2)`).
    """
    info, spr = resolve(schedule, pp_size, n_microbatches, stages_per_rank)
    order = planned_actions(info.name, pp_size, n_microbatches, spr)
    if isinstance(cost, str):
        cost = Cost.parse(cost)
    meta = {"schedule": info.name, "pp_size": pp_size, "n_microbatches": n_microbatches, "stages_per_rank": spr,
            "planned_by": (f"torch {torch_version()} {info.cls}.pipeline_order" if info.multi
                           else f"labkit (mirrors {info.cls}._step_microbatches)")}
    if info.name == "1F1B" and n_microbatches < pp_size:
        meta["note"] = (f"torch's Schedule1F1B refuses fewer microbatches ({n_microbatches}) than stages "
                        f"({pp_size}); this ideal is what its loop would do (as slow as GPipe).")
    return simulate_order(order, pp_size * spr, n_microbatches, cost, meta=meta)


def memory_peak(order, weight_memory: float = 1.0, stages_per_rank: int = 1) -> dict[int, float]:
    """Per rank, the most activation memory held at once, walking its order, in 1F1B stage
    microbatches: F holds 1/stages_per_rank, I frees (1 - weight_memory) of it, W the rest; a full B
    frees all of it. With weight_memory=1 and one stage per rank this is `orders.peak_in_flight`."""
    unit = 1.0 / stages_per_rank
    delta = {"F": unit, "I": -(1 - weight_memory) * unit, "W": -weight_memory * unit, "B": -unit}
    peak: dict[int, float] = {}
    for rank, acts in normalize_order(order).items():
        held = top = 0.0
        for kind, _s, _mb in acts:
            held += delta.get(kind, 0.0)
            top = max(top, held)
        top = round(top, 9)
        peak[rank] = int(top) if top == int(top) else top  # whole microbatches print as before (4, not 4.0)
    return peak


def theory_json(timeline: Timeline) -> dict:
    """What `labkit theory --json` prints: actions, makespan, both bubble definitions, meta, and the
    peak activation memory per rank in 1F1B stage microbatches (a stage of a rank holding several
    weighs 1/stages_per_rank; held from F until B, or W when split), so that schedules can be compared
    at equal memory with `labkit search --memory-limit`."""
    from ..schedules.orders import rank_orders

    t = timeline.shifted()
    m = t.metrics()
    spr = t.meta.get("stages_per_rank") or 1
    return {
        "peak": {str(r): v for r, v in memory_peak(rank_orders(t), 1.0, spr).items()},
        "actions": [{"rank": a.rank, "stage": a.stage, "microbatch": a.microbatch, "kind": a.kind,
                     "start": a.start, "end": a.end} for a in t.actions],
        "makespan": m["makespan"],
        "bubble_fraction": m["bubble_fraction"],
        "bubble_ratio": m["bubble_ratio"],
        "meta": dict(t.meta),
    }
