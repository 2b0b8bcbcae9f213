"""Ideal pipeline schedules: what each torch schedule plans, and what it would do on perfect hardware.

plans.py (the per-rank order torch plans), cost.py (the cost model, closed forms, fitting costs to a
run), simulate.py (replaying an order: ideal timelines and deadlocks), search.py (an order searched
under a memory limit, zero-bubble style), frontier.py (step time against peak memory), paper.py (the
zero-bubble paper's tables, recomputed), microbatches.py (a cost per action fitted from steps at
several microbatch counts, and the ideal step it gives). Orders themselves, how they are written and
checked, are `labkit.schedules.orders`. Taught in notebooks 03, 04-06, 08 and 13; the names a lesson
imports are below (README, "The lesson API").

May import: labkit.core, labkit.versions (torch's planning stages), labkit.schedules.
"""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__, {
    "..schedules.orders": ("ScheduleError", "check_order", "parse_action"),
    "..schedules.table": ("layer_bounds", "stage_placement"),
    ".plans": ("mock_schedule", "planned_actions"),
    ".simulate": ("ScheduleDeadlock", "simulate", "simulate_order", "theory_json"),
    ".cost": ("Cost", "StageCosts", "closed_form_bubble", "fit_cost", "fit_stage_costs"),
    ".microbatches": ("action_durations", "fit_microbatch_costs", "ideal_step_times"),
    ".search": ("SearchResult", "lower_bound", "rank_spans", "search", "zb_h1_makespan"),
    ".frontier": ("best_at", "fit_per_action", "frontier", "stage_cost", "v_claims"),
    ".": ("paper",),
})
