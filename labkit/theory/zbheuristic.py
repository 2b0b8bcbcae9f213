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


EPS = 1e-9


class _Stuck(Exception):
    """Memory cannot fit (the repository raises ValueError("Cannot fit memory"))."""


def manual_order(pp_size: int, m: int, cost: Cost, memory_limit: float, weight_memory: float,
                 allow_bubble_before_first_b: bool, prioritize_b: bool,
                 no_bubble_greedy: bool) -> tuple[dict[int, list[PlannedAction]], float] | None:
    """One run of the repository's heuristic: the order per stage and its longest stage's span, or
    None when memory cannot fit."""
    g = _Graph(pp_size, m, cost, memory_limit, weight_memory,
               (allow_bubble_before_first_b, prioritize_b, no_bubble_greedy))
    try:
        for i in range(m):
            if i == 0:
                g.first_microbatch()
            else:
                g.microbatch(i)
        g.drain()
    except (_Stuck, KeyError):  # KeyError: an I before its input's F was placed (memory too small)
        return None
    return g.order, g.span()


class _Graph:
    """One run's state, stage by stage: actions done per kind, memory held, when the stage is next
    free, the end time of each action placed, and the bubbles it has had (the repository's `Graph`)."""

    def __init__(self, pp_size: int, m: int, cost: Cost, memory_limit: float, weight_memory: float,
                 flags: tuple[bool, bool, bool]):
        p = self.p = pp_size
        self.m, self.memory_limit = m, memory_limit
        self.allow_bubble_before_first_b, self.prioritize_b, self.no_bubble_greedy = flags
        self.cost_of = (cost.F, cost.input_grad, cost.weight_grad)
        self.mem_of = (1.0, -(1.0 - weight_memory), -weight_memory)
        self.comm = cost.p2p
        self.count = [[0] * p for _ in range(3)]  # f, b, w done per stage
        self.f, self.b, self.w = self.count
        self.mem = [0.0] * p
        self.e = [0.0] * p                    # when each stage is next free
        self.t: dict[PlannedAction, float] = {}  # end time of each action
        self.order: dict[int, list[PlannedAction]] = {s: [] for s in range(p)}
        self.bubble = [0.0] * p

    def put(self, j: int, k: int) -> None:
        """Place stage j's next action of kind k (0 F, 1 I, 2 W) after its input arrives."""
        cost_of, t, e = self.cost_of, self.t, self.e
        a = ("FIW"[k], j, self.count[k][j])
        end = e[j] + cost_of[k]
        no_bubble = end
        if j > 0 and k == 0:
            end = max(end, t[("F", j - 1, a[2])] + self.comm + cost_of[k])
        if j < self.p - 1 and k == 1:
            end = max(end, t[("I", j + 1, a[2])] + self.comm + cost_of[k])
        if self.f[j] > 0:
            self.bubble[j] += end - no_bubble
        e[j] = t[a] = end
        self.mem[j] += self.mem_of[k]
        self.count[k][j] += 1
        self.order[j].append(a)

    def make_room(self, j: int, need: float) -> None:
        """W's until `need` more fits in stage j's memory."""
        while self.mem[j] + need > self.memory_limit + EPS:
            if self.w[j] >= self.b[j]:
                raise _Stuck
            self.put(j, 2)

    def fill(self, j: int, ready: float) -> None:
        """W's that end before the input arrives; one more if the wait is a real bubble."""
        e, w, b, cost_w = self.e, self.w, self.b, self.cost_of[2]
        while w[j] < b[j] and e[j] + cost_w <= ready + EPS:
            self.put(j, 2)
        if w[j] < b[j] and e[j] < ready - EPS:
            if ready - e[j] <= max(self.bubble) - self.bubble[j]:
                if self.no_bubble_greedy:
                    self.put(j, 2)
            else:
                self.put(j, 2)

    def first_microbatch(self) -> None:
        """Microbatch 0: every stage's F, the warm-up forwards that fit, then the I's from the last stage back."""
        p = self.p
        for j in range(p):
            self.make_room(j, self.mem_of[0])
            self.put(j, 0)
        need = self._warmup()
        for j in range(1, p):
            while need[j] > 0 and need[j] >= need[j - 1] and self.f[j] + need[j] < self.m:
                need[j] -= 1
        for j in range(p):
            for _ in range(need[j]):
                self.put(j, 0)
        for j in range(p - 1, -1, -1):
            self.put(j, 1)

    def _warmup(self) -> list[int]:
        """Per stage, the forwards that fit in memory and in the time before microbatch 0's gradient
        comes back (from the last stage back)."""
        p, m, cost_of, comm = self.p, self.m, self.cost_of, self.comm
        need = [0] * p
        last_t = 0.0
        for j in range(p - 1, -1, -1):
            if j == p - 1:
                last_t = self.t[("F", j, 0)] + cost_of[1]
                continue
            held, busy = self.mem[j], self.e[j]
            while self.f[j] + need[j] < m and held + self.mem_of[0] <= self.memory_limit + EPS:
                if self.allow_bubble_before_first_b:
                    if busy + cost_of[0] > last_t + comm:
                        break
                elif busy >= last_t + comm:
                    break
                held += self.mem_of[0]
                busy += cost_of[0]
                need[j] += 1
            last_t = max(busy, last_t + comm) + cost_of[1]
        return need

    def microbatch(self, i: int) -> None:
        """Microbatch i > 0: each stage's next F where wanted, then from the last stage back its I;
        before each, the W's memory forces out and those that fill a wait."""
        p, t, comm, f = self.p, self.t, self.comm, self.f
        need = self._forwards_wanted()
        for j in range(p - 2, -1, -1):
            need[j] = min(need[j], need[j + 1])
        for j in range(p):
            if need[j] == 0:
                continue
            self.make_room(j, self.mem_of[0])
            if j > 0:
                self.fill(j, t[("F", j - 1, f[j])] + comm)
            self.put(j, 0)
        for j in range(p - 1, -1, -1):
            self.make_room(j, self.mem_of[1])
            if j + 1 < p:
                self.fill(j, t[("I", j + 1, i)] + comm)
            if j == 0 and f[j] == self.m:
                while self.w[j] < self.b[j]:
                    self.put(j, 2)
            self.put(j, 1)

    def _forwards_wanted(self) -> list[int]:
        """1 for each stage whose next F runs now: every stage with forwards left, except (with
        `prioritize_b`) one 2 ahead of the next stage whose F would delay that stage's gradient."""
        p, e, cost_of = self.p, self.e, self.cost_of
        need = [0] * p
        for j in range(p):
            if self.f[j] >= self.m:
                continue
            if j + 1 < p and self.f[j] >= self.f[j + 1] + 2 and self.prioritize_b:
                next_plus_fw = e[j + 1] + cost_of[0] + cost_of[1] + self.comm
                if e[j] >= next_plus_fw:
                    continue
                w_cost, w_cnt, with_w = 0.0, 0, self.mem[j] + self.mem_of[0]
                while with_w > self.memory_limit + EPS and self.w[j] + w_cnt < self.b[j]:
                    w_cost += cost_of[2]
                    with_w += self.mem_of[2]
                    w_cnt += 1
                if e[j] + cost_of[0] + w_cost <= next_plus_fw:
                    need[j] = 1
                    continue
                if next_plus_fw - e[j] <= max(self.bubble) - self.bubble[j]:
                    continue
            need[j] = 1
        return need

    def drain(self) -> None:
        """The W's still owed, last."""
        for j in range(self.p):
            while self.w[j] < self.m:
                self.put(j, 2)

    def span(self) -> float:
        """The longest stage's span, its first F's start to its last W's end."""
        return max(self.t[("W", j, self.m - 1)] - self.t[("F", j, 0)] + self.cost_of[0] for j in range(self.p))


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
