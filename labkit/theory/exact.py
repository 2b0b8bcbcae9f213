"""The exact schedule model: OR-Tools CP-SAT, warm-started from `labkit.theory.search`'s best order.

The zero-bubble paper (arXiv 2401.10241, Section 3) finishes its heuristic with an ILP; this is the
kit's version, with CP-SAT (the `search` extra: `pip install "labkit[search]"`). One interval per
action (F, I, W of every stage and microbatch, its duration from `Cost`), and:

- dependencies: F after the previous stage's F, I after its own F and the next stage's I, W after its
  I, each + `Cost.p2p` when the two stages live on different ranks;
- one action at a time per rank (no overlap);
- memory: per rank, a cumulative limit: a microbatch's F holds 1/stages_per_rank of a 1F1B stage
  microbatch until its I (the share W does not need, 1 - R) and until its W (the share R), as
  `search.memory_peak` counts it;
- microbatches keep their order per stage and kind (F of j before F of j + 1, and so for I and W), as
  the paper's ILP does: microbatches are interchangeable, so this only removes mirror images.

Objectives: "makespan" (one step, everything starts at 0 or later) or "period" (the paper's: the
longest rank's span, first start to last end; a rank may wait before its first action on purpose,
which is why the solver's placement is kept as the order's `not_before` times). Times are integers:
costs are scaled by the smallest of 1, 2, 4, 5, 10, ..., 1000 that makes them whole (Table 9's have
three decimals); where none does they are rounded and the solver's bound is not reported.

Anytime: the solver stops at `time_limit` seconds with the best order found, never worse than its
hint (the answer is re-measured and the seed kept if the solver did not beat it), and its proven
bound on the objective. The closed-form bound (`labkit.theory.bounds`) is a constraint on the
objective, and a seed that already meets it is returned at once as optimal (the paper's ZB-H1 at
1F1B's memory). For the period the solver interleaves its whole portfolio (large neighbourhood
search included) on its threads, so one worker is not one tree search. Taught in notebook 13.
"""

from __future__ import annotations

import math
import time

from ..core.errors import ConfigError
from .cost import Cost
from .score import SearchResult, evaluate
from .search import placement

SCALES = (1, 2, 4, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000)


NEEDS_ORTOOLS = ("the exact model (CP-SAT) needs OR-Tools, the kit's `search` extra (labkit[search]): in the lab's "
                 "folder, pip install -e '.[search]' (or pip install ortools)")
"""What to install, said by every caller that needs CP-SAT (`improve`, `labkit.theory.frontier.v_claims`)."""


def available() -> bool:
    """True when OR-Tools (CP-SAT) is installed."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def _scale(values) -> tuple[int, bool]:
    """The smallest scale that makes every value whole, and whether one did (else 1000, rounded)."""
    for s in SCALES:
        if all(abs(v * s - round(v * s)) < 1e-6 for v in values):
            return s, True
    return SCALES[-1], False


def improve(seed: SearchResult, pp_size: int, n_microbatches: int, cost: Cost, *, time_limit: float,
            workers: int = 1, progress: bool = False, hints=()) -> SearchResult:
    """The best of `seed` and what CP-SAT finds within `time_limit` seconds, hinted with `seed`'s
    placement; `bound` and `solver` filled in. `hints`: other orders (the handcrafted seeds) whose
    objective is a further upper bound. Raises ConfigError when OR-Tools is missing."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise ConfigError(f"{NEEDS_ORTOOLS}; or leave --time-limit (time_limit=) at 0 for the list scheduler "
                          f"alone.") from None
    spr, m, R = seed.stages_per_rank, n_microbatches, seed.weight_memory
    if seed.bound and seed.value <= seed.bound * (1 + 1e-12):  # the seed meets a proven bound: optimal already
        seed.solver = {"status": "OPTIMAL", "seconds": 0.0, "seed": seed.rule, "seed_value": seed.value,
                       "proof": "closed-form bound (labkit.theory.bounds)", "time_limit": time_limit}
        return seed
    n = pp_size * spr
    stages = placement(pp_size, spr)
    rank_of = {s: r for r, ss in enumerate(stages) for s in ss}
    f, i, w, c = cost.F, cost.input_grad, cost.weight_grad, cost.p2p
    S, exact = _scale([f, i, w, c])
    dur = {"F": round(f * S), "I": round(i * S), "W": round(w * S)}
    lat = round(c * S)
    model = cp_model.CpModel()
    horizon = int(math.ceil(S * (seed.makespan + seed.period))) + 1
    start, end, iv = {}, {}, {}
    for s in range(n):
        for j in range(m):
            for k in "FIW":
                a = (k, s, j)
                start[a] = model.new_int_var(0, horizon, f"s{k}{s}_{j}")
                end[a] = start[a] + dur[k]
                iv[a] = model.new_fixed_size_interval_var(start[a], dur[k], f"i{k}{s}_{j}")
    for s in range(n):
        for j in range(m):
            def after(a, b, hop):  # a starts after b ends (+ the link if the stages are on different ranks)
                model.add(start[a] >= end[b] + (lat if hop and rank_of[a[1]] != rank_of[b[1]] else 0))
            if s > 0:
                after(("F", s, j), ("F", s - 1, j), True)
            after(("I", s, j), ("F", s, j), False)
            if s < n - 1:
                after(("I", s, j), ("I", s + 1, j), True)
            after(("W", s, j), ("I", s, j), False)
            if j > 0:
                for k in "FIW":
                    after((k, s, j), (k, s, j - 1), False)
    Q = 10 ** 6  # a stage microbatch's activations, in integer units (R to six digits; the answer is re-checked)
    q_w = round(Q * R)
    q_i = Q - q_w
    capacity = int(math.floor(Q * seed.memory_limit * spr + 1e-6))
    sizes = []
    for r, ss in enumerate(stages):
        model.add_no_overlap([iv[(k, s, j)] for s in ss for j in range(m) for k in "FIW"])
        held, demand = [], []
        for s in ss:
            for j in range(m):
                for k, q in (("I", q_i), ("W", q_w)):
                    if q <= 0:
                        continue
                    size = model.new_int_var(0, horizon, f"h{k}{s}_{j}")
                    sizes.append((size, ("F", s, j), (k, s, j)))
                    held.append(model.new_interval_var(start[("F", s, j)], size, end[(k, s, j)], f"m{k}{s}_{j}"))
                    demand.append(q)
        if held:
            model.add_cumulative(held, demand, capacity)
    last = {r: [end[("W", s, m - 1)] for s in ss] for r, ss in enumerate(stages)}
    first = {r: start[("F", min(ss), 0)] for r, ss in enumerate(stages)}
    obj = model.new_int_var(0, horizon, "objective")
    if seed.objective == "period":
        for r in last:
            for e in last[r]:
                model.add(obj >= e - first[r])
    else:
        model.add(start[("F", 0, 0)] == 0)
        for r in last:
            for e in last[r]:
                model.add(obj >= e)
    if exact and seed.bound:
        model.add(obj >= int(math.floor(seed.bound * S + 1e-6)))  # the closed-form bound: lets it prove optimality
    model.minimize(obj)
    seed_times = {(a.kind, a.stage, a.microbatch): a.start for a in seed.timeline.compute()}
    hint = {a: int(round(seed_times[a] * S)) for a in start}
    for a, var in start.items():
        model.add_hint(var, hint[a])
    for size, a, b in sizes:
        model.add_hint(size, hint[b] + dur[b[0]] - hint[a])
    spans = [hint[("W", s, m - 1)] + dur["W"] - (hint[("F", min(ss), 0)] if seed.objective == "period" else 0)
             for ss in stages for s in ss]
    model.add_hint(obj, max(spans))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = max(1, int(workers))
    # the period: its whole portfolio (large neighbourhood search included) even on one thread; one
    # worker alone runs a single tree search, which did not improve Table 5's 1.5B m=32 ZB-2p in 30 s
    solver.parameters.interleave_search = seed.objective == "period"
    t0 = time.monotonic()
    from ..core.progress import Progress

    bar = Progress(f"CP-SAT {seed.objective}", total=int(math.ceil(time_limit)), enabled=progress)
    state = {"best": seed.value, "bound": seed.bound or 0.0}

    def show():
        bar.state.status = f"best {state['best']:.6g} bound {state['bound']:.6g}"
        bar.update(int(time.monotonic() - t0))

    class _Callback(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self):
            state["best"] = min(state["best"], self.objective_value / S)
            state["bound"] = max(state["bound"], self.best_objective_bound / S)
            show()

    def on_bound(b):
        state["bound"] = max(state["bound"], b / S)
        show()

    try:
        solver.best_bound_callback = on_bound
    except AttributeError:  # older OR-Tools
        pass
    status = solver.solve(model, _Callback())
    bar.close("done")
    elapsed = time.monotonic() - t0
    info = {"status": solver.status_name(status), "seconds": round(elapsed, 2), "scale": S, "exact_costs": exact,
            "seed": seed.rule, "seed_value": seed.value, "workers": solver.parameters.num_workers,
            "time_limit": time_limit}
    best = seed
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        at = {a: solver.value(v) / S for a, v in start.items()}
        order = {r: sorted(((k, s, j) for s in ss for j in range(m) for k in "FIW"), key=lambda a: (at[a], a[1]))
                 for r, ss in enumerate(stages)}
        found = evaluate(order, pp_size, m, cost, seed.memory_limit, "exact: CP-SAT", weight_memory=R,
                         stages_per_rank=spr, objective=seed.objective,
                         not_before=at if seed.objective == "period" else None)
        info["solver_value"] = solver.objective_value / S
        if found.value < seed.value - 1e-9 and max(found.peak.values()) <= seed.memory_limit + 1e-9:
            best = found
    bound = seed.bound or 0.0
    if exact and status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        bound = max(bound, solver.best_objective_bound / S)
    best.bound = bound
    best.solver = info
    return best
