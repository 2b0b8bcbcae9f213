"""The zero-bubble authors' own heuristic: F and I as early as memory allows, W only to fill bubbles.

A port of `Graph.manual_order` from the zero-bubble repository (sail-sg/zero-bubble-pipeline-
parallelism, `megatron/core/pipeline_parallel/zerobubble/scheduler/zb.py`, commit 39f2c18), the
first pass the paper (arXiv 2401.10241, Section 3.1, "heuristic algorithm") runs before its ILP.
It builds one stage per rank, microbatch by microbatch:

- microbatch 0: every stage runs as many warm-up forwards as fit in memory and in the time before
  microbatch 0's gradient comes back (`allow_bubble_before_first_b`: may the last one overrun it);
- then per microbatch: each stage's next F (optionally held back while the next stage lags,
  `prioritize_b`) and, from the last stage back, its I; before each, the W that memory forces out,
  and W only where the rank would otherwise wait for its input (`no_bubble_greedy`: also when the
  wait is within the largest bubble any stage has had so far);
- the W still owed come last, which is what lets twice 1F1B's memory reach almost no bubble.

All 8 combinations of the three flags are tried (as `initial_solution` does) and the order with the
shortest longest stage kept. Memory is the paper's count, in 1F1B stage microbatches: F holds 1, I
frees 1 - R, W frees R (`weight_memory`). `labkit.theory.search` uses the result as a seed (and
CP-SAT warm-starts from the best seed); taught in notebook 13.
"""

from __future__ import annotations

from itertools import product

from ..schedules.orders import PlannedAction
from .cost import Cost


class _Stuck(Exception):
    """Memory cannot fit (the repository raises ValueError("Cannot fit memory"))."""


def manual_order(pp_size: int, m: int, cost: Cost, memory_limit: float, weight_memory: float,
                 allow_bubble_before_first_b: bool, prioritize_b: bool,
                 no_bubble_greedy: bool) -> tuple[dict[int, list[PlannedAction]], float] | None:
    """One run of the repository's heuristic: the order per stage and its longest stage's span, or
    None when memory cannot fit."""
    p = pp_size
    cost_of = (cost.F, cost.input_grad, cost.weight_grad)
    mem_of = (1.0, -(1.0 - weight_memory), -weight_memory)
    comm = cost.p2p
    count = [[0] * p for _ in range(3)]  # f, b, w done per stage
    f, b, w = count
    mem = [0.0] * p
    e = [0.0] * p                    # when each stage is next free
    t: dict[PlannedAction, float] = {}  # end time of each action
    order: dict[int, list[PlannedAction]] = {s: [] for s in range(p)}
    bubble = [0.0] * p
    eps = 1e-9

    def put(j: int, k: int) -> None:
        a = ("FIW"[k], j, count[k][j])
        end = e[j] + cost_of[k]
        no_bubble = end
        if j > 0 and k == 0:
            end = max(end, t[("F", j - 1, a[2])] + comm + cost_of[k])
        if j < p - 1 and k == 1:
            end = max(end, t[("I", j + 1, a[2])] + comm + cost_of[k])
        if f[j] > 0:
            bubble[j] += end - no_bubble
        e[j] = t[a] = end
        mem[j] += mem_of[k]
        count[k][j] += 1
        order[j].append(a)

    def make_room(j: int, need: float) -> None:
        while mem[j] + need > memory_limit + eps:
            if w[j] >= b[j]:
                raise _Stuck
            put(j, 2)

    def fill(j: int, ready: float) -> None:
        """W's that end before the input arrives; one more if the wait is a real bubble."""
        while w[j] < b[j] and e[j] + cost_of[2] <= ready + eps:
            put(j, 2)
        if w[j] < b[j] and e[j] < ready - eps:
            if ready - e[j] <= max(bubble) - bubble[j]:
                if no_bubble_greedy:
                    put(j, 2)
            else:
                put(j, 2)

    try:
        for i in range(m):
            if i == 0:
                for j in range(p):
                    make_room(j, mem_of[0])
                    put(j, 0)
                need = [0] * p
                last_t = 0.0
                for j in range(p - 1, -1, -1):
                    if j == p - 1:
                        last_t = t[("F", j, 0)] + cost_of[1]
                        continue
                    held, busy = mem[j], e[j]
                    while f[j] + need[j] < m and held + mem_of[0] <= memory_limit + eps:
                        if allow_bubble_before_first_b:
                            if busy + cost_of[0] > last_t + comm:
                                break
                        elif busy >= last_t + comm:
                            break
                        held += mem_of[0]
                        busy += cost_of[0]
                        need[j] += 1
                    last_t = max(busy, last_t + comm) + cost_of[1]
                for j in range(1, p):
                    while need[j] > 0 and need[j] >= need[j - 1] and f[j] + need[j] < m:
                        need[j] -= 1
                for j in range(p):
                    for _ in range(need[j]):
                        put(j, 0)
                for j in range(p - 1, -1, -1):
                    put(j, 1)
                continue
            need = [0] * p
            for j in range(p):
                if f[j] >= m:
                    continue
                if j + 1 < p and f[j] >= f[j + 1] + 2 and prioritize_b:
                    next_plus_fw = e[j + 1] + cost_of[0] + cost_of[1] + comm
                    if e[j] >= next_plus_fw:
                        continue
                    w_cost, w_cnt, with_w = 0.0, 0, mem[j] + mem_of[0]
                    while with_w > memory_limit + eps and w[j] + w_cnt < b[j]:
                        w_cost += cost_of[2]
                        with_w += mem_of[2]
                        w_cnt += 1
                    if e[j] + cost_of[0] + w_cost <= next_plus_fw:
                        need[j] = 1
                        continue
                    if next_plus_fw - e[j] <= max(bubble) - bubble[j]:
                        continue
                need[j] = 1
            for j in range(p - 2, -1, -1):
                need[j] = min(need[j], need[j + 1])
            for j in range(p):
                if need[j] == 0:
                    continue
                make_room(j, mem_of[0])
                if j > 0:
                    fill(j, t[("F", j - 1, f[j])] + comm)
                put(j, 0)
            for j in range(p - 1, -1, -1):
                make_room(j, mem_of[1])
                if j + 1 < p:
                    fill(j, t[("I", j + 1, i)] + comm)
                if j == 0 and f[j] == m:
                    while w[j] < b[j]:
                        put(j, 2)
                put(j, 1)
        for j in range(p):
            while w[j] < m:
                put(j, 2)
    except (_Stuck, KeyError):  # KeyError: an I before its input's F was placed (memory too small)
        return None
    span = max(t[("W", j, m - 1)] - t[("F", j, 0)] + cost_of[0] for j in range(p))
    return order, span


def best_order(pp_size: int, m: int, cost: Cost, memory_limit: float, weight_memory: float = 1.0):
    """The repository's `initial_solution`: the order of the flag combination with the shortest longest
    stage (the first on ties) and a rule naming its flags; None when none fits in memory."""
    best = None
    for flags in product((True, False), repeat=3):
        got = manual_order(pp_size, m, cost, memory_limit, weight_memory, *flags)
        if got is not None and (best is None or got[1] < best[1] - 1e-9):
            best = (got[0], got[1], flags)
    if best is None:
        return None
    names = [n for n, v in zip(("bubble before first I", "I first", "greedy W"), best[2]) if v]
    return best[0], "seed: zero-bubble heuristic (sail-sg manual_order: %s)" % (", ".join(names) or "plain")
