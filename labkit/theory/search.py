"""Searching a schedule: a compute-only order under a memory limit, from measured F, I, W costs.

The zero-bubble authors (arXiv 2401.10241) split a backward into I (the input gradient, on the
critical path) and W (the weight gradient, free to move) and schedule W into the bubbles, as long as
memory allows: a microbatch's activations stay on a stage from its F until its W. `search` builds
such an order by list scheduling, one stage per rank: whenever a rank is free it runs, in this order
of preference,

1. an I whose gradient has arrived (it unblocks the previous stage),
2. an F whose input has arrived, if the stage holds fewer than `memory_limit` microbatches,
3. a deferred W (it fills time the rank would otherwise idle, and frees memory),

and otherwise waits for the next arrival. Variants of the rule (how many W a rank may defer, F
before I) are all tried and the order with the shortest simulated makespan is kept, checked and
replayed by `labkit.theory.simulate_order` (the same simulator the ideal timelines use). Its
result is compared with two lower bounds that hold for any order: no idle time at all,
M(F+I+W), and one microbatch's whole forward and backward chain through the pipeline.

What it guarantees, and what it does not: every dependency holds and no stage ever holds more than
`memory_limit` microbatches (checked on the result); the makespan is not proven optimal (no ILP
here): `SearchResult.gap` says how far it is from the lower bound. Tests hold it to zero-bubble's
results at P=4, M=8, F=I=W=1: at K=P it meets ZB-H1's M(F+I+W)+(P-1)(F+I-W), at K=2P it is within
5% of M(F+I+W). The order runs on torch's runtime as a CSV (`labkit.orders.order_csv`, torch's
`_PipelineScheduleRuntime._load_csv` format), which adds the sends and receives itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

from ..config import ConfigError
from ..orders import PlannedAction, check_order, order_csv, peak_in_flight
from ..timeline import Timeline
from .cost import Cost
from .simulate import simulate_order


@dataclass
class SearchResult:
    """A searched order and what its simulation says."""

    order: dict[int, list[PlannedAction]]
    timeline: Timeline = field(repr=False)
    makespan: float
    bubble: float                 # idle share of ranks x makespan (bubble_fraction)
    peak: dict[int, int]          # per stage, the most microbatches held at once
    lower_bound: float
    period: float                 # the longest rank's span (first start to last end): a step's time once
                                  # steps overlap (zero-bubble's steady state, optimizer step post-validated)
    memory_limit: int
    rule: str                     # which variant of the rule gave it

    @property
    def gap(self) -> float:
        """How far above the lower bound: makespan / lower_bound - 1 (0 is provably optimal)."""
        return self.makespan / self.lower_bound - 1 if self.lower_bound > 0 else 0.0

    def csv(self) -> str:
        return order_csv(self.order)

    def to_json(self) -> dict:
        return {"makespan": self.makespan, "bubble": self.bubble, "period": self.period, "peak": {str(s): v for s, v in self.peak.items()},
                "lower_bound": self.lower_bound, "gap": self.gap, "memory_limit": self.memory_limit,
                "rule": self.rule, "order": {str(r): [f"{s}{k}{mb}" for k, s, mb in acts]
                                             for r, acts in self.order.items()}}


def lower_bound(pp_size: int, n_microbatches: int, cost: Cost) -> float:
    """No order of P stages and M microbatches finishes one step sooner: the last stage has M(F+I+W)
    to compute and cannot start before microbatch 0's forward has crossed the P-1 stages before it;
    nor can any order beat microbatch 0's own chain (P forwards, P input-gradients, a W, the sends)."""
    f, i, w = cost.F, cost.input_grad, cost.weight_grad
    last_stage = (pp_size - 1) * (f + cost.p2p) + n_microbatches * (f + i + w)
    chain = pp_size * (f + i) + w + 2 * (pp_size - 1) * cost.p2p
    return max(last_stage, chain)


def rank_spans(timeline: Timeline) -> dict[int, float]:
    """Per rank, its last action's end minus its first action's start."""
    spans: dict[int, tuple[float, float]] = {}
    for a in timeline.compute():
        lo, hi = spans.get(a.rank, (a.start, a.end))
        spans[a.rank] = (min(lo, a.start), max(hi, a.end))
    return {r: hi - lo for r, (lo, hi) in sorted(spans.items())}


def zb_h1_makespan(pp_size: int, n_microbatches: int, cost: Cost) -> float:
    """Zero-bubble's ZB-H1 (1F1B's memory): M(F+I+W) + (P-1)(F+I-W), the floor `search` must meet at K=P."""
    f, i, w = cost.F, cost.input_grad, cost.weight_grad
    return n_microbatches * (f + i + w) + (pp_size - 1) * (f + i - w)


def _validate(pp_size: int, n_microbatches: int, memory_limit: int, stages_per_rank: int) -> None:
    if stages_per_rank != 1:
        raise ConfigError(f"search plans one stage per rank (stages_per_rank=1); got {stages_per_rank}. "
                          "Search a V-shaped or looped placement is not written yet: use --stages-per-rank 1.")
    if pp_size < 1 or n_microbatches < 1:
        raise ConfigError(f"pp_size and n_microbatches must be >= 1, got {pp_size} and {n_microbatches}.")
    if memory_limit < 1:
        raise ConfigError(f"--memory-limit must be >= 1 microbatch of activations per stage, got {memory_limit}. "
                          f"1F1B holds up to pp_size ({pp_size}) on stage 0; try --memory-limit {pp_size}.")


def _at(t: float | None) -> float:
    return float("inf") if t is None else t


def _list_schedule(pp_size: int, m: int, cost: Cost, limit: int, max_deferred: int,
                   f_before_i: bool, extra_warmup: int) -> dict[int, list[PlannedAction]] | None:
    """One pass of the rule; None if it gets stuck (it cannot with limit >= 1, but never loop forever)."""
    f, i, w, c = cost.F, cost.input_grad, cost.weight_grad, cost.p2p
    last = pp_size - 1
    end: dict[PlannedAction, float] = {}
    order: dict[int, list[PlannedAction]] = {r: [] for r in range(pp_size)}
    free = [0.0] * pp_size
    next_f = [0] * pp_size           # next microbatch to forward on each stage
    pending_i = [set() for _ in range(pp_size)]  # forwarded, input-gradient not yet computed
    pending_w = [[] for _ in range(pp_size)]     # I done, W not yet (FIFO)
    held = [0] * pp_size             # F done, W not done
    total = 3 * m * pp_size
    steps = 0

    def arrival(a: PlannedAction, rank: int) -> float | None:
        """When action `a`'s inputs are on `rank` (None: not scheduled yet)."""
        kind, s, mb = a
        deps = []
        if kind == "F" and s > 0:
            deps = [(("F", s - 1, mb), c)]
        elif kind == "I":
            deps = [(("F", s, mb), 0.0)] + ([(("I", s + 1, mb), c)] if s < last else [])
        elif kind == "W":
            deps = [(("I", s, mb), 0.0)]
        t = 0.0
        for d, lat in deps:
            if d not in end:
                return None
            t = max(t, end[d] + lat)
        return t

    def may_forward(r: int) -> bool:
        """Memory allows another F (held < limit), and so does the warm-up: at most P - r + extra
        microbatches forwarded and not yet back (1F1B's warm-up when extra is 0)."""
        return (next_f[r] < m and held[r] < limit
                and len(pending_i[r]) < min(limit, pp_size - r + extra_warmup))

    def candidates(r: int, t: float) -> list[tuple[int, PlannedAction]]:
        """What rank r may start at time t, with the rule's preference (lowest first)."""
        cands = []
        if len(pending_w[r]) > max_deferred:
            cands.append((0, ("W", r, pending_w[r][0])))
        ready_i = sorted(mb for mb in pending_i[r] if _at(arrival(("I", r, mb), r)) <= t)
        if ready_i:
            cands.append((1 if not f_before_i else 2, ("I", r, ready_i[0])))
        if may_forward(r) and _at(arrival(("F", r, next_f[r]), r)) <= t:
            cands.append((2 if not f_before_i else 1, ("F", r, next_f[r])))
        if pending_w[r]:
            cands.append((3, ("W", r, pending_w[r][0])))
        return cands

    def earliest(r: int) -> float:
        """The earliest time rank r can start something (inf: nothing it may run is scheduled yet)."""
        if pending_w[r]:
            return free[r]
        times = [arrival(("I", r, mb), r) for mb in pending_i[r]]
        if may_forward(r):
            times.append(arrival(("F", r, next_f[r]), r))
        known = [x for x in times if x is not None]
        return max(free[r], min(known)) if known else float("inf")

    while steps < total:
        r = min(range(pp_size), key=lambda k: (earliest(k), k))
        t = earliest(r)
        if t == float("inf"):
            return None  # every rank waits for something no rank will run
        cands = candidates(r, t)
        kind, s, mb = a = min(cands)[1]
        duration = {"F": f, "I": i, "W": w}[kind]
        end[a] = t + duration
        free[r] = end[a]
        order[r].append(a)
        steps += 1
        if kind == "F":
            next_f[r] += 1
            held[r] += 1
            pending_i[r].add(mb)
        elif kind == "I":
            pending_i[r].discard(mb)
            pending_w[r].append(mb)
        else:
            pending_w[r].pop(0)
            held[r] -= 1
    return order


def search(pp_size: int, n_microbatches: int, cost: Cost | str, memory_limit: int,
           stages_per_rank: int = 1) -> SearchResult:
    """The best order the rule finds for `pp_size` stages (one per rank) and `n_microbatches`, holding
    at most `memory_limit` microbatches' activations on any stage. Taught in notebook 08."""
    if isinstance(cost, str):
        cost = Cost.parse(cost)
    _validate(pp_size, n_microbatches, memory_limit, stages_per_rank)
    best: SearchResult | None = None
    bound = lower_bound(pp_size, n_microbatches, cost)
    seen: set = set()
    for extra, max_deferred, f_before_i in product(range(0, memory_limit + 1), range(0, n_microbatches + 1),
                                                   (False, True)):
        order = _list_schedule(pp_size, n_microbatches, cost, memory_limit, max_deferred, f_before_i, extra)
        key_order = tuple(tuple(acts) for acts in order.values()) if order is not None else None
        if order is None or key_order in seen:
            continue  # stuck, or an order another variant of the rule already gave
        seen.add(key_order)
        assert not check_order(order, pp_size, n_microbatches)  # every action once, W after its I
        tl = simulate_order(order, pp_size, n_microbatches, cost,
                            meta={"schedule": f"searched (K={memory_limit})", "stages_per_rank": 1})
        metrics = tl.metrics()
        peak = peak_in_flight(order)
        if max(peak.values()) > memory_limit:
            continue
        result = SearchResult(order, tl, metrics["makespan"], metrics["bubble_fraction"], peak, bound,
                              max(rank_spans(tl).values()), memory_limit, f"warm-up P-s+{extra} F; defer at most {max_deferred} W; {'F' if f_before_i else 'I'} first")
        key = (round(result.makespan, 9), round(result.period, 9))
        if best is None or key < (round(best.makespan, 9), round(best.period, 9)):
            best = result
    if best is None:
        raise ConfigError(f"No order found for pp_size={pp_size}, n_microbatches={n_microbatches}, "
                          f"memory_limit={memory_limit}.")
    return best
