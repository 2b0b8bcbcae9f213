"""The memory frontier (labkit/theory/frontier.py, drawn by labkit/timeline/frontier_plot.py; notebook 13):
searched orders and torch's built-in schedules as (peak, makespan) points at the same costs."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.core.errors import ConfigError  # noqa: E402
from labkit.theory.frontier import BUILT_INS, best_at, fit_per_action, frontier  # noqa: E402
from labkit.timeline.frontier_plot import plot_frontier  # noqa: E402


@pytest.fixture(scope="module")
def fronts():
    small = dict(limits=[1, 2, 4], v_limits=[1, 2])
    return {o: frontier(2, 4, per_action=o, **small) for o in (0.0, 0.5)}


def test_points_at_equal_costs_and_the_per_action_tax(fronts):
    """P=2, M=4, F=I=W=1 per rank: 1F1B holds P=2 for (M+P-1)(F+B) = 15; every searched point holds
    its limit; at 1F1B's memory the V search ties torch's best V schedule, and a cost per action
    charges the V (twice the actions) more than the one-stage order."""
    ideal, taxed = fronts[0.0], fronts[0.5]
    one = {q["name"]: q for q in ideal["built_in"]}
    assert [n for n, _ in BUILT_INS] == list(one) and one["1F1B"]["peak"] == 2 and one["1F1B"]["makespan"] == 15
    assert all(q["peak"] <= q["memory_limit"] for k in ("searched", "searched_v") for q in ideal[k])
    zbv = one["ZBVZeroBubble"]
    assert best_at(ideal["searched_v"], zbv["peak"])["makespan"] <= zbv["makespan"]
    assert ideal["busy"] == 12 and best_at(ideal["searched"], 2)["makespan"] < one["1F1B"]["makespan"]
    gap = lambda d, key: best_at(d[key], 2)["makespan"]
    assert gap(taxed, "searched_v") - gap(ideal, "searched_v") > gap(taxed, "searched") - gap(ideal, "searched")
    with pytest.raises(ConfigError, match="per_action"):
        frontier(2, 4, per_action=-1)


def test_plot_frontier_draws_on_the_given_ax(fronts):
    fig, ax = plt.subplots()
    artists = plot_frontier(ax, fronts[0.5], measured={"searched K=2": (2, 14.0)})
    texts = [t.get_text() for t in ax.texts]
    assert artists and any("ZBVZeroBubble" in t for t in texts) and "searched K=2 (measured)" in texts
    assert "peak activation memory" in ax.get_xlabel() and len(ax.lines) >= 3
    plt.close(fig)


def test_fit_per_action_recovers_the_cost_that_made_the_steps():
    """Steps built as ideal + 7 ms per action (more actions, more excess) give back 7 ms; noise on one
    step moves it only a little; a step without its ideal is refused."""
    ideal = {"1F1B": 1.32, "searched K=4": 1.08, "searched V K=4": 1.02}
    actions = {"1F1B": 16, "searched K=4": 24, "searched V K=4": 48}
    measured = {n: ideal[n] + 0.007 * actions[n] for n in ideal}
    assert fit_per_action(measured, ideal, actions) == pytest.approx(0.007)
    measured["1F1B"] += 0.01
    assert 0.007 < fit_per_action(measured, ideal, actions) < 0.0075
    with pytest.raises(ConfigError, match="every measured step"):
        fit_per_action({"x": 1.0}, {}, {"x": 3})


def test_v_claims_rows_at_half_and_a_third_of_1f1bs_memory():
    """P=4, M=8, list scheduler only: V-Half and V-Min hold the authors' (P+2)//2 and (P+4)//3 whatever R; at
    exactly half of 1F1B's memory with R = 1 the search keeps V-Min's 29.5 (0.61 of 1F1B's bubble), above
    V-Half's claimed 1/2 (28.5); no CP-SAT, so no bound."""
    from labkit.theory.frontier import v_claims

    rows = {(r["kind"], r["weight_memory"]): r for r in v_claims(4, 8, weight_memories=(1.0, 0.5))}
    assert len(rows) == 4 and all(r["bound"] is None for r in rows.values())
    assert {k: r["own_peak"] for k, r in rows.items()} == {("V-Half", 1.0): 3, ("V-Half", 0.5): 3, ("V-Min", 1.0): 2,
                                                             ("V-Min", 0.5): 2}
    half = rows["V-Half", 1.0]
    assert half["limit"] == 2 and half["makespan"] == 29.5 > half["claim_makespan"] == 28.5
    assert half["ratio"] == pytest.approx(5.5 / 9) and half["own_ratio"] == pytest.approx(2.5 / 9)
    assert rows["V-Min", 1.0]["limit"] == pytest.approx(4 / 3) and rows["V-Min", 1.0]["makespan"] > 30


def test_v_claims_without_ortools_says_what_to_install(no_ortools):
    """Notebook 13's claims cell without the `search` extra (issue 42): it ended in a TypeError
    (the CP-SAT row came back with no makespan, its refusal taken for "no order fits"); now the
    call says what to install, before any search runs. Without time_limit it needs no OR-Tools."""
    from labkit.theory.frontier import v_claims

    with pytest.raises(ConfigError, match=r"pip install -e '\.\[search\]'.*time_limit=0") as e:
        v_claims(4, 8, weight_memories=(1.0, 0.0), time_limit=20)
    assert "OR-Tools" in str(e.value) and "labkit[search]" in str(e.value)
    rows = v_claims(4, 8, weight_memories=(1.0,))  # the list scheduler alone still answers
    assert all(r["makespan"] is not None and r["bound"] is None for r in rows)
