"""The list scheduler, pass 1 of `labkit.theory.search`: whenever a rank is free it runs, in this
order of preference, an I whose gradient has arrived, an F whose input has arrived if memory allows,
a deferred W; otherwise it waits for the next arrival. Memory in 1F1B stage microbatches (F holds
1/stages_per_rank, I frees 1 - R of it, W the rest). Taught in notebook 13.
"""

from __future__ import annotations

from collections import deque

from ..schedules.orders import PlannedAction
from .cost import Cost


def placement(pp_size: int, stages_per_rank: int) -> list[list[int]]:
    """Stages on each rank: one per rank, or torch's V with two (rank r holds r and 2P-1-r, as
    ZBVZeroBubble and DualPipeV place them)."""
    if stages_per_rank == 1:
        return [[r] for r in range(pp_size)]
    return [[r, 2 * pp_size - 1 - r] for r in range(pp_size)]


def _at(t: float | None) -> float:
    return float("inf") if t is None else t


def list_schedule(pp_size: int, spr: int, m: int, cost: Cost, limit: float, weight_memory: float,
                   max_deferred: int, f_before_i: bool, extra_warmup: int) -> dict[int, list[PlannedAction]] | None:
    """One pass of the rule; None if it gets stuck."""
    ls = _ListScheduler(pp_size, spr, m, cost, limit, weight_memory, max_deferred, f_before_i, extra_warmup)
    when = [ls.earliest(k) for k in range(pp_size)]  # each rank's earliest start, kept up to date
    for _ in range(3 * m * ls.n):
        t, r = min((t, k) for k, t in enumerate(when))
        if t == float("inf"):
            return None  # every rank waits for something no rank will run
        cands = ls.candidates(r, t)
        if not cands:
            return None
        action = min(cands)[2]
        ls.place(r, t, action)
        for k in ls.touched(r, action):  # only these ranks' earliest start can have moved
            when[k] = ls.earliest(k)
    return ls.order


class _ListScheduler:
    """The list scheduler's state: per rank when it is next free, the memory it holds and its
    forwards in flight; per stage the next forward, the input-gradients and weight-gradients owed."""

    def __init__(self, pp_size: int, spr: int, m: int, cost: Cost, limit: float, weight_memory: float,
                 max_deferred: int, f_before_i: bool, extra_warmup: int):
        self.m, self.spr, self.cost, self.limit, self.weight_memory = m, spr, cost, limit, weight_memory
        self.max_deferred, self.f_before_i = max_deferred, f_before_i
        self.stages = placement(pp_size, spr)
        n = self.n = pp_size * spr
        self.rank_of = {s: r for r, ss in enumerate(self.stages) for s in ss}
        self.prefer = [sorted(ss, reverse=True) for ss in self.stages]  # the stage nearer the loss first
        self.unit = 1.0 / spr
        self.end: dict[PlannedAction, float] = {}
        self.order: dict[int, list[PlannedAction]] = {r: [] for r in range(pp_size)}
        self.free = [0.0] * pp_size
        self.next_f = [0] * n
        self.pending_i = [set() for _ in range(n)]   # forwarded, input-gradient not yet computed
        self.pending_w = [deque() for _ in range(n)]  # I done, W not yet (FIFO)
        self.held = [0.0] * pp_size
        self.in_flight = [0] * pp_size                # F done, I not yet, over the rank's stages
        self.warm = [(pp_size - r if spr == 1 else 2 * (pp_size - r) - 1) + extra_warmup for r in range(pp_size)]

    def arrival(self, a: PlannedAction, rank: int) -> float | None:
        """When action `a`'s inputs are all on `rank` (None: one is not computed yet)."""
        kind, s, mb = a
        if kind == "F":
            deps = [("F", s - 1, mb)] if s > 0 else []
        elif kind == "I":
            deps = [("F", s, mb)] + ([("I", s + 1, mb)] if s < self.n - 1 else [])
        else:
            deps = [("I", s, mb)]
        t = 0.0
        for d in deps:
            if d not in self.end:
                return None
            t = max(t, self.end[d] + (self.cost.p2p if self.rank_of[d[1]] != rank else 0.0))
        return t

    def may_forward(self, r: int, s: int) -> bool:
        # V: a forward on the rank's first stage leaves room for one on its second, whose backward
        # is what frees memory (without it both legs fill the rank and wait for each other)
        stages, next_f = self.stages, self.next_f
        room = self.unit if self.spr > 1 and s == stages[r][0] and next_f[stages[r][1]] < self.m else 0.0
        return (next_f[s] < self.m and self.held[r] + self.unit + room <= self.limit + 1e-9
                and self.in_flight[r] < self.warm[r])

    def candidates(self, r: int, t: float) -> list[tuple[int, int, PlannedAction]]:
        """(priority, stage preference, action) of what rank r could start at t."""
        pending_i, pending_w, next_f, f_before_i = self.pending_i, self.pending_w, self.next_f, self.f_before_i
        cands = []
        deferred = sum(len(pending_w[s]) for s in self.stages[r])
        for k, s in enumerate(self.prefer[r]):
            if deferred > self.max_deferred and pending_w[s]:
                cands.append((0, k, ("W", s, pending_w[s][0])))
            ready = sorted(mb for mb in pending_i[s] if _at(self.arrival(("I", s, mb), r)) <= t)
            if ready:
                cands.append((2 if f_before_i else 1, k, ("I", s, ready[0])))
            if self.may_forward(r, s) and _at(self.arrival(("F", s, next_f[s]), r)) <= t:
                cands.append((1 if f_before_i else 2, k, ("F", s, next_f[s])))
            if pending_w[s]:
                cands.append((3, k, ("W", s, pending_w[s][0])))
        return cands

    def earliest(self, r: int) -> float:
        """When rank r can next start something (inf: it waits on what no rank will run)."""
        if any(self.pending_w[s] for s in self.stages[r]):
            return self.free[r]
        times = []
        for s in self.stages[r]:
            times += [self.arrival(("I", s, mb), r) for mb in self.pending_i[s]]
            if self.may_forward(r, s):
                times.append(self.arrival(("F", s, self.next_f[s]), r))
        known = [x for x in times if x is not None]
        return max(self.free[r], min(known)) if known else float("inf")

    def touched(self, r: int, a: PlannedAction) -> set[int]:
        """The ranks whose `earliest` placing `a` on rank r can change: r itself (its free time, memory
        and what it owes) and the rank of the stage that consumes `a`'s output (the next stage's F
        after an F, the previous stage's I after an I)."""
        kind, s, _ = a
        out = {r}
        if kind == "F" and s + 1 < self.n:
            out.add(self.rank_of[s + 1])
        elif kind == "I" and s > 0:
            out.add(self.rank_of[s - 1])
        return out

    def place(self, r: int, t: float, a: PlannedAction) -> None:
        """Run `a` on rank r from t: its end, the rank's order, memory and what the stage owes."""
        kind, s, mb = a
        cost, unit = self.cost, self.unit
        self.end[a] = t + {"F": cost.F, "I": cost.input_grad, "W": cost.weight_grad}[kind]
        self.free[r] = self.end[a]
        self.order[r].append(a)
        if kind == "F":
            self.next_f[s] += 1
            self.held[r] += unit
            self.in_flight[r] += 1
            self.pending_i[s].add(mb)
        elif kind == "I":
            self.pending_i[s].discard(mb)
            self.pending_w[s].append(mb)
            self.held[r] -= (1 - self.weight_memory) * unit
            self.in_flight[r] -= 1
        else:
            self.pending_w[s].popleft()
            self.held[r] -= self.weight_memory * unit
