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
before I, how many extra forwards in the warm-up) are all tried. Like the paper, which seeds its ILP
with its heuristic, the search also starts from handcrafted orders (`handcrafted`): the paper's
ZB-H1 and ZB-H2 (its Figure 3) and 1F1B with I and W back to back, each kept only if it is valid
(`check_order`) and fits the limit (ZB-H1 and 1F1B hold p microbatches, ZB-H2 2p - 1). Every
candidate is replayed by `labkit.theory.simulate_order` (the same simulator the ideal timelines use)
and ranked by (period, makespan): the paper's own measure first, the longest rank's span (a step's
time once steps overlap, what its bubble rate divides by), then the one-step makespan. Its result is
compared with two lower bounds that hold for any order: no idle time at all, M(F+I+W), and one
microbatch's whole forward and backward chain through the pipeline.

What it guarantees: every dependency holds and no stage ever holds more than `memory_limit`
microbatches (checked on the result); its period is never longer than that of any seed that fits,
so at any costs its bubble rate (the paper's) is at most ZB-H1's once K >= P and at most ZB-H2's
once K >= 2P - 1 (tests/test_search.py checks this at the paper's settings). With F=I=W, no
communication and M >= 2P - 1, ZB-H2's period is M(F+I+W) (the paper's Table 2: bubble
(P-1)(F+I-2W) = 0), the least any order can have, so there the search's is too (P=4, M=8, unit
costs, K=2P: period 24, and makespan 27, the lower bound; tested). What it does not: the order is
not proven optimal (no ILP here), and the makespan, ranked second, may exceed a seed's when a
shorter period is found (at P=4, M=8, unit costs, K=P it meets ZB-H1's M(F+I+W)+(P-1)(F+I-W) = 27,
tested); `SearchResult.gap` says how far the makespan is from the lower bound. The order runs on
torch's runtime as a CSV (`labkit.orders.order_csv`, torch's `_PipelineScheduleRuntime._load_csv`
format), which adds the sends and receives itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, product

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


def handcrafted(kind: str, pp_size: int, n_microbatches: int) -> dict[int, list[PlannedAction]]:
    """A handcrafted order, one stage per rank: the zero-bubble paper's ZB-H1 or ZB-H2 (its Figure 3,
    arXiv 2401.10241), or "1F1B" (torch's 1F1B with each backward split into I and W back to back).

    Stage s warms up with `warm` forwards, then repeats: I of the next microbatch, the W of the one
    `defer` microbatches behind it, the next F; the W still owed come last. 1F1B: warm p - s, defer 0.
    ZB-H1 (1F1B's memory: p microbatches held on stage 0): warm p - s, defer s. ZB-H2 (2p - 1 held):
    warm 2(p - s) - 1, defer 2s. Read off Figure 3 for p=4, m=8 and written for any p and m. `search`
    starts from these (its seeds), as the paper seeds its ILP with its heuristic. Taught in notebook 13.
    """
    if kind not in HANDCRAFTED:
        raise ValueError(f"handcrafted knows {', '.join(map(repr, HANDCRAFTED))} (the paper's Figure 3, and 1F1B "
                         f"with I and W back to back), got {kind!r}.")
    order = {}
    for s in range(pp_size):
        warm, defer = {"1F1B": (pp_size - s, 0), "ZB-H1": (pp_size - s, s),
                       "ZB-H2": (2 * (pp_size - s) - 1, 2 * s)}[kind]
        acts: list[PlannedAction] = [("F", s, j) for j in range(min(warm, n_microbatches))]
        next_f, next_w = len(acts), 0
        for j in range(n_microbatches):
            acts.append(("I", s, j))
            if j - defer >= 0:
                acts.append(("W", s, next_w))
                next_w += 1
            if next_f < n_microbatches:
                acts.append(("F", s, next_f))
                next_f += 1
        acts += [("W", s, k) for k in range(next_w, n_microbatches)]
        order[s] = acts
    return order


HANDCRAFTED = ("1F1B", "ZB-H1", "ZB-H2")
"""The orders `handcrafted` writes, and `search`'s seeds."""

SEED_RULES = {"1F1B": "seed: 1F1B, I and W back to back",
              "ZB-H1": "seed: ZB-H1 (arXiv 2401.10241 Fig. 3)",
              "ZB-H2": "seed: ZB-H2 (arXiv 2401.10241 Fig. 3)"}


def search(pp_size: int, n_microbatches: int, cost: Cost | str, memory_limit: int,
           stages_per_rank: int = 1) -> SearchResult:
    """The best order found for `pp_size` stages (one per rank) and `n_microbatches`, holding at most
    `memory_limit` microbatches' activations on any stage: the handcrafted seeds that fit and every
    variant of the rule, ranked by (period, makespan). Taught in notebook 13."""
    if isinstance(cost, str):
        cost = Cost.parse(cost)
    _validate(pp_size, n_microbatches, memory_limit, stages_per_rank)
    best: SearchResult | None = None
    best_key = None
    bound = lower_bound(pp_size, n_microbatches, cost)
    seen: set = set()
    seeds = ((handcrafted(kind, pp_size, n_microbatches), SEED_RULES[kind]) for kind in HANDCRAFTED)
    variants = ((_list_schedule(pp_size, n_microbatches, cost, memory_limit, max_deferred, f_before_i, extra),
                 f"warm-up P-s+{extra} F; defer at most {max_deferred} W; {'F' if f_before_i else 'I'} first")
                for extra, max_deferred, f_before_i in product(range(0, memory_limit + 1),
                                                               range(0, n_microbatches + 1), (False, True)))
    for order, rule in chain(seeds, variants):
        key_order = tuple(tuple(acts) for acts in order.values()) if order is not None else None
        if order is None or key_order in seen:
            continue  # stuck, or an order a seed or another variant of the rule already gave
        seen.add(key_order)
        if check_order(order, pp_size, n_microbatches):  # every action once, W after its I
            assert rule.startswith("seed:"), rule  # the rule's own orders always pass
            continue
        peak = peak_in_flight(order)
        if max(peak.values()) > memory_limit:
            continue  # a seed that needs more memory than allowed (ZB-H1 and 1F1B hold p, ZB-H2 2p - 1)
        tl = simulate_order(order, pp_size, n_microbatches, cost,
                            meta={"schedule": f"searched (K={memory_limit})", "stages_per_rank": 1})
        metrics = tl.metrics()
        result = SearchResult(order, tl, metrics["makespan"], metrics["bubble_fraction"], peak, bound,
                              max(rank_spans(tl).values()), memory_limit, rule)
        # The paper's measure first: the longest rank's span is a step's time once steps overlap, and
        # its bubble rate; ties go to the shorter single step. Seeds come first, so a rule variant
        # replaces a seed only when strictly better.
        key = (round(result.period, 9), round(result.makespan, 9))
        if best is None or key < best_key:
            best, best_key = result, key
    if best is None:
        raise ConfigError(f"No order found for pp_size={pp_size}, n_microbatches={n_microbatches}, "
                          f"memory_limit={memory_limit}.")
    return best
