"""Costs fitted stage by stage (issue 31): the ideal drawn beside a measured step is the ideal of THAT
step, uneven stages included, and says how far its stages differ."""

from __future__ import annotations

import pytest

from labkit.timeline.compare import Shape, fitted_ideal, pipelines_vs_ideal, uniform_ideal
from labkit.theory import Cost, StageCosts, closed_form_bubble, fit_cost, fit_stage_costs, simulate
from labkit.core.actions import Timeline

UNEVEN = StageCosts(((0, Cost(F=0.010, B=0.008)), (1, Cost(F=0.010, B=0.016)), (2, Cost(F=0.010, B=0.020)),
                     (3, Cost(F=0.010, B=0.028))), default=Cost(F=0.010, B=0.018), unit="s")


def _measured(schedule="1F1B", p=4, m=4, spr=None, costs=UNEVEN) -> Timeline:
    """A step as if measured: the simulated actions of uneven stages, read back as spans."""
    sim = simulate(schedule, p, m, spr, costs)
    return Timeline(sim.actions, source="spans", meta={"schedule": schedule, "pp_size": p, "n_microbatches": m})


def test_each_stage_keeps_its_own_costs():
    fitted = fit_stage_costs(_measured())
    for s, c in UNEVEN.stages:
        assert fitted.cost(s).F == pytest.approx(c.F) and fitted.cost(s).B == pytest.approx(c.B)
    assert fitted.spread()["B"] == pytest.approx((0.008, 0.028)) and fitted.spread()["F"] == pytest.approx((0.010, 0.010))
    assert fitted.spread_text() == "per stage: F 10 ms, B 8-28 ms, I 4-14 ms, W 4-14 ms"
    assert fitted.default == fit_cost(_measured())  # a stage it lacks costs what one cost per kind gives
    assert fitted.duration("B", 99) == pytest.approx(fitted.default.B)


def test_the_fitted_ideal_is_this_steps_ideal_not_the_closed_form():
    """1F1B with backwards of 8 to 28 ms: the ideal with each stage's costs IS the step (it was made so);
    one cost per kind gives the textbook (p-1)/(m+p-1) and misses the step by a wide margin."""
    measured = _measured()
    shape = Shape("1F1B", 4, 4, 1)
    own, uniform = fitted_ideal(measured, shape), uniform_ideal(measured, shape)
    assert own.metrics()["makespan"] == pytest.approx(measured.metrics()["makespan"])
    assert own.metrics()["bubble_fraction"] == pytest.approx(measured.metrics()["bubble_fraction"])
    assert uniform.metrics()["bubble_fraction"] == pytest.approx(closed_form_bubble(4, 4))
    assert abs(measured.metrics()["bubble_fraction"] - closed_form_bubble(4, 4)) > 0.05
    assert own.meta["costs"] == "fitted per stage" and own.meta["cost_spread"].startswith("per stage: F 10 ms, B 8-28 ms")
    assert own.meta["cost"]["per_stage"]["3"]["B"] == pytest.approx(0.028)


def test_pipelines_vs_ideal_reports_both_ideals_and_the_spread():
    (part, ideal, summary), = pipelines_vs_ideal(_measured("Interleaved1F1B", 2, 4, 2, StageCosts(
        tuple((s, Cost(F=0.01, B=0.02 + 0.01 * s)) for s in range(4)), default=Cost(F=0.01, B=0.035))))
    assert summary["ideal_bubble_fraction"] == pytest.approx(summary["measured_bubble_fraction"])
    assert summary["uniform_ideal_bubble_fraction"] != pytest.approx(summary["ideal_bubble_fraction"])
    assert summary["cost_spread"] == "per stage: F 10 ms, B 20-50 ms"  # Interleaved1F1B has no I or W to cost
    assert part.counts() == ideal.counts()


def test_plot_title_shows_the_spread():
    from matplotlib.figure import Figure

    from labkit.timeline.plot import plot_timeline

    ideal = fitted_ideal(_measured(), Shape("1F1B", 4, 4, 1))
    ax = Figure().subplots()
    plot_timeline(ax, ideal)
    title = ax.get_title()
    assert "each stage's costs fitted to the measured step" in title and "per stage: F 10 ms, B 8-28 ms" in title
    assert " I " not in title and " W " not in title  # 1F1B runs no I or W: its title lists no cost for them
