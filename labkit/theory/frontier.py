"""The memory frontier: one step's time against the activation memory a schedule holds.

For P ranks, M microbatches and per-rank costs F, I, W (a whole rank's share of the model; a schedule
with two stages per rank costs half of each per stage), `frontier` gives

- the kit's searched orders at a range of memory limits, one stage per rank and in torch's V
  placement (`labkit.theory.search`, objective one step's makespan), and
- torch's built-in schedules (1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble,
  DualPipeV) as single points, simulated at the same costs,

each with its peak (the most activation memory any rank holds, in 1F1B stage microbatches: 1F1B holds
P) and its makespan. `per_action` adds a fixed cost to every action (the runtime's Python, posting
sends and receives): orders that split each backward into I and W, or cut the model into twice as
many stages, run more actions and pay it more often. DualPipeV mixes fused and split backwards; its
fused B is charged twice (`Cost` keeps B = I + W). `fit_per_action` reads that cost off measured steps;
`v_claims` holds the V search to V-Half's and V-Min's claims at 1/2 and 1/3 of 1F1B's memory, under
each memory count. Drawn by `labkit.timeline.frontier_plot.plot_frontier`; taught in notebook 13.
"""

from __future__ import annotations

from ..core.errors import ConfigError
from .cost import Cost
from .search import evaluate, memory_peak, search
from .simulate import simulate, theory_json

BUILT_INS = (("1F1B", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2),
             ("DualPipeV", 2))
"""torch's schedules on the frontier, with their stages per rank."""


def stage_cost(f: float, i: float, w: float, stages_per_rank: int, per_action: float = 0.0) -> Cost:
    """One stage's costs when a rank's share (f, i, w) is cut into `stages_per_rank` stages, each action
    + `per_action`."""
    k = stages_per_rank
    return Cost(F=f / k + per_action, I=i / k + per_action, W=w / k + per_action)


def frontier(pp_size: int, n_microbatches: int, f: float = 1.0, i: float = 1.0, w: float = 1.0, *,
             per_action: float = 0.0, limits=None, v_limits=None) -> dict:
    """Searched points (one per memory limit that admits an order) and built-in points, each a dict of
    name, stages_per_rank, memory_limit (searched only), peak and makespan; plus `busy`, M(f + i + w),
    the step without idle time or per-action cost."""
    if per_action < 0:
        raise ConfigError(f"per_action is a cost added to every action, >= 0; got {per_action}.")
    p, m = pp_size, n_microbatches
    limits = limits or range(1, 2 * p + 1)
    v_limits = v_limits or [k / 2 for k in range(2, 2 * p + 1)]  # beyond P the V seeds hold no more
    out = {"pp_size": p, "n_microbatches": m, "per_action": per_action, "busy": m * (f + i + w),
           "searched": [], "searched_v": [], "built_in": []}
    for key, spr, ks in (("searched", 1, limits), ("searched_v", 2, v_limits)):
        c = stage_cost(f, i, w, spr, per_action)
        for k in ks:
            try:
                r = search(p, m, c, memory_limit=k, stages_per_rank=spr, objective="makespan")
            except ConfigError:  # no order fits this little memory
                continue
            out[key].append({"name": f"searched K={k:g}", "stages_per_rank": spr, "memory_limit": k,
                             "peak": max(r.peak.values()), "makespan": round(r.makespan, 9), "rule": r.rule})
    for name, spr in BUILT_INS:
        c = stage_cost(f, i, w, spr, per_action)
        try:
            tl = simulate(name, p, m, spr, c)
        except Exception as e:  # noqa: BLE001 (a torch release that lacks the schedule, or refuses the sizes)
            out["built_in"].append({"name": name, "stages_per_rank": spr, "error": str(e).splitlines()[0]})
            continue
        j = theory_json(tl)
        out["built_in"].append({"name": name, "stages_per_rank": spr, "peak": max(j["peak"].values()),
                                "makespan": round(j["makespan"], 9)})
    return out


def best_at(points: list[dict], peak: float) -> dict | None:
    """The fastest point holding at most `peak`."""
    fit = [q for q in points if "makespan" in q and q["peak"] <= peak + 1e-9]
    return min(fit, key=lambda q: (q["makespan"], q["peak"])) if fit else None


def fit_per_action(measured: dict[str, float], ideal: dict[str, float], actions: dict[str, int]) -> float:
    """One cost per action c that explains measured steps as their ideal plus c times the actions of their
    busiest rank: the least-squares fit through the origin of each step's excess (measured - ideal, same
    units) against its action count. Notebook 13 fits it to its live steps and checks each against it."""
    names = list(measured)
    if not names or any(n not in ideal or n not in actions for n in names):
        raise ConfigError(f"fit_per_action needs an ideal and an action count for every measured step; measured "
                          f"{names}, ideal {list(ideal)}, actions {list(actions)}.")
    if not any(actions[n] for n in names):
        raise ConfigError("fit_per_action: every step runs 0 actions; count the busiest rank's compute actions.")
    return sum((measured[n] - ideal[n]) * actions[n] for n in names) / sum(actions[n] ** 2 for n in names)


V_CLAIMS = {"V-Half": (1 / 2, 1 / 2), "V-Min": (1 / 3, 2 / 3)}
"""arXiv 2405.15362's claims: (share of 1F1B's activation memory, share of 1F1B's bubble), both as P grows."""


def v_claims(pp_size: int, n_microbatches: int, weight_memories=(1.0, 0.0), *, time_limit: float = 0.0) -> list[dict]:
    """V-Half and V-Min against their claims, F = I = W = 1 per rank (two V stages of half each).

    One row per schedule and memory count R (`weight_memory`): the order's own peak and makespan, and the V
    search at exactly its memory share of 1F1B's P (`limit`), its makespan and bubble as a share of 1F1B's
    (`ratio`) against the claimed share (`claim`; `claim_makespan`, the makespan it allows). CP-SAT
    (`time_limit` > 0) runs for the loosest count (the smallest R) only: every R holds at least as much at
    every moment, so that row's proven `bound` bounds all counts. `makespan` None: no order fits. Notebook 13."""
    from .exact import NEEDS_ORTOOLS, available
    from .vgreedy import v_order

    if time_limit > 0 and not available():  # else the search's refusal would read as "no order fits"
        raise ConfigError(f"v_claims(time_limit={time_limit:g}) proves its bounds with {NEEDS_ORTOOLS}; or pass "
                          f"time_limit=0 for the list scheduler alone (no proven bound).")
    p, m = pp_size, n_microbatches
    half = stage_cost(1, 1, 1, 2)
    busy = 3 * m
    one_f_one_b = simulate("1F1B", p, m, 1, Cost(F=1, B=2)).metrics()["makespan"] - busy  # its bubble
    rows = []
    for kind, (memory_share, claim) in V_CLAIMS.items():
        order = v_order(kind, p, m)
        own = evaluate(order, p, m, half, p, kind, stages_per_rank=2, objective="makespan")
        for r in weight_memories:
            row = {"kind": kind, "weight_memory": r, "own_peak": max(memory_peak(order, r, 2).values()),
                   "own_makespan": own.makespan, "own_ratio": (own.makespan - busy) / one_f_one_b,
                   "limit": memory_share * p, "claim": claim, "claim_makespan": busy + claim * one_f_one_b,
                   "makespan": None, "ratio": None, "bound": None}
            exact = time_limit if r == min(weight_memories) else 0.0
            try:
                found = search(p, m, half, memory_limit=memory_share * p, stages_per_rank=2, weight_memory=r,
                               objective="makespan", time_limit=exact)
            except ConfigError:  # no order fits this little memory
                rows.append(row)
                continue
            row.update(makespan=found.makespan, ratio=(found.makespan - busy) / one_f_one_b,
                       peak=max(found.peak.values()))
            if exact and found.bound is not None:
                row["bound"] = found.bound
            rows.append(row)
    return rows
