"""The zero-bubble paper's own comparison, with its numbers, and the kit reproducing it.

Source: P. Qi, X. Wan, G. Huang, M. Lin, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241v1
(published at ICLR 2024 as "Zero Bubble (Almost) Pipeline Parallelism"). Two tables of v1 are copied
here verbatim, nothing else:

- Table 9 (Appendix D, "Profiled time of TF, TB, TW, and Tcomm"): per-stage costs the authors
  profiled in their ZB-2p runs (GPT-3-like models on A100s, Megatron-LM), one row per model and
  microbatch count. The table states no unit (the values read as milliseconds); bubble rates do not
  depend on it.
- Table 5 (Section 5.3, "Bubble rates of 1F1B, 1F1B-I, ZB-H1, ZB-H2, ZB-1p, ZB-2p under different
  settings"): computed by the authors from Table 9's costs, not measured.

Their bubble rate is (cost - m(TF+TB+TW)) / cost, where cost is "the largest execution time of all
stages": a stage's first forward start to its last W end, what `SearchResult.period` and
`search.rank_spans` measure (a step's time once steps overlap), not the one-step makespan. Their B
is the kit's and torch's I. Their Table 2 gives closed forms with equal-cost stages and no
communication: bubble sizes (p-1)(TF+TB+TW) for 1F1B, (p-1)(TF+TB-TW) for ZB-H1, (p-1)(TF+TB-2TW)
for ZB-H2.

The kit rebuilds 1F1B (torch's order), ZB-H1 and ZB-H2 (the handcrafted orders of the paper's
Figure 3, `labkit.theory.search.handcrafted`, re-exported here) and simulates them with Table 9's
costs (`labkit.theory.simulate_order`, Tcomm as `Cost.p2p`): all 36 of Table 5's 1F1B / ZB-H1 /
ZB-H2 rates come out equal to the 4 printed decimals (tests/test_paper.py). ZB-1p and ZB-2p are the
paper's SEARCHED schedules (its heuristic, then an ILP); the kit's `search` (`comparison(search_settings=...)`)
seeds itself with the handcrafted orders and the authors' heuristic (`labkit.theory.zbheuristic`, a port
of their repository's `manual_order`), ranks by the same longest stage's span, polishes the best
(`labkit.theory.polish`) and with a time limit runs CP-SAT in place of the ILP. Of the 24 searched
rates, 15 come out at or below the printed ones unrounded; the other 9 are provably optimal (they
meet `labkit.theory.bounds`' closed-form bound, so no order in this model does better) and equal the
printed rate to its 4 decimals: all 12 ZB-1p are ZB-H1 (optimal at 1F1B's memory, which is why the
paper's ZB-1p column repeats its ZB-H1 column), 7 of them a rounding above print (e.g. 1.5B m=24:
0.158520, printed 0.1585), and ZB-2p at 1.5B m=24 (0.043310, printed 0.0433) and 28.3B m=256 (0.001835,
printed 0.0018). Tests: tests/test_paper.py, tests/test_bounds.py; the whole table: bench. See notebook 13.
1F1B-I (interleaved, one transformer layer per chunk, layer counts per stage uneven) is printed
but not reproduced: the per-chunk costs it needs are not in the paper.

Memory is counted as the paper counts it: its Table 1 gives the activation memory one transformer
layer needs for B, M_B = sb(34h + 5as), and for W, M_W = 32sbh (h hidden size, a attention heads,
s sequence length, b microbatch size); F holds M_B, B (the kit's I) frees M_B - M_W, W frees M_W, and
ZB-1p / ZB-2p are searched under limits pM_B and 2pM_B. So the share held from I until W is
R = M_W / M_B = 32h / (34h + 5as) (`weight_memory`), from the models of its Table 4 (`MODELS`: h, a,
s = 1024). The zero-bubble repository sets the same numbers in its scheduler (mem_f = 34h + 5as,
mem_w = -32h). Taught in notebook 13.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..schedules.orders import PlannedAction
from .cost import Cost
from .search import handcrafted, rank_spans, search  # handcrafted re-exported: the paper's Figure 3 orders
from .simulate import simulate, simulate_order

CITATION = ("Qi, Wan, Huang, Lin: Zero Bubble Pipeline Parallelism, arXiv:2401.10241v1, "
            "Table 9 (Appendix D: profiled TF, TB, TW, Tcomm) and Table 5 (Section 5.3: bubble rates)")

SCHEDULES = ("1F1B", "1F1B-I", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p")
"""Table 5's columns, in its order."""


@dataclass(frozen=True)
class Setting:
    """One row of Tables 5 and 9: a model, its pipeline stages p and microbatches m."""

    model: str
    p: int
    m: int

    def __str__(self) -> str:
        return f"{self.model}, p={self.p}, m={self.m}"


def _rows(model: str, p: int, ms, **columns) -> dict:
    return {Setting(model, p, m): {k: v[i] for k, v in columns.items()} for i, m in enumerate(ms)}


# Table 9, verbatim: TF, TB, TW, Tcomm per (model, p, m).
PROFILED: dict[Setting, dict[str, float]] = {
    **_rows("1.5B", 8, (24, 32, 64), TF=(18.522, 18.513, 18.546), TB=(18.086, 18.086, 18.097),
            TW=(9.337, 9.331, 9.321), Tcomm=(0.601, 0.626, 0.762)),
    **_rows("6.2B", 8, (24, 32, 64), TF=(29.718, 29.802, 29.935), TB=(29.444, 29.428, 29.621),
            TW=(19.927, 19.530, 19.388), Tcomm=(0.527, 0.577, 0.535)),
    **_rows("14.6B", 16, (48, 64, 128), TF=(11.347, 11.307, 11.325), TB=(11.248, 11.254, 11.308),
            TW=(8.132, 8.101, 8.109), Tcomm=(0.377, 0.379, 0.378)),
    **_rows("28.3B", 32, (96, 128, 256), TF=(10.419, 10.408, 10.402), TB=(10.207, 10.204, 10.248),
            TW=(7.715, 7.703, 7.698), Tcomm=(0.408, 0.408, 0.460)),
}

# Table 5, verbatim: bubble rates per (model, p, m) and schedule.
BUBBLE_RATES: dict[Setting, dict[str, float]] = {
    **_rows("1.5B", 8, (24, 32, 64), **{
        "1F1B": (0.2431, 0.1985, 0.1240), "1F1B-I": (0.1055, 0.0818, 0.0443), "ZB-H1": (0.1585, 0.1242, 0.0674),
        "ZB-H2": (0.1083, 0.0837, 0.0444), "ZB-1p": (0.1585, 0.1242, 0.0674), "ZB-2p": (0.0433, 0.0039, 0.0026)}),
    **_rows("6.2B", 8, (24, 32, 64), **{
        "1F1B": (0.2347, 0.1898, 0.1091), "1F1B-I": (0.0808, 0.0628, 0.0320), "ZB-H1": (0.1323, 0.1045, 0.0554),
        "ZB-H2": (0.0698, 0.0559, 0.0294), "ZB-1p": (0.1323, 0.1045, 0.0554), "ZB-2p": (0.0029, 0.0022, 0.0010)}),
    **_rows("14.6B", 16, (48, 64, 128), **{
        "1F1B": (0.2552, 0.2082, 0.1251), "1F1B-I": (0.1104, 0.0852, 0.0445), "ZB-H1": (0.1397, 0.1088, 0.0576),
        "ZB-H2": (0.0672, 0.0516, 0.0266), "ZB-1p": (0.1397, 0.1088, 0.0576), "ZB-2p": (0.0066, 0.0054, 0.0028)}),
    **_rows("28.3B", 32, (96, 128, 256), **{
        "1F1B": (0.2646, 0.2168, 0.1352), "1F1B-I": (0.1493, 0.1164, 0.0624), "ZB-H1": (0.1421, 0.1106, 0.0594),
        "ZB-H2": (0.0641, 0.0490, 0.0257), "ZB-1p": (0.1421, 0.1106, 0.0594), "ZB-2p": (0.0038, 0.0029, 0.0018)}),
}

SETTINGS: tuple[Setting, ...] = tuple(PROFILED)

# Table 4 of the paper: hidden size h and attention heads a per model (sequence length 1024).
MODELS: dict[str, dict[str, int]] = {
    "1.5B": {"h": 2304, "a": 24, "s": 1024}, "6.2B": {"h": 4096, "a": 32, "s": 1024},
    "14.6B": {"h": 5120, "a": 40, "s": 1024}, "28.3B": {"h": 6144, "a": 48, "s": 1024},
}


def weight_memory(model: str) -> float:
    """R = M_W / M_B = 32h / (34h + 5as): the share of a microbatch's activations W still needs after
    B (the paper's Table 1 formulas with its Table 4 model sizes); `search(weight_memory=R)`."""
    d = MODELS[model]
    return 32 * d["h"] / (34 * d["h"] + 5 * d["a"] * d["s"])


def cost(setting: Setting, comm: bool = True) -> Cost:
    """Table 9's costs as the kit's `Cost` (the paper's B is the kit's I; B = I + W for 1F1B's full
    backward; Tcomm as p2p, or 0 with comm=False for Table 2's closed forms)."""
    t = PROFILED[setting]
    return Cost(F=t["TF"], B=t["TB"] + t["TW"], I=t["TB"], W=t["TW"], p2p=t["Tcomm"] if comm else 0.0,
                unit="Table 9 units")


def closed_form_bubble_size(kind: str, pp_size: int, c: Cost) -> float:
    """The paper's Table 2: bubble size per stage with equal stages and no communication."""
    f, i, w = c.F, c.input_grad, c.weight_grad
    return (pp_size - 1) * {"1F1B": f + i + w, "ZB-H1": f + i - w, "ZB-H2": f + i - 2 * w}[kind]


def period(timeline) -> float:
    """The paper's "cost": the largest execution time of all stages (first start to last end)."""
    return max(rank_spans(timeline).values())


def bubble_rate(timeline, n_microbatches: int, c: Cost) -> float:
    """The paper's bubble rate: (cost - m(TF+TB+TW)) / cost, cost the longest stage (`period`)."""
    busy = n_microbatches * (c.F + c.input_grad + c.weight_grad)
    span = period(timeline)
    return (span - busy) / span


def kit_timeline(kind: str, setting: Setting, comm: bool = True):
    """The kit's simulated timeline of 1F1B, ZB-H1 or ZB-H2 at a setting of Table 9."""
    c = cost(setting, comm)
    if kind == "1F1B":
        return simulate("1F1B", setting.p, setting.m, cost=c)
    return simulate_order(handcrafted(kind, setting.p, setting.m), setting.p, setting.m, c, meta={"schedule": kind})


def comparison(settings=SETTINGS, search_settings=(), *, time_limit: float = 0.0, workers: int = 1,
               paper_memory: bool = True, variants: bool = False) -> list[dict]:
    """One row per setting: the paper's Table 5 rates and the kit's (1F1B, ZB-H1, ZB-H2 simulated;
    ZB-1p and ZB-2p as the kit's `search` at memory limits p and 2p, for `search_settings` only, with
    the paper's memory count (`weight_memory`; paper_memory=False holds everything until W), and
    with `time_limit` > 0 the exact model for that many seconds per search; with `variants` the list
    scheduler's variants too: slower, see bench/RESULTS.md). Each searched entry also
    says how long it took (`seconds`), the proven bound on the rate (`bound`: the closed form's or the
    solver's), whether it meets it (`optimal`) and whether it is at or below the printed rate, unrounded."""
    rows = []
    for st in settings:
        c = cost(st)
        kit = {k: bubble_rate(kit_timeline(k, st), st.m, c) for k in ("1F1B", "ZB-H1", "ZB-H2")}
        searched = {}
        if st in search_settings:
            for name, limit in (("ZB-1p", st.p), ("ZB-2p", 2 * st.p)):
                t0 = time.monotonic()
                r = search(st.p, st.m, c, memory_limit=limit,
                           weight_memory=weight_memory(st.model) if paper_memory else 1.0,
                           time_limit=time_limit, workers=workers, variants=variants)
                kit[name] = bubble_rate(r.timeline, st.m, c)
                busy = st.m * (c.F + c.input_grad + c.weight_grad)
                searched[name] = {"seconds": round(time.monotonic() - t0, 2), "rule": r.rule,
                                  "bound": (r.bound - busy) / r.bound if r.bound else 0.0,
                                  "optimal": bool(r.bound) and r.value <= r.bound * (1 + 1e-12),
                                  "at_or_below_paper": kit[name] <= BUBBLE_RATES[st][name],
                                  "peak": max(r.peak.values())}
        rows.append({"model": st.model, "p": st.p, "m": st.m, "paper": dict(BUBBLE_RATES[st]), "kit": kit,
                     "searched": searched})
    return rows
