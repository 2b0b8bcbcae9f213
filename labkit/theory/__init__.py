"""Ideal pipeline schedules: what each torch schedule plans, and what it would do on perfect hardware.

plans.py (the per-rank order torch plans), cost.py (the cost model, closed forms, fitting costs to a
run), simulate.py (replaying an order: ideal timelines and deadlocks), search.py (an order searched
under a memory limit, zero-bubble style), paper.py (the zero-bubble paper's tables, recomputed), microbatches.py (a cost per action fitted from steps
at several microbatch counts, and the ideal step it gives). Orders themselves, how they
are written and checked, are `labkit.schedules.orders`. Taught in notebooks 03, 04-06, 08 and 13.

May import: labkit.core, labkit.schedules.
"""

from ..schedules.orders import ScheduleError, check_order
from .cost import Cost, StageCosts, closed_form_bubble, fit_cost, fit_stage_costs
from .plans import planned_actions
from .search import SearchResult, search
from .simulate import ScheduleDeadlock, simulate, simulate_order, theory_json

__all__ = [
    "Cost",
    "ScheduleError",
    "ScheduleDeadlock",
    "planned_actions",
    "check_order",
    "simulate",
    "simulate_order",
    "closed_form_bubble",
    "fit_cost",
    "fit_stage_costs",
    "StageCosts",
    "theory_json",
    "search",
    "SearchResult",
]

from ..core import submodules as _submodules

__getattr__ = _submodules(__name__)  # labkit.theory.<module> after `import labkit`
