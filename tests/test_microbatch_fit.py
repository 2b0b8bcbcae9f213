"""labkit.theory.microbatches: a cost per action fitted from steps at several microbatch counts
(notebook 05, choosing microbatches). Synthetic steps whose costs are known: the fit finds them."""

import pytest

from labkit.core.errors import ConfigError
from labkit.core.actions import Action, Timeline
from labkit.theory import simulate
from labkit.theory.microbatches import action_durations, fit_microbatch_costs, ideal_step_times


def _step(m: int, a_f: float, a_b: float, c: float) -> Timeline:
    """Two actions of each kind whose durations are a/m + c (the starts do not matter to the fit)."""
    acts = [Action(0, 0, i, k, 0.0, (a / m + c) * (1 + e)) for i, e in enumerate((-0.01, 0.01))
            for k, a in (("F", a_f), ("B", a_b))]
    return Timeline(acts, "spans")


def test_the_fit_finds_the_batch_share_and_the_fixed_cost():
    durations = {m: action_durations([_step(m, 0.08, 0.16, 0.002)]) for m in (1, 2, 4, 8, 16)}
    fit = fit_microbatch_costs(durations, gaps={m: [0.001, 0.003] for m in durations})
    assert fit.batch["F"] == pytest.approx(0.08, rel=1e-6) and fit.batch["B"] == pytest.approx(0.16, rel=1e-6)
    assert fit.fixed["F"] == pytest.approx(0.002, abs=1e-9) and fit.gap == pytest.approx(0.002)
    assert fit.per_action("F") == pytest.approx(0.004) and max(fit.residual.values()) < 1e-6
    cost = fit.cost(4)
    assert cost.F == pytest.approx(0.02 + 0.004) and cost.B == pytest.approx(0.04 + 0.004)
    assert fit.cost(4, per_action=False).F == pytest.approx(0.02)
    steps = ideal_step_times("Interleaved1F1B", 2, (2, 16), fit, 2)
    assert steps[2]["makespan"] == pytest.approx(simulate("Interleaved1F1B", 2, 2, 2, fit.cost(2)).metrics()["makespan"])
    # the per-action cost makes many small microbatches slower than the batch's share alone says
    bare = ideal_step_times("Interleaved1F1B", 2, (2, 16), fit, 2, per_action=False)
    assert steps[16]["makespan"] - bare[16]["makespan"] > steps[2]["makespan"] - bare[2]["makespan"]
    assert "per action" in fit.text()


def test_one_m_cannot_separate_the_two_parts():
    with pytest.raises(ConfigError, match="two or more microbatch counts"):
        fit_microbatch_costs({4: action_durations([_step(4, 0.08, 0.16, 0.002)])})


def test_a_negative_intercept_is_refitted_through_the_origin():
    # durations that shrink faster than 1/m (noise on a busy machine): no negative fixed cost
    durations = {1: {"F": [0.1]}, 2: {"F": [0.04]}, 4: {"F": [0.01]}}
    fit = fit_microbatch_costs(durations)
    assert fit.fixed["F"] == 0.0 and fit.batch["F"] > 0 and fit.residual["F"] > 0.1


def test_durations_that_do_not_fall_with_m_find_no_batch_share_and_say_so():
    # notebook 05 on a busy machine: B's medians did not get shorter with m (waits for a core inside
    # each action); the constrained least squares gives a = 0, c = their mean, and text() says it in
    # words rather than "B: 0.00 ms for the whole batch"
    durations = {1: {"F": [0.010], "B": [0.004]}, 2: {"F": [0.006], "B": [0.006]}, 4: {"F": [0.004], "B": [0.005]}}
    fit = fit_microbatch_costs(durations)
    assert fit.batch["B"] == 0.0 and fit.fixed["B"] == pytest.approx(0.005) and fit.batch["F"] > 0
    text = fit.text()
    assert "B: no share of the batch found" in text and "5.00 ms per action" in text
    assert "B: 0.00 ms" not in text and "F: " in text and "for the whole batch" in text


def test_plot_step_times_draws_the_measured_spread_and_both_ideals():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from labkit.timeline.plot import plot_step_times

    ax = Figure().subplots()
    artists = plot_step_times(ax, {1: [0.3, 0.1, 0.2], 4: [0.5, 0.4, 0.6]}, {1: 0.2, 4: 0.45}, {1: 0.15, 4: 0.1})
    assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == ["1", "4"]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["ideal, batch's share only", "ideal + fitted cost per action", "measured (median, min-max)"]
    bars = next(a for a in artists if hasattr(a, "lines") and a.get_label().startswith("measured"))
    assert list(bars.lines[0].get_ydata()) == [0.2, 0.5]  # the medians
