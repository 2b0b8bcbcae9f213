"""The memory frontier (labkit/theory/frontier.py, drawn by labkit/timeline/frontier.py; notebook 13):
searched orders and torch's built-in schedules as (peak, makespan) points at the same costs."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.core.errors import ConfigError  # noqa: E402
from labkit.theory.frontier import BUILT_INS, best_at, frontier  # noqa: E402
from labkit.timeline.frontier import plot_frontier  # noqa: E402


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
