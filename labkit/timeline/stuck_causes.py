"""Why a run's ranks stopped where they did (`causes`), from where each one was (`labkit.timeline.stuck`'s
`RankState`s): a rank outside the schedule that another waits for (or, in a live pool's cell, a rank that
finished the cell or was not sent it), ranks in different steps,
schedules that differ across ranks (class, microbatch count, stages), a wait cycle, a peer that left
first, or no wait at all (slow work is not a hang). Each cause is a sentence that says what to change;
what the kit could not tell is said too. Taught in notebook 09.

Ranked so that the first cause is the one to fix: a rank outside the schedule (in a collective, a data
loader, an evaluation) comes before anything its absence induces, even where the waits its peers logged do
not lead to it. A wait cycle is named only where the ranks' orders really deadlock: their observed waits
form a cycle AND `labkit.schedules.deadlock.find_deadlock` finds one in their orders (the planned orders of
their schedule class and microbatch count, from `labkit.theory.planned_actions`; else, for a custom order,
what each rank ran, the action it is blocked at and the actions its peers wait for from it). The plan of a
torch schedule that every rank runs alike finishes: waits that seem to go round are then a consequence.

May import: labkit.core, labkit.timeline, labkit.schedules, labkit.theory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schedules.deadlock import find_deadlock
from ..schedules.orders import ScheduleError

if TYPE_CHECKING:
    from .logged_steps import RankLog
    from .stuck import RankState

__all__ = ["causes"]


def causes(states: dict[int, "RankState"], logs: dict[int, "RankLog"],
           cell: int | None = None) -> tuple[list[str], list[str]]:
    """(causes, what could not be told), each a list of sentences. `cell`: a live pool's cell (labkit.Ranks)."""
    first = (_outside(states) + _left_cell(states) + _left_first(states) + _different_steps(states)
             + _schedules_differ(states, logs))
    cycle, unchecked = _cycle(states, logs)  # last: a cycle these induce is theirs, not the orders'
    found = first + cycle
    if not found:
        found = _not_waiting(states, "" if cell is not None else  # a pool's error says how to raise a cell's deadline
                             " If the job is just slow, raise stall= (--stall) or timeout= (--timeout).")
    return found, _unknown(states, logs) + ([] if first else unchecked)


def _waited_on(s: "RankState", states: dict) -> set[int]:
    """The ranks `s` waits for: its transfers' peers; in the first step's set-up, every other rank."""
    if s.doing == "setup":
        return set(states) - {s.rank}
    if s.doing == "wait":
        return {t.peer_rank for t in s.waits if t.peer_rank is not None}
    return set()


def _outside(states: dict) -> list[str]:
    out = []
    for r, s in sorted(states.items()):
        if s.doing != "outside":
            continue
        waiting = _waiting_for(r, states)
        if not waiting:
            continue
        w, named = waiting[0]
        if named:
            wait = f"rank {w.rank} waits for it in step {w.step}"
        else:  # no logged wait names it, but its pipeline's ranks wait in a step that needs it
            many = len(waiting) > 1
            steps = "/".join(str(k) for k in sorted({x.step for x, _ in waiting if x.step is not None})) or "?"
            wait = (f"rank{'s' if many else ''} {', '.join(str(x.rank) for x, _ in waiting)} wait"
                    f"{'' if many else 's'} in step {steps} of its pipeline")
        done = ("never reached schedule.step" if s.step == 0 else
                f"left schedule.step after step {s.step}" if s.step else "is not in schedule.step")
        out.append(f"rank {r} is outside the schedule while {wait}: rank {r} "
                   f"{done} and is in {s.frame()}. Every rank of a pipeline calls schedule.step, the same number "
                   f"of times: find why rank {r} does not (a data loader, an evaluation, a condition on the rank).")
    return out


def _waiting_for(r: int, states: dict) -> list[tuple]:
    """[(a rank that waits, True where its logged waits name `r`)]: those that wait for `r` itself; else every
    rank of `r`'s pipeline blocked in the schedule (False): a step needs every rank of its pipeline, whatever
    the waits read from the logs say (a wait misread, or one that ends at a rank that waits for `r`)."""
    direct = [(w, True) for w in states.values() if r in _waited_on(w, states)]
    mine = states[r].pipeline
    return direct or [(w, False) for x, w in sorted(states.items()) if w.doing in ("wait", "setup")
                      and (not mine or x in mine) and (not w.pipeline or r in w.pipeline)]


def _left_cell(states: dict) -> list[str]:
    """A live pool's cell: a rank that finished it (or was not sent it) while another waits for it there."""
    out = []
    for r, s in sorted(states.items()):
        waiters = [w for w in states.values() if s.doing in ("finished", "idle") and r in _waited_on(w, states)]
        if not waiters:
            continue
        w = waiters[0]
        did = ("was not sent the cell" if s.doing == "idle" else
               "finished the cell without calling schedule.step" if not s.step else
               f"finished the cell after step {s.step}")
        out.append(f"rank {r} {did} while rank {w.rank} waits for it in step {w.step}. Every rank of a pipeline "
                   f"calls schedule.step in the same cell, the same number of times: find why rank {r} does not "
                   "(a condition on the rank, a cell run with ranks=).")
    return out


def _different_steps(states: dict) -> list[str]:
    inside = {r: s.step for r, s in states.items() if s.in_schedule and s.step is not None}
    if len(set(inside.values())) < 2:
        return []
    where = ", ".join(f"rank {r} in step {k}" for r, k in sorted(inside.items()))
    return [f"the ranks are in different steps ({where}): one of them called schedule.step more often than "
            "the other; call it once per batch on every rank."]


def _schedules_differ(states: dict, logs: dict) -> list[str]:
    out = []
    classes = {r: s.schedule for r, s in states.items() if s.schedule}
    if len(set(classes.values())) > 1:
        built = ", ".join(f"rank {r} built {c}" for r, c in sorted(classes.items()))
        out.append(f"the ranks' schedules differ: {built}. Build the same schedule class on every rank.")
    counts = {r: s.microbatches for r, s in states.items() if s.microbatches}
    if len(set(counts.values())) > 1:
        runs = ", ".join(f"rank {r} runs {m}" for r, m in sorted(counts.items()))
        out.append(f"the ranks' schedules differ: {runs} microbatches per step. Pass the same n_microbatches "
                   "on every rank.")
    else:
        out += _beyond_peer(states)
    return out + _stages_differ(logs)


def _beyond_peer(states: dict) -> list[str]:
    """A rank waits for a microbatch its peer's schedule does not have."""
    out = []
    for w in states.values():
        for t in w.waits:
            peer = states.get(t.peer_rank)
            if peer is None or t.mb is None or not peer.microbatches or t.mb < peer.microbatches:
                continue
            verb = "waited" if w.how == "raised" else "waits"
            out.append(f"the ranks' schedules differ: rank {w.rank} {verb} for microbatch {t.mb}'s {t.what} from "
                       f"rank {peer.rank}, whose schedule runs {peer.microbatches} microbatches per step "
                       f"(0-{peer.microbatches - 1}). Pass the same n_microbatches on every rank.")
            return out
    return out


def _stages_differ(logs: dict) -> list[str]:
    out = []
    holders: dict[int, list[int]] = {}
    for r, log in sorted(logs.items()):
        for s in log.stages:
            holders.setdefault(s, []).append(r)
    for s, ranks in sorted(holders.items()):
        if len(ranks) > 1:
            out.append(f"the ranks' placements differ: ranks {', '.join(map(str, ranks))} all hold stage {s}. "
                       "Give each rank its own stage_index (PipelineStage(..., stage_index, num_stages, ...)).")
    if logs and all(log.events for log in logs.values()):
        for r, log in sorted(logs.items()):
            for src, dst in sorted(log.sends_to.items()):
                if dst not in holders:
                    out.append(f"rank {r}'s stage {src} sends to stage {dst}, which no rank holds: the ranks "
                               "disagree on the number of stages (PipelineStage's num_stages).")
    return out


def _cycle(states: dict, logs: dict) -> tuple[list[str], list[str]]:
    """(a wait cycle, as a cause; what could not be told of one). The ranks' waits must go round AND
    `find_deadlock` must find a cycle in their orders: waits that go round in orders that finish are a
    consequence of something else (a rank outside the schedule, a misread wait), never a deadlock."""
    loop = _wait_loop(states)
    if not loop or any(states[r].doing == "setup" for r in loop):
        return [], []  # the set-up is an exchange every rank joins, not a step of an order
    orders = _planned_orders(states, logs, loop) or _seen_orders(states, logs, loop)
    if orders is None:
        ranks = ", ".join(str(r) for r in loop[:-1])
        return [], [f"ranks {ranks} wait for each other, but the kit could not check their orders (one of them "
                    "waits on a send, and the schedule is not one the kit plans): it names no wait cycle."]
    try:
        found = find_deadlock(orders, 1 + max((s for log in logs.values() for s in log.stages), default=0))
    except ScheduleError:
        found = None
    if found is None or not found.cycle:
        return [], []
    hops = ", ".join(f"rank {a} waits for rank {b}" for a, b in zip(found.cycle, found.cycle[1:]))
    return [f"a wait cycle: {hops}: none of them can go on. Their orders deadlock: check an order "
            "before running it (labkit.schedules.deadlock.find_deadlock)."], []


def _wait_loop(states: dict) -> list[int]:
    """The first cycle of ranks each waiting for the next (ranks still running: their stacks were dumped),
    as [r0, r1, ..., r0]; [] if none."""
    edges = {r: sorted(_waited_on(s, states) & set(states)) for r, s in states.items()
             if s.how == "stalled" and s.doing in ("wait", "setup")}
    for start in sorted(edges):
        path, seen = [start], {start}
        r = start
        while edges.get(r):
            r = edges[r][0]
            if r in seen:
                loop = path[path.index(r):] + [r]
                if len(loop) < 3 and states[loop[0]].doing == "setup":
                    break
                return loop
            path.append(r)
            seen.add(r)
    return []


def _pipeline(states: dict, loop: list) -> list[int]:
    mine = states[loop[0]].pipeline
    return list(mine) if mine and all(r in states for r in mine) else sorted(states)


def _planned_orders(states: dict, logs: dict, loop: list) -> dict | None:
    """{rank: the order its schedule class plans for one step of its microbatch count} for every rank of the
    loop's pipeline (`labkit.theory.planned_actions`); None where one is unknown (a custom order run on the
    runtime, a step count not yet logged) or does not place the stages the rank logged."""
    from ..theory import planned_actions

    ranks = _pipeline(states, loop)
    orders = {}
    for i, r in enumerate(ranks):
        s, log = states[r], logs.get(r)
        if log is None or not s.schedule or not s.microbatches or not log.stages:
            return None
        try:
            plan = planned_actions(s.schedule, len(ranks), s.microbatches, len(log.stages))[i]
        except Exception:  # not a schedule the kit plans (_PipelineScheduleRuntime), or sizes torch refuses
            return None
        if {st for _, st, _ in plan} != set(log.stages):
            return None
        orders[r] = list(plan)
    return orders


_TOPO = {"F": 0, "B": 1, "I": 1, "W": 2}


def _done_in_order(done: set) -> list:
    """The actions a rank ended in its step, in an order that replays: every forward before every backward,
    forwards by (microbatch, stage), backwards by (microbatch, stage from the last)."""
    return sorted(done, key=lambda a: (_TOPO[a[0]], a[2], a[1] if a[0] == "F" else -a[1]))


def _seen_orders(states: dict, logs: dict, loop: list) -> dict | None:
    """{rank: what it ran in its step, the action it is blocked at, then what its peers wait for from it}: the
    part of a custom order the logs tell. None where a rank of the loop waits on a send only (an order holds
    compute actions: a send's wait is in none)."""
    if any(not any(t.op == "recv" for t in states[r].waits) for r in loop):
        return None
    orders = {}
    for r, s in states.items():
        if not s.in_schedule:
            continue  # a rank outside the schedule plans nothing the others could wait for
        log = logs.get(r)
        ongoing = log is not None and log.steps and s.steps_from == "logs" and s.step == len(log.steps)
        orders[r] = _done_in_order(log.step.done) if ongoing else []
        if s.doing in ("wait", "compute") and s.action and s.action[0] in _TOPO and None not in s.action \
                and s.action not in orders[r]:
            orders[r].append(tuple(s.action))
    for w in states.values():
        for t in w.waits:
            if t.op != "recv" or t.mb is None or t.peer_stage is None or t.peer_rank not in orders:
                continue
            peer = orders[t.peer_rank]
            kinds = ("F",) if t.what == "activation" else \
                ("I", "B") if any(k == "I" for k, _, _ in peer) else ("B", "I")
            if not any((k, t.peer_stage, t.mb) in peer for k in kinds):
                peer.append((kinds[0], t.peer_stage, t.mb))
    return orders


def _gone(s: "RankState") -> bool:
    return s.how == "exited" or (s.how == "raised" and not s.echo)


def _left_first(states: dict) -> list[str]:
    """A rank that failed (or waits) because a peer went away: which one left first, and what it waited for."""
    gone = [s for s in states.values() if _gone(s)]
    out = []
    for v in sorted(states.values(), key=lambda s: s.rank):
        if not ((v.how == "raised" and v.echo) or (v.how == "stalled" and v.doing == "wait")):
            continue
        peers = {t.peer_rank for t in v.waits}
        # a peer outside the schedule that `v` waits for is said by `_outside` already
        left = [g for g in gone if g.rank in peers and g.doing != "outside"] or ([] if v.how == "stalled" else gone)
        if not left:
            continue
        first = min(left, key=lambda s: (s.last_time is None, s.last_time or 0.0, s.rank))
        waited = " and ".join(t.words() for t in sorted(v.waits, key=lambda t: t.op != "recv")
                              if t.peer_rank == first.rank) or "for it"
        ended = (f"failed first with {first.error}" if first.how == "raised" else
                 "ended" + (f" (exit code {first.exitcode})" if first.exitcode is not None else ""))
        after = (f" in its step {first.step}" if first.in_schedule else f" after its step {first.step}") \
            if first.step else ""
        per = f" ({first.microbatches} microbatches per step)" if first.microbatches else ""
        verb = "waited" if v.how == "raised" else "waits"
        look = (f"Rank {v.rank}'s error only echoes that: look at rank {first.rank}." if v.how == "raised" else
                f"Look at rank {first.rank}.")
        out.append(f"rank {first.rank} left first: it {ended}{after}{per}, while rank {v.rank} {verb} in step "
                   f"{v.step} {waited}. {look}")
    return out


def _not_waiting(states: dict, slow: str) -> list[str]:
    busy = [s for s in states.values() if s.doing == "compute"]
    if not busy or any(s.doing in ("wait", "setup") for s in states.values()):
        return []
    who = ", ".join(f"rank {s.rank} computes {s.action_words() or 'an action'}" for s in busy)
    return [f"no rank was waiting for another ({who}): a long step is not a hang.{slow}"]


def _unknown(states: dict, logs: dict) -> list[str]:
    out = []
    for r, s in sorted(states.items()):
        log = logs.get(r)
        if (log is None or not log.events) and s.doing not in ("exited", "unknown") and s.steps_from != "logs":
            step = "its steps come from its spans" if s.steps_from == "spans" else "its step is unknown"
            out.append(f"rank {r} wrote no pipelining log line (TORCH_LOGS=+pp off, or it built no schedule): "
                       f"{step}, and so are the action and microbatch it is in.")
        elif s.doing == "wait" and not s.waits:
            out.append(f"rank {r} waits for a transfer its log does not name (a wait before its step's first "
                       "batch_p2p line).")
        if s.how == "unknown" and s.doing == "unknown":
            out.append(f"rank {r} left no stack dump and no traceback: it had ended before the job was stopped.")
    return out
