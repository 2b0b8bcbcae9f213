"""Searching a schedule: a compute-only order under a memory limit, from measured F, I, W costs.

The zero-bubble authors (arXiv 2401.10241) split a backward into I (the input gradient, on the
critical path) and W (the weight gradient, free to move) and schedule W into the bubbles, as long as
memory allows. `search` builds such an order in two passes, as the paper does (its heuristic, then
its ILP):

1. **List scheduling** (fast, the seed; `labkit.theory.listing`). Whenever a rank is free it runs, in this order of
   preference: an I whose gradient has arrived (it unblocks the previous stage), an F whose input
   has arrived if memory allows, a deferred W (it fills time the rank would otherwise idle, and
   frees memory); otherwise it waits for the next arrival. Variants of the rule (how many W a rank
   may defer, F before I, how many extra forwards in the warm-up) are all tried, beside handcrafted
   orders: the paper's ZB-H1 and ZB-H2 (its Figure 3), 1F1B with I and W back to back and the
   zero-bubble authors' own heuristic (`labkit.theory.zbheuristic`, W only into bubbles, the rest
   last), or with two stages per rank torch's ZBVZeroBubble, DualPipeV and V-Half / V-Min
   (`labkit.theory.vgreedy`); each kept if it fits. For the period, the best is then polished
   (`labkit.theory.polish`: a forward or a W pulled into a wait; this took Table 5's ZB-2p below print).
2. **An exact model** (`labkit.theory.exact`, OR-Tools CP-SAT, optional: `pip install labkit[search]`)
   with `time_limit > 0`: interval variables per action, dependencies with the link's latency, one
   action at a time per rank, a cumulative memory limit per rank, warm-started from the best order of
   pass 1. Anytime: it stops at the time limit with the best order found and the solver's proven
   bound (`SearchResult.bound`; `gap` is how far the answer may still be from optimal).

Memory is counted as the paper counts it (its Section 3.1 and ILP): a microbatch's F holds its
activations (1 unit per stage on one rank, 1/stages_per_rank with several stages per rank, so that the
limit is always in "1F1B stage microbatches": 1F1B holds `pp_size` on rank 0); its I frees the part W
does not need (1 - R), its W frees the rest (R). R is `weight_memory`: 1 (the default) holds everything
until W; the paper's models hold R = M_W / M_B = 32h / (34h + 5as) (`labkit.theory.paper.weight_memory`).

Objectives: "period" (the default, the paper's: the longest rank's span, first start to last end, a
step's time once steps overlap, what its bubble rate divides by; ties go to the shorter makespan) or
"makespan" (one isolated step). Their lower bounds hold for any order: no idle time at all, M(F+I+W)
per stage, one microbatch's whole chain through the pipeline, and for the period the memory bound
of `labkit.theory.bounds` (where an order meets it, it is optimal: the paper's ZB-H1 at 1F1B's memory).

What it guarantees: every dependency holds and no rank ever holds more than `memory_limit` (checked
on the result); its objective is never worse than any seed's that fits, so at any costs its bubble
rate (the paper's) is at most ZB-H1's once K >= P and ZB-H2's once K >= 2P - 1 (tests). The order runs
on torch's runtime as a CSV (`labkit.schedules.orders.order_csv`, torch's `_PipelineScheduleRuntime._load_csv`
format), which adds the sends and receives itself. Taught in notebook 13.
"""

from __future__ import annotations

import math
from itertools import chain, product

from ..core.errors import ConfigError
from ..schedules.orders import PlannedAction, check_order
from .bounds import period_bound  # re-exported
from .cost import Cost
from .listing import list_schedule, placement  # noqa: F401 (placement: search's name for it, kept)
from .polish import polish
from .score import SearchResult, evaluate, lower_bound, rank_spans  # noqa: F401 (re-exported)
from .simulate import memory_peak
from .vgreedy import v_orders
from .zbheuristic import best_order

OBJECTIVES = ("period", "makespan")



def zb_h1_makespan(pp_size: int, n_microbatches: int, cost: Cost) -> float:
    """Zero-bubble's ZB-H1 (1F1B's memory): M(F+I+W) + (P-1)(F+I-W), the floor `search` must meet at K=P."""
    f, i, w = cost.F, cost.input_grad, cost.weight_grad
    return n_microbatches * (f + i + w) + (pp_size - 1) * (f + i - w)


def _validate(pp_size: int, n_microbatches: int, memory_limit: float, stages_per_rank: int,
              weight_memory: float, objective: str) -> None:
    if stages_per_rank not in (1, 2):
        raise ConfigError(f"search plans one stage per rank, or two in torch's V placement (rank r holds stages r "
                          f"and 2P-1-r, as ZBVZeroBubble); got --stages-per-rank {stages_per_rank}: use 1 or 2.")
    if pp_size < 1 or n_microbatches < 1:
        raise ConfigError(f"pp_size and n_microbatches must be >= 1, got {pp_size} and {n_microbatches}.")
    if not 0 <= weight_memory <= 1:
        raise ConfigError(f"--weight-memory is the fraction of a microbatch's activations still held from I until "
                          f"W, between 0 and 1; got {weight_memory}. 1 holds everything until W (the default).")
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}.")
    unit = 1 / stages_per_rank
    if memory_limit < unit:
        raise ConfigError(f"--memory-limit must hold at least one microbatch of a stage ({unit:g} in 1F1B stage "
                          f"microbatches with {stages_per_rank} stage(s) per rank), got {memory_limit}. 1F1B holds up "
                          f"to pp_size ({pp_size}) on rank 0; try --memory-limit {pp_size}.")


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
"""The orders `handcrafted` writes, and `search`'s seeds with one stage per rank."""

V_SEEDS = ("ZBVZeroBubble", "DualPipeV")
"""torch's V-shaped schedules: `search`'s seeds with two stages per rank (their planned orders)."""

SEED_RULES = {"1F1B": "seed: 1F1B, I and W back to back",
              "ZB-H1": "seed: ZB-H1 (arXiv 2401.10241 Fig. 3)",
              "ZB-H2": "seed: ZB-H2 (arXiv 2401.10241 Fig. 3)",
              "ZBVZeroBubble": "seed: torch's ZBVZeroBubble",
              "DualPipeV": "seed: torch's DualPipeV"}


def _seeds(pp_size: int, m: int, spr: int, cost: Cost, limit: float, weight_memory: float):
    if spr == 1:
        for kind in HANDCRAFTED:
            yield handcrafted(kind, pp_size, m), SEED_RULES[kind]
        yield from filter(None, [best_order(pp_size, m, cost, limit, weight_memory)])
        return
    from .plans import planned_actions

    for kind in V_SEEDS:
        try:
            order = planned_actions(kind, pp_size, m, 2)
        except Exception:  # torch refuses these sizes (DualPipeV needs M >= 2P), or an older torch
            continue
        if all(k in ("F", "I", "W") for acts in order.values() for k, _, _ in acts):
            yield order, SEED_RULES[kind]
    yield from v_orders(pp_size, m)  # V-Half, V-Min (arXiv 2405.15362): 1/2 and 1/3 of 1F1B's memory as P grows


def _variants(pp_size: int, m: int, limit: float, spr: int):
    """The rule's parameters: extra warm-up forwards and W deferrals 0-4, then doubling up to what the
    memory (and M) allows; F or I first."""
    def steps(top):
        return sorted({v for v in range(min(top, 4) + 1)} | {2 ** k for k in range(3, 12) if 2 ** k < top} | {top})

    return product(steps(int(math.ceil(limit * spr))), steps(m * spr), (False, True))


def _key(r: SearchResult) -> tuple:
    first, second = (r.period, r.makespan) if r.objective == "period" else (r.makespan, r.period)
    return (round(first, 9), round(second, 9))


def search(pp_size: int, n_microbatches: int, cost: Cost | str, memory_limit: float,
           stages_per_rank: int = 1, *, weight_memory: float = 1.0, objective: str = "period",
           time_limit: float = 0.0, workers: int = 1, progress: bool = False, variants: bool = True) -> SearchResult:
    """The best order found for `pp_size` ranks (one stage each, or two in V placement) and
    `n_microbatches`, holding at most `memory_limit` (1F1B stage microbatches, `weight_memory` the share
    held from I until W) on any rank: the seeds that fit and every variant of the rule, ranked by the
    objective ("period" or "makespan"; variants=False: the seeds alone, for large P x M), then, with
    `time_limit` > 0 seconds, the exact model (`labkit.theory.exact`, needs OR-Tools) warm-started from
    that. Taught in notebook 13."""
    if isinstance(cost, str):
        cost = Cost.parse(cost)
    _validate(pp_size, n_microbatches, memory_limit, stages_per_rank, weight_memory, objective)
    m, spr = n_microbatches, stages_per_rank
    best: SearchResult | None = None
    seen: set = set()
    seeds_that_fit = []
    rule_orders = ((list_schedule(pp_size, spr, m, cost, memory_limit, weight_memory, d, fi, extra),
                 f"warm-up +{extra} F; defer at most {d} W; {'F' if fi else 'I'} first")
                for extra, d, fi in (_variants(pp_size, m, memory_limit, spr) if variants else ()))
    for order, rule in chain(_seeds(pp_size, m, spr, cost, memory_limit, weight_memory), rule_orders):
        key_order = tuple(tuple(acts) for acts in order.values()) if order is not None else None
        if order is None or key_order in seen:
            continue  # stuck, or an order a seed or another variant of the rule already gave
        seen.add(key_order)
        if check_order(order, pp_size * spr, m):  # every action once, W after its I
            assert rule.startswith("seed:"), rule  # the rule's own orders always pass
            continue
        if max(memory_peak(order, weight_memory, spr).values()) > memory_limit + 1e-9:
            continue  # a seed that needs more memory than allowed (ZB-H1 and 1F1B hold p, ZB-H2 2p - 1)
        result = evaluate(order, pp_size, m, cost, memory_limit, rule, weight_memory=weight_memory,
                          stages_per_rank=spr, objective=objective)
        if rule.startswith("seed:"):
            seeds_that_fit.append(result)
        # Seeds come first, so a rule variant replaces a seed only when strictly better.
        if best is None or _key(result) < _key(best):
            best = result
    if best is None:
        raise ConfigError(f"No order found for pp_size={pp_size}, n_microbatches={m}, memory_limit={memory_limit}: "
                          f"raise --memory-limit (1F1B holds {pp_size}).")
    best.bound = (period_bound(pp_size, m, cost, spr, memory_limit, weight_memory) if objective == "period"
                  else lower_bound(pp_size, m, cost, spr))
    if objective == "period" and best.value > best.bound * (1 + 1e-12):  # pull work into waits (polish.py)
        best = polish(best, pp_size, m, cost, seconds=max(10.0, time_limit))
    if time_limit > 0:
        from .exact import improve

        best = improve(best, pp_size, m, cost, time_limit=time_limit, workers=workers, progress=progress,
                       hints=seeds_that_fit)
    return best
