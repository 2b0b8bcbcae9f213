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
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import ConfigError
from .cost import Cost
from .listing import placement
from .score import SearchResult, evaluate

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


@dataclass
class _Model:
    """The CP-SAT model of one search and what its steps share: integer times in units of 1/S."""

    cp: Any
    """The cp_model module (OR-Tools)."""
    model: Any
    """The cp_model.CpModel being built."""
    seed: SearchResult
    pp_size: int
    m: int
    cost: Cost
    S: int
    """The time scale: costs times S are whole (`_scale`)."""
    exact: bool
    """Whether S made every cost whole (else rounded: no bound is reported)."""
    dur: dict
    """{kind: duration} of F, I and W."""
    lat: int
    """The link's latency (Cost.p2p)."""
    horizon: int
    start: dict = field(default_factory=dict)
    end: dict = field(default_factory=dict)
    iv: dict = field(default_factory=dict)
    sizes: list = field(default_factory=list)
    """[(size variable, the F that allocates, the I or W that frees)] of every memory interval."""
    obj: Any = None

    @property
    def stages(self) -> list[list[int]]:
        return placement(self.pp_size, self.seed.stages_per_rank)

    def actions(self, ss):
        """(kind, stage, microbatch) of every action of the stages `ss`, in the model's order."""
        return [(k, s, j) for s in ss for j in range(self.m) for k in "FIW"]


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
    if seed.bound and seed.value <= seed.bound * (1 + 1e-12):  # the seed meets a proven bound: optimal already
        seed.solver = {"status": "OPTIMAL", "seconds": 0.0, "seed": seed.rule, "seed_value": seed.value,
                       "proof": "closed-form bound (labkit.theory.bounds)", "time_limit": time_limit}
        return seed
    mo = _new_model(cp_model, seed, pp_size, n_microbatches, cost)
    _add_actions(mo)
    _add_dependencies(mo)
    _add_ranks(mo)
    _add_objective(mo)
    _add_hints(mo)
    solver, status, elapsed = _solve(mo, time_limit, workers, progress)
    return _best(mo, solver, status, elapsed, time_limit)


def _new_model(cp_model, seed: SearchResult, pp_size: int, m: int, cost: Cost) -> _Model:
    f, i, w, c = cost.F, cost.input_grad, cost.weight_grad, cost.p2p
    S, exact = _scale([f, i, w, c])
    dur = {"F": round(f * S), "I": round(i * S), "W": round(w * S)}
    horizon = int(math.ceil(S * (seed.makespan + seed.period))) + 1
    return _Model(cp_model, cp_model.CpModel(), seed, pp_size, m, cost, S, exact, dur, round(c * S), horizon)


def _add_actions(mo: _Model) -> None:
    """One fixed-size interval per action (F, I, W of every stage and microbatch)."""
    for s in range(mo.pp_size * mo.seed.stages_per_rank):
        for j in range(mo.m):
            for k in "FIW":
                a = (k, s, j)
                mo.start[a] = mo.model.new_int_var(0, mo.horizon, f"s{k}{s}_{j}")
                mo.end[a] = mo.start[a] + mo.dur[k]
                mo.iv[a] = mo.model.new_fixed_size_interval_var(mo.start[a], mo.dur[k], f"i{k}{s}_{j}")


def _add_dependencies(mo: _Model) -> None:
    """F after the previous stage's F, I after its F and the next stage's I, W after its I (+ the link
    between ranks); and per stage and kind the microbatches in order."""
    n = mo.pp_size * mo.seed.stages_per_rank
    rank_of = {s: r for r, ss in enumerate(mo.stages) for s in ss}

    def after(a, b, hop):  # a starts after b ends (+ the link if the stages are on different ranks)
        mo.model.add(mo.start[a] >= mo.end[b] + (mo.lat if hop and rank_of[a[1]] != rank_of[b[1]] else 0))

    for s in range(n):
        for j in range(mo.m):
            if s > 0:
                after(("F", s, j), ("F", s - 1, j), True)
            after(("I", s, j), ("F", s, j), False)
            if s < n - 1:
                after(("I", s, j), ("I", s + 1, j), True)
            after(("W", s, j), ("I", s, j), False)
            if j > 0:
                for k in "FIW":
                    after((k, s, j), (k, s, j - 1), False)


def _add_ranks(mo: _Model) -> None:
    """Per rank: one action at a time, and the memory limit as a cumulative: an F's activations held
    until its I (the share 1 - R) and until its W (the share R)."""
    Q = 10 ** 6  # a stage microbatch's activations, in integer units (R to six digits; the answer is re-checked)
    q_w = round(Q * mo.seed.weight_memory)
    q_i = Q - q_w
    capacity = int(math.floor(Q * mo.seed.memory_limit * mo.seed.stages_per_rank + 1e-6))
    for ss in mo.stages:
        mo.model.add_no_overlap([mo.iv[a] for a in mo.actions(ss)])
        held, demand = [], []
        for s in ss:
            for j in range(mo.m):
                for k, q in (("I", q_i), ("W", q_w)):
                    if q <= 0:
                        continue
                    size = mo.model.new_int_var(0, mo.horizon, f"h{k}{s}_{j}")
                    mo.sizes.append((size, ("F", s, j), (k, s, j)))
                    held.append(mo.model.new_interval_var(mo.start[("F", s, j)], size, mo.end[(k, s, j)],
                                                          f"m{k}{s}_{j}"))
                    demand.append(q)
        if held:
            mo.model.add_cumulative(held, demand, capacity)


def _add_objective(mo: _Model) -> None:
    """The makespan (everything from 0), or the period (each rank's first start to its last end)."""
    stages, m, model = mo.stages, mo.m, mo.model
    last = {r: [mo.end[("W", s, m - 1)] for s in ss] for r, ss in enumerate(stages)}
    first = {r: mo.start[("F", min(ss), 0)] for r, ss in enumerate(stages)}
    mo.obj = obj = model.new_int_var(0, mo.horizon, "objective")
    if mo.seed.objective == "period":
        for r in last:
            for e in last[r]:
                model.add(obj >= e - first[r])
    else:
        model.add(mo.start[("F", 0, 0)] == 0)
        for r in last:
            for e in last[r]:
                model.add(obj >= e)
    if mo.exact and mo.seed.bound:  # the closed-form bound: lets it prove optimality
        model.add(obj >= int(math.floor(mo.seed.bound * mo.S + 1e-6)))
    model.minimize(obj)


def _add_hints(mo: _Model) -> None:
    """The seed's placement as the solver's hint (starts, memory sizes, objective)."""
    seed, S, dur, m = mo.seed, mo.S, mo.dur, mo.m
    seed_times = {(a.kind, a.stage, a.microbatch): a.start for a in seed.timeline.compute()}
    hint = {a: int(round(seed_times[a] * S)) for a in mo.start}
    for a, var in mo.start.items():
        mo.model.add_hint(var, hint[a])
    for size, a, b in mo.sizes:
        mo.model.add_hint(size, hint[b] + dur[b[0]] - hint[a])
    spans = [hint[("W", s, m - 1)] + dur["W"] - (hint[("F", min(ss), 0)] if seed.objective == "period" else 0)
             for ss in mo.stages for s in ss]
    mo.model.add_hint(mo.obj, max(spans))


def _solve(mo: _Model, time_limit: float, workers: int, progress: bool):
    """Run CP-SAT for `time_limit` seconds (a progress bar of its best value and bound when asked);
    returns (solver, status, seconds)."""
    cp_model, seed, S = mo.cp, mo.seed, mo.S
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = max(1, int(workers))
    # the period: its whole portfolio (large neighbourhood search included) even on one thread; one
    # worker alone runs a single tree search, too weak for the period (bench/RESULTS.md, "labkit/theory/exact.py")
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
    status = solver.solve(mo.model, _Callback())
    bar.close("done")
    return solver, status, time.monotonic() - t0


def _best(mo: _Model, solver, status, elapsed: float, time_limit: float) -> SearchResult:
    """The solver's order re-measured (`evaluate`), kept if it beats the seed within the memory limit;
    `solver` (what ran) and `bound` (the proven one, with exact costs) filled in."""
    cp_model, seed, S, m = mo.cp, mo.seed, mo.S, mo.m
    info = {"status": solver.status_name(status), "seconds": round(elapsed, 2), "scale": S, "exact_costs": mo.exact,
            "seed": seed.rule, "seed_value": seed.value, "workers": solver.parameters.num_workers,
            "time_limit": time_limit}
    best = seed
    solved = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    if solved:
        at = {a: solver.value(v) / S for a, v in mo.start.items()}
        order = {r: sorted(mo.actions(ss), key=lambda a: (at[a], a[1])) for r, ss in enumerate(mo.stages)}
        found = evaluate(order, mo.pp_size, m, mo.cost, seed.memory_limit, "exact: CP-SAT",
                         weight_memory=seed.weight_memory, stages_per_rank=seed.stages_per_rank,
                         objective=seed.objective, not_before=at if seed.objective == "period" else None)
        info["solver_value"] = solver.objective_value / S
        if found.value < seed.value - 1e-9 and max(found.peak.values()) <= seed.memory_limit + 1e-9:
            best = found
    bound = seed.bound or 0.0
    if mo.exact and solved:
        bound = max(bound, solver.best_objective_bound / S)
    best.bound = bound
    best.solver = info
    return best
