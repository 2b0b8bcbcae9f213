"""An order scored: what the search (`labkit.theory.search`), its polish (`polish`) and the exact
model (`exact`) all measure a candidate order by: its replayed timeline, its memory peak, the
closed-form lower bound, held in a `SearchResult`. It sits below all three so that none of them
imports another to judge an order. Taught in notebook 13.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.actions import Timeline
from ..schedules.orders import PlannedAction, normalize_order, order_csv
from .cost import Cost
from .simulate import memory_peak, simulate_order


@dataclass
class SearchResult:
    """A searched order and what its simulation says."""

    order: dict[int, list[PlannedAction]]
    timeline: Timeline = field(repr=False)
    makespan: float
    bubble: float                 # idle share of ranks x makespan (bubble_fraction)
    peak: dict[int, float]        # per rank (= stage with one stage per rank), the most memory held at once,
                                  # in 1F1B stage microbatches, counted with weight_memory
    lower_bound: float            # no order's makespan is shorter (closed form)
    period: float                 # the longest rank's span (first start to last end): a step's time once
                                  # steps overlap (zero-bubble's steady state, optimizer step post-validated)
    memory_limit: float
    rule: str                     # which variant of the rule (or seed, or solver) gave it
    weight_memory: float = 1.0
    stages_per_rank: int = 1
    objective: str = "period"
    bound: float | None = None    # proven lower bound on the objective (the solver's, else the closed form)
    solver: dict | None = None    # what the exact model did (status, time, seed objective), if it ran

    @property
    def value(self) -> float:
        """The objective's value: the period or the makespan."""
        return self.period if self.objective == "period" else self.makespan

    @property
    def gap(self) -> float:
        """How far above the proven bound: value / bound - 1 (0 is provably optimal)."""
        b = self.bound if self.bound is not None else self.lower_bound
        return max(0.0, self.value / b - 1) if b > 0 else 0.0

    def csv(self) -> str:
        return order_csv(self.order)

    def to_json(self) -> dict:
        return {"makespan": self.makespan, "bubble": self.bubble, "period": self.period,
                "objective": self.objective, "value": self.value, "bound": self.bound, "gap": self.gap,
                "peak": {str(s): round(v, 6) for s, v in self.peak.items()},
                "lower_bound": self.lower_bound, "memory_limit": self.memory_limit,
                "weight_memory": self.weight_memory, "stages_per_rank": self.stages_per_rank,
                "rule": self.rule, "solver": self.solver,
                "order": {str(r): [f"{s}{k}{mb}" for k, s, mb in acts] for r, acts in self.order.items()}}

def _hops(pp_size: int, stages_per_rank: int) -> int:
    """Sends between consecutive stages (V: stages P-1 and P share a rank)."""
    return pp_size - 1 if stages_per_rank == 1 else 2 * (pp_size - 1)


def lower_bound(pp_size: int, n_microbatches: int, cost: Cost, stages_per_rank: int = 1) -> float:
    """No order of P ranks and M microbatches finishes one step sooner: rank P-1 has M(F+I+W) per stage
    to compute and cannot start before microbatch 0's forward has crossed the P-1 stages before it;
    nor can any order beat microbatch 0's own chain (every F, every I, a W, the sends)."""
    f, i, w, c = cost.F, cost.input_grad, cost.weight_grad, cost.p2p
    busy = stages_per_rank * n_microbatches * (f + i + w)
    last_rank = (pp_size - 1) * (f + c) + busy
    one_chain = pp_size * stages_per_rank * (f + i) + w + 2 * _hops(pp_size, stages_per_rank) * c
    return max(last_rank, one_chain)


def rank_spans(timeline: Timeline) -> dict[int, float]:
    """Per rank, its last action's end minus its first action's start."""
    spans: dict[int, tuple[float, float]] = {}
    for a in timeline.compute():
        lo, hi = spans.get(a.rank, (a.start, a.end))
        spans[a.rank] = (min(lo, a.start), max(hi, a.end))
    return {r: hi - lo for r, (lo, hi) in sorted(spans.items())}


def evaluate(order, pp_size: int, n_microbatches: int, cost: Cost, memory_limit: float, rule: str, *,
             weight_memory: float = 1.0, stages_per_rank: int = 1, objective: str = "period",
             not_before: dict | None = None) -> SearchResult:
    """Replay an order (each action as early as its rank and inputs allow, and not before
    `not_before[action]` if given: the solver's own placement) and measure it as `search` does."""
    tl = simulate_order(order, pp_size * stages_per_rank, n_microbatches, cost, not_before=not_before,
                        meta={"schedule": f"searched (K={memory_limit:g})", "stages_per_rank": stages_per_rank})
    metrics = tl.metrics()
    return SearchResult(normalize_order(order), tl, metrics["makespan"], metrics["bubble_fraction"],
                        memory_peak(order, weight_memory, stages_per_rank),
                        lower_bound(pp_size, n_microbatches, cost, stages_per_rank),
                        max(rank_spans(tl).values()), memory_limit, rule, weight_memory, stages_per_rank, objective)
