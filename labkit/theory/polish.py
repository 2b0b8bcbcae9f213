"""Polishing a searched order: pull a forward (or a W) into a rank's idle time, keep what helps.

The zero-bubble authors' heuristic (`labkit.theory.zbheuristic`) warms each rank up with as many
forwards as END before the first gradient comes back, so every rank but the last waits a little
before its first I: with Table 9's costs (arXiv 2401.10241) rank 0 waits (P-1)(I + 2c - F), which is
all of the paper's ZB-2p bubble at most of its settings. One more forward there (memory allowing)
removes that wait: the I it delays is rank 0's, on which no other rank waits. Where memory is then
full and the wait only moves on to the next I, a W whose I is done fills it (and frees room for the
next forward), and so on until the wait reaches room to spare. `polish` tries these moves one at a
time: the next F, or the next W whose I is done, moved to just before an action its rank waited
for. It takes a move when the ranks' spans, longest first, get no longer (the period, the paper's
objective, never grows; equal spans let a wait travel on) and returns the best order it met. Each
try is one replay of the order (a lean copy of `simulate_order`'s rule). Used by `search` before the
exact model; taught in notebook 13.
"""

from __future__ import annotations

import time

from .cost import Cost


def replay(order: dict, cost: Cost):
    """(spans longest first, {action: (start, end)}) of `order` run as `simulate_order` runs it (each
    action as early as its rank and inputs allow), or None if it deadlocks."""
    dur = {"F": cost.F, "I": cost.input_grad, "W": cost.weight_grad}
    rank_of = {s: r for r, acts in order.items() for _, s, _ in acts}
    last = max(rank_of)
    at: dict = {}
    pos = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    left = sum(len(acts) for acts in order.values())
    while left:
        progress = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                kind, s, mb = a
                if kind == "F":
                    deps = (("F", s - 1, mb),) if s > 0 else ()
                elif kind == "I":
                    deps = (("F", s, mb),) + ((("I", s + 1, mb),) if s < last else ())
                else:
                    deps = (("I", s, mb),)
                t = free[r]
                for d in deps:
                    if d not in at:
                        break
                    t = max(t, at[d][1] + (cost.p2p if rank_of[d[1]] != r else 0.0))
                else:
                    at[a] = (t, t + dur[kind])
                    free[r] = t + dur[kind]
                    pos[r] += 1
                    left -= 1
                    progress = True
                    continue
                break
        if not progress:
            return None
    spans = [at[acts[-1]][1] - at[acts[0]][0] for acts in order.values() if acts]
    return tuple(round(x, 9) for x in sorted(spans, reverse=True)), at


def _tries(order: dict, at: dict, spans_of: dict):
    """(rank, position of an action its rank waited for, position of the action to run there): the
    next F, and the next W whose I is done; the longest rank's waits first."""
    for rank in sorted(order, key=lambda r: -spans_of[r]):
        acts = order[rank]
        for k in range(1, len(acts)):
            if at[acts[k]][0] - at[acts[k - 1]][1] <= 1e-9:
                continue
            done_i = {(s, mb) for kind, s, mb in acts[:k] if kind == "I"}
            nxt_f = next((j for j in range(k + 1, len(acts)) if acts[j][0] == "F"), None)
            nxt_w = next((j for j in range(k + 1, len(acts)) if acts[j][0] == "W" and acts[j][1:] in done_i), None)
            for j in (nxt_f, nxt_w):
                if j is not None:
                    yield rank, k, j


def _frozen(order) -> tuple:
    return tuple(tuple(acts) for _, acts in sorted(order.items()))


def polish(result, pp_size: int, n_microbatches: int, cost: Cost, max_tries: int = 400, seconds: float = 60.0):
    """`result` (a `SearchResult`, objective "period") or a better order found by moving one action
    at a time into a wait (see the module docstring); at most `max_tries` replays and about `seconds`.
    Memory limit and weight_memory are `result`'s; the rule says how many moves it took."""
    from .score import evaluate
    from .simulate import memory_peak

    t0 = time.monotonic()
    cur = {r: list(acts) for r, acts in result.order.items()}
    got = replay(cur, cost)
    if got is None:
        return result
    key, at = got
    best, best_key, seen = None, key, {_frozen(cur)}
    moved = tries = best_moved = 0
    stepped = True
    while stepped and tries < max_tries and time.monotonic() - t0 < seconds:
        stepped = False
        spans_of = {r: at[acts[-1]][1] - at[acts[0]][0] for r, acts in cur.items()}
        for rank, k, j in _tries(cur, at, spans_of):
            acts = list(cur[rank])
            acts.insert(k, acts.pop(j))
            order = {**cur, rank: acts}
            frozen = _frozen(order)
            if frozen in seen or memory_peak({rank: acts}, result.weight_memory,
                                             result.stages_per_rank)[rank] > result.memory_limit + 1e-9:
                continue
            seen.add(frozen)
            tries += 1
            got = replay(order, cost)
            if got is not None and got[0] <= key:  # better, or as good with the wait moved on
                cur, (key, at), moved, stepped = order, got, moved + 1, True
                if key < best_key:
                    best, best_key, best_moved = order, key, moved
                break
            if tries >= max_tries or time.monotonic() - t0 >= seconds:
                break
    if best is None:
        return result
    found = evaluate(best, pp_size, n_microbatches, cost, result.memory_limit,
                     f"{result.rule}; polished: {best_moved} action(s) moved into waits",
                     weight_memory=result.weight_memory, stages_per_rank=result.stages_per_rank,
                     objective=result.objective)
    found.bound = result.bound
    return found if found.period < result.period - 1e-9 else result
