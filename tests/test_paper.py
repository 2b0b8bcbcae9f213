"""The zero-bubble paper's comparison recomputed (labkit/theory/paper.py): its Table 5 bubble rates of
1F1B, ZB-H1 and ZB-H2 from its Table 9 costs with the kit's simulator, its Table 2 closed forms, its
Figure 3 orders, and the kit's search beside its searched ZB-1p (arXiv:2401.10241v1)."""

import pytest

from labkit.schedules.orders import check_order, peak_in_flight
from labkit.theory import paper
from labkit.theory.search import search


def test_the_tables_hold_every_setting_and_column():
    assert len(paper.SETTINGS) == 12 and set(paper.BUBBLE_RATES) == set(paper.PROFILED) == set(paper.SETTINGS)
    assert all(set(r) == set(paper.SCHEDULES) for r in paper.BUBBLE_RATES.values())
    assert all(set(t) == {"TF", "TB", "TW", "Tcomm"} for t in paper.PROFILED.values())
    assert "Table 5" in paper.CITATION and "Table 9" in paper.CITATION and "2401.10241" in paper.CITATION


@pytest.mark.parametrize("setting", paper.SETTINGS, ids=str)
def test_the_kit_recomputes_table_5_for_1f1b_zb_h1_and_zb_h2(setting):
    """All 36 rates equal the paper's to its 4 printed decimals (half a unit of the last digit)."""
    row = paper.comparison(settings=[setting])[0]
    for kind in ("1F1B", "ZB-H1", "ZB-H2"):
        assert abs(row["kit"][kind] - row["paper"][kind]) <= 0.00005 + 1e-12, (kind, row)


@pytest.mark.parametrize("setting", paper.SETTINGS, ids=str)
def test_without_communication_the_orders_meet_table_2s_closed_forms(setting):
    """Bubble size per stage (the longest stage's span minus m(F+I+W)) = (p-1)(F+I+W), (p-1)(F+I-W),
    (p-1)(F+I-2W) for 1F1B, ZB-H1, ZB-H2, with Table 9's unequal costs and Tcomm = 0."""
    c = paper.cost(setting, comm=False)
    busy = setting.m * (c.F + c.input_grad + c.weight_grad)
    for kind in ("1F1B", "ZB-H1", "ZB-H2"):
        size = paper.period(paper.kit_timeline(kind, setting, comm=False)) - busy
        assert size == pytest.approx(paper.closed_form_bubble_size(kind, setting.p, c), abs=1e-6), kind


# The paper's Figure 3 (p=4, m=8), read device by device: kind and microbatch (1-based), B written I.
FIGURE_3 = {
    "ZB-H1": ["F1 F2 F3 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 F8 I5 W5 I6 W6 I7 W7 I8 W8",
              "F1 F2 F3 I1 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 F8 I6 W5 I7 W6 I8 W7 W8",
              "F1 F2 I1 F3 I2 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 F8 I7 W5 I8 W6 W7 W8",
              "F1 I1 F2 I2 F3 I3 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 F8 I8 W5 W6 W7 W8"],
    "ZB-H2": ["F1 F2 F3 F4 F5 F6 F7 I1 W1 F8 I2 W2 I3 W3 I4 W4 I5 W5 I6 W6 I7 W7 I8 W8",
              "F1 F2 F3 F4 F5 I1 F6 I2 F7 I3 W1 F8 I4 W2 I5 W3 I6 W4 I7 W5 I8 W6 W7 W8",
              "F1 F2 F3 I1 F4 I2 F5 I3 F6 I4 F7 I5 W1 F8 I6 W2 I7 W3 I8 W4 W5 W6 W7 W8",
              "F1 I1 F2 I2 F3 I3 F4 I4 F5 I5 F6 I6 F7 I7 W1 F8 I8 W2 W3 W4 W5 W6 W7 W8"],
}


@pytest.mark.parametrize("kind", ["ZB-H1", "ZB-H2"])
def test_the_handcrafted_orders_are_figure_3s_and_hold_p_or_2p_minus_1(kind):
    order = paper.handcrafted(kind, 4, 8)
    assert {s: " ".join(f"{k}{mb + 1}" for k, _, mb in acts) for s, acts in order.items()} == dict(enumerate(FIGURE_3[kind]))
    for p, m in ((4, 8), (8, 24), (3, 2)):
        order = paper.handcrafted(kind, p, m)
        assert check_order(order, p, m) == []
        assert max(peak_in_flight(order).values()) == min(m, p if kind == "ZB-H1" else 2 * p - 1)


def test_the_kits_search_beside_the_papers_zb_1p():
    """The kit's search at the paper's ZB-1p memory limit (p microbatches), 1.5B model, m=24: a valid
    order within memory that beats 1F1B and equals the paper's ZB-1p (0.1585, its ZB-H1's rate): the
    kit's search starts from the handcrafted ZB-H1 (a seed), which meets the closed-form bound
    (labkit.theory.bounds), so no order (the rule's variants included, left out here for time) has a
    shorter longest stage. This pins what the kit reaches (before the seeds it was 0.1824)."""
    st = paper.Setting("1.5B", 8, 24)
    c = paper.cost(st)
    r = search(st.p, st.m, c, memory_limit=st.p, variants=False)
    assert r.period == pytest.approx(r.bound, abs=1e-9) and r.gap < 1e-12
    rate = paper.bubble_rate(r.timeline, st.m, c)
    assert max(r.peak.values()) <= st.p and check_order(r.order, st.p, st.m) == []
    assert rate < paper.BUBBLE_RATES[st]["1F1B"]
    assert rate == pytest.approx(paper.BUBBLE_RATES[st]["ZB-1p"], abs=5e-5)
    assert rate == pytest.approx(0.15852, abs=5e-6)
    assert r.rule == "seed: ZB-H1 (arXiv 2401.10241 Fig. 3)"


P8 = [s for s in paper.SETTINGS if s.p == 8]


@pytest.mark.parametrize("setting", P8, ids=str)
def test_the_kits_search_meets_the_papers_zb_1p_and_zb_2p(setting):
    """Table 5's searched columns, led: at the paper's memory limits (p and 2p stage microbatches, with
    its own count R = 32h/(34h+5as)), the kit's search (seeds, the authors' heuristic among them, then
    polished) is valid, within memory and, unrounded, at or below the printed ZB-1p and ZB-2p rate, except
    where no order can be: there the kit's order meets the closed-form bound (labkit.theory.bounds, gap 0,
    so it is optimal) and the printed rate is that optimum rounded to 4 decimals (1.5B m=24: ZB-1p
    0.158520 printed 0.1585, ZB-2p 0.043310 printed 0.0433). The p=16 and p=32 rows are in bench
    (scripts/bench.py --only paper): the same, slower."""
    row = paper.comparison(settings=[setting], search_settings=[setting])[0]
    for name, limit in (("ZB-1p", setting.p), ("ZB-2p", 2 * setting.p)):
        kit, printed, found = row["kit"][name], row["paper"][name], row["searched"][name]
        assert found["peak"] <= limit + 1e-9
        assert kit >= found["bound"] - 1e-12, (name, row)  # never below what is proven
        if kit > printed:  # only where the printed rate is a rounded optimum
            assert kit <= found["bound"] + 1e-12 and round(kit, 4) == printed, (name, row)
    assert row["kit"]["ZB-2p"] < row["kit"]["ZB-H2"] / 2  # what memory buys: W kept for the bubbles


def test_where_the_paper_rounds_an_optimum_down_the_kit_says_so():
    """1.5B m=24 is the row where both searched rates sit a hair above print: both are optimal (their
    bound is met); m=32's ZB-2p, a heuristic's 0.003914 (printed 0.0039), the kit's search takes below."""
    st = paper.Setting("1.5B", 8, 24)
    row = paper.comparison(settings=[st], search_settings=[st])[0]
    for name in ("ZB-1p", "ZB-2p"):
        assert row["kit"][name] > row["paper"][name] and row["kit"][name] == pytest.approx(row["searched"][name]["bound"])
    assert row["kit"]["ZB-1p"] == pytest.approx(0.158520, abs=5e-7) and row["kit"]["ZB-2p"] == pytest.approx(0.043310, abs=5e-7)
    st = paper.Setting("1.5B", 8, 32)
    row = paper.comparison(settings=[st], search_settings=[st])[0]
    assert row["kit"]["ZB-2p"] <= row["paper"]["ZB-2p"] and "polished" in row["searched"]["ZB-2p"]["rule"]


def test_the_authors_heuristic_keeps_ws_for_the_bubbles_and_the_end():
    """zbheuristic.best_order (a port of the repository's manual_order) at 2p: valid, within memory,
    every stage keeps most of its W's until its forwards are out, and every stage but the first ends
    on a run of W's (the first ends on the pipeline's last I)."""
    from labkit.theory.search import memory_peak
    from labkit.theory.zbheuristic import best_order

    st = paper.Setting("1.5B", 8, 24)
    R = paper.weight_memory(st.model)
    order, rule = best_order(st.p, st.m, paper.cost(st), 2 * st.p, R)
    assert check_order(order, st.p, st.m) == [] and rule.startswith("seed: zero-bubble heuristic")
    assert max(memory_peak(order, R).values()) <= 2 * st.p
    kinds = ["".join(k for k, _, _ in acts) for acts in order.values()]
    assert all(k[k.rindex("F"):].count("W") >= st.m // 2 for k in kinds)  # most W's after the last F
    assert all(k.endswith("WWW") for k in kinds[1:]) and kinds[0].endswith("IW")  # stage 0: its last I is last
    tight, _ = best_order(st.p, st.m, paper.cost(st), 1, R)  # one microbatch in flight: still valid, within it
    assert check_order(tight, st.p, st.m) == [] and max(memory_peak(tight, R).values()) <= 1
