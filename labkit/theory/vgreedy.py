"""V-Half and V-Min: V schedules at 1/2 and 1/3 of 1F1B's activation memory, built as their authors do.

"Pipeline Parallelism with Controllable Memory" (Qi, Wan, Huang, Lin, arXiv 2405.15362) builds V
schedules (two stages per rank, rank r holding stages r and 2P-1-r, torch's V placement) from a
repeating building block: each rank starts its four passes of a microbatch (F on its first stage, F
on its second, I on its second, I on its first) at fixed offsets, so that a rank holds about P/2
(V-Half) or P/3 (V-Min) microbatches' activations of a full rank, against 1F1B's P. The paper
claims about 1/2 and 2/3 of 1F1B's bubble at those memories.

This is a port of the zero-bubble repository's implementation (sail-sg/zero-bubble-pipeline-
parallelism, `megatron/core/pipeline_parallel/zerobubble/scheduler/zbv_greedy.py`, commit 39f2c18):
the stable pattern repeated every 6 slots, W's put into the free slots after their I ("put_w"),
then a greedy "squeeze" that moves each pass to the earliest free slot its dependencies allow
without raising the memory peak, done once with the W's and once without, and the execution order
read off an eager replay. `labkit.theory.search` takes the result as a seed with two stages per rank
(kept when it fits the limit), and CP-SAT can start from it; taught in notebook 13.
"""

from __future__ import annotations

from ..schedules.orders import PlannedAction
from .cost import Cost

KINDS = ("V-Half", "V-Min")


def _pattern(kind: str, n: int) -> list[list[int]]:
    """Slots of a rank's first F, second F, second I, first I (of microbatch 0) in the building block."""
    if kind == "V-Min":
        gap = 2 if n % 3 == 0 else 0
        return [[i, n * 2 - i - 1, n * 2 + gap + i, n * 4 + gap - i - 1] for i in range(n)]
    gap = 3 if n % 2 == 0 else 0
    return [[i * 2, n * 3 - i - 2, n * 3 + gap + i * 2 - 1, n * 6 + gap - i - 2] for i in range(n)]


def _put_w(schedule: list[list[int]], split_w: bool = False) -> list[list[int]]:
    """Each I's W into the next free slot (FIFO): one W list, or one per stage (split_w)."""
    bound = max(x[-1] for x in schedule)
    inf = bound + 1
    schedule.append([])
    if split_w:
        schedule.append([])
    w_cnt = [0, 0]
    p = [0] * len(schedule)
    i = 0
    for i in range(bound + 1):
        nt, ty = min((schedule[t][p[t]] if p[t] < len(schedule[t]) else inf, t) for t in range(4))
        if nt == i:
            p[ty] += 1
            if 2 <= ty < 4:
                w_cnt[ty - 2 if split_w else 0] += 1
        else:
            for w in range(2):
                if w_cnt[w]:
                    schedule[w + 4].append(i)
                    w_cnt[w] -= 1
                    break
    for w in range(2):
        while w_cnt[w] > 0:
            i += 1
            schedule[w + 4].append(i)
            w_cnt[w] -= 1
    return schedule


def _mem_of_stage(schedule: list[list[int]]) -> int:
    """Peak in half microbatches: each F holds 1 until its W (or, without W's placed, until a free slot)."""
    memory = [1, 1, 0, 0, -1]
    has_w = len(schedule) > 4
    inf = max(x[-1] for x in schedule) + 1
    w_cnt = cur = res = 0
    p = [0] * len(schedule)
    for i in range(inf):
        nt, ty = min((schedule[t][p[t]] if p[t] < len(schedule[t]) else inf, t) for t in range(len(schedule)))
        if nt == i:
            p[ty] += 1
            cur += memory[ty]
            if 2 <= ty < 4:
                w_cnt += 1
        elif not has_w and w_cnt:
            cur += memory[4]
            w_cnt -= 1
        res = max(res, cur)
    return res


def _eager(stage_result: list[list[list[int]]], cost: list[float], comm: float = 0.0):
    """The repository's replay ("squeeze"): passes in slot order, each as early as its rank and inputs
    allow. Returns each pass's start (per rank, type, microbatch) and each rank's order of (type, mb)."""
    n_types = len(stage_result[0])
    n = len(stage_result)
    p = [[0] * n_types for _ in range(n)]
    inf = max(max(max(t) for t in st) for st in stage_result) + 1
    end: dict[tuple[int, int, int], float] = {}
    order: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for _ in range(n * sum(len(t) for t in stage_result[0])):
        _, s, ty, mb = min(((stage_result[s][t][p[s][t]] if p[s][t] < len(stage_result[s][t]) else inf), s, t,
                            p[s][t]) for s in range(n) for t in range(n_types))
        p[s][ty] += 1
        deps = 0.0
        if ty in (0, 2) and s > 0:
            deps = max(deps, end[(s - 1, ty, mb)] + comm)
        if ty in (1, 3) and s + 1 < n:
            deps = max(deps, end[(s + 1, ty, mb)] + comm)
        if 4 > ty > 0:
            deps = max(deps, end[(s, ty - 1, mb)])
        if mb > 0:
            deps = max(deps, end[(s, ty, mb - 1)])
        if order[s]:
            deps = max(deps, end[(s, *order[s][-1])])
        end[(s, ty, mb)] = deps + cost[ty]
        order[s].append((ty, mb))
    starts = [[[end[(s, ty, mb)] - cost[ty] for mb in range(len(st[ty]))] for ty in range(n_types)]
              for s, st in enumerate(stage_result)]
    return starts, order


def _reorder(stage_result: list[list[list[int]]], consider_w: bool) -> list[list[list[int]]]:
    """The repository's squeeze: after rank 0's first I-on-its-first-stage and until the last F, keep the
    slots; elsewhere move each pass to the earliest free slot its dependencies allow, memory permitting."""
    n_types = 4
    if consider_w:
        stage_result = [_put_w(s) for s in stage_result]
        n_types = 5
    current_mem = max(_mem_of_stage(s) for s in stage_result)
    n = len(stage_result)
    p = [[0] * n_types for _ in range(n)]
    occupied = [[""] * (st[-1][-1] + 1) for st in stage_result]
    phase = 0
    inf = max(max(max(t) for t in st) for st in stage_result) + 1
    for _ in range(n * sum(len(t) for t in stage_result[0])):
        nt, s, ty, mb = min(((stage_result[s][t][p[s][t]] if p[s][t] < len(stage_result[s][t]) else inf), s, t, p[s][t])
                            for s in range(n) for t in range(n_types))
        p[s][ty] += 1
        if ty == 3 and s == 0 and phase == 0:
            phase = 1
        if phase == 1 or (phase == 0 and not consider_w):
            if phase == 1 and ty == 0 and mb == len(stage_result[0][0]) - 1:
                phase = 2
            occupied[s][stage_result[s][ty][mb]] = "x"
            continue
        deps = -1
        if ty in (0, 2) and s > 0:
            deps = max(deps, stage_result[s - 1][ty][mb])
        if ty in (1, 3) and s + 1 < n:
            deps = max(deps, stage_result[s + 1][ty][mb])
        if 4 > ty > 0:
            deps = max(deps, stage_result[s][ty - 1][mb])
        if ty == 4:
            deps = max(deps, sorted(stage_result[s][2] + stage_result[s][3])[mb])
        if mb > 0:
            deps = max(deps, stage_result[s][ty][mb - 1])
        for slot in range(deps + 1, nt):
            if not occupied[s][slot]:
                stage_result[s][ty][mb] = slot
                if _mem_of_stage(stage_result[s]) <= current_mem:
                    break
        else:
            stage_result[s][ty][mb] = nt
        occupied[s][stage_result[s][ty][mb]] = "x"
    if not consider_w:
        stage_result = [_put_w(s) for s in stage_result]
    return [[[int(t) for t in ty] for ty in st] for st in _eager(stage_result, [1] * 5)[0]]


def v_order(kind: str, pp_size: int, n_microbatches: int) -> dict[int, list[PlannedAction]]:
    """V-Half or V-Min as the kit's order: rank r holds stages r and 2P-1-r; F, I, W per stage."""
    if kind not in KINDS:
        raise ValueError(f"v_order builds {', '.join(KINDS)}, got {kind!r}.")
    n, m = pp_size, n_microbatches
    stage_result = [[list(range(x, x + 6 * m, 6)) for x in st] for st in _pattern(kind, n)]
    r1 = [s[:4] for s in _reorder(stage_result, consider_w=True)]
    r2 = [_put_w(s[:4], split_w=True) for s in _reorder(r1, consider_w=False)]
    order = {}
    for r, passes in enumerate(_eager(r2, [1] * 6)[1]):
        first, second = r, 2 * n - 1 - r
        # the repository's types: F, f (forward on the first / second stage), B, b (I on the second /
        # first stage), W, w (their W's)
        kinds = [("F", first), ("F", second), ("I", second), ("I", first), ("W", second), ("W", first)]
        order[r] = [(kinds[ty][0], kinds[ty][1], mb) for ty, mb in passes]
    return order


def v_orders(pp_size: int, n_microbatches: int):
    """V-Half and V-Min with a rule naming each (search's seeds with two stages per rank)."""
    for kind in KINDS:
        try:
            yield v_order(kind, pp_size, n_microbatches), f"seed: {kind} (arXiv 2405.15362, sail-sg zbv_greedy)"
        except (IndexError, ValueError):  # sizes the building block does not cover
            continue
