"""Plot helpers: they draw on the given axes, return their artists, and leave pyplot alone."""

from __future__ import annotations

import re
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (only to check that labkit never opens pyplot figures)
import pytest  # noqa: E402
from matplotlib.collections import Collection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.legend import Legend  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from labkit.schedules.table import SCHEDULES  # noqa: E402
from labkit.timeline.plot import (
    KIND_COLORS,
    bubble_summary,
    kind_legend,
    plot_bubble_sweep,
    plot_side_by_side,
    plot_timeline,
)
from labkit.theory import Cost, fit_cost, simulate  # noqa: E402
from labkit.core.actions import Action, Timeline  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ax(figsize=(10, 3)):
    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


def _measured() -> Timeline:
    """A small measured-looking timeline: epoch seconds, with a SEND."""
    t0 = 1_700_000_000.0
    acts = [
        Action(0, 0, 0, "F", t0 + 0.0, t0 + 0.1), Action(0, 0, 1, "F", t0 + 0.1, t0 + 0.2),
        Action(0, 0, 0, "SEND", t0 + 0.1, t0 + 0.11),
        Action(1, 1, 0, "F", t0 + 0.12, t0 + 0.22), Action(1, 1, 1, "F", t0 + 0.22, t0 + 0.32),
        Action(1, 1, 0, "B", t0 + 0.32, t0 + 0.52), Action(1, 1, 1, "B", t0 + 0.52, t0 + 0.72),
        Action(0, 0, 0, "B", t0 + 0.54, t0 + 0.74), Action(0, 0, 1, "B", t0 + 0.74, t0 + 0.94),
    ]
    return Timeline(acts, source="measured", meta={"schedule": "GPipe", "pp_size": 2, "n_microbatches": 2})


@pytest.fixture(autouse=True)
def _no_global_state():
    before_figs = plt.get_fignums()
    before_rc = dict(matplotlib.rcParams)
    yield
    assert plt.get_fignums() == before_figs, "labkit.timeline.plot opened a pyplot figure"
    assert dict(matplotlib.rcParams) == before_rc, "labkit.timeline.plot changed rcParams"


def test_plot_timeline_by_rank():
    tl = simulate("1F1B", 3, 4)
    fig, ax = _ax()
    artists = plot_timeline(ax, tl)
    collections = [a for a in artists if isinstance(a, Collection)]
    idle = [c for c in collections if c.get_hatch()]
    bars = [c for c in collections if not c.get_hatch()]
    assert len(bars) == 3 * 2 and len(idle) == 3  # one broken_barh per (rank, kind); one hatched idle band per rank
    labels = [a for a in artists if isinstance(a, Text) and re.fullmatch(r"\d+[FBIW]\d+", a.get_text())]
    assert sorted(t.get_text() for t in labels) == sorted(f"{a.stage}{a.kind}{a.microbatch}" for a in tl.actions)
    m = tl.metrics()
    shares = [a.get_text() for a in artists if isinstance(a, Text) and a.get_text().startswith(" idle ")]
    assert shares == [f" idle {m['idle'][str(r)] / m['makespan']:.0%}" for r in range(3)]
    assert all(a.axes is ax for a in bars)
    lo, hi = ax.get_ylim()
    assert lo > hi  # row 0 (rank 0) on top
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert ax.get_xlabel() == "time (units)"
    title = ax.get_title()
    assert "of wall time" in title and "idle/busy" in title
    assert any(isinstance(a, Legend) for a in artists)


def test_plot_timeline_by_stage_and_options():
    tl = simulate("ZBVZeroBubble", 2, 4)
    fig, ax = _ax()
    artists = plot_timeline(ax, tl, by="stage", title="ZBV", label_microbatches=False, show_bubble=False,
                            legend=False)
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "stage 0 (rank 0)", "stage 1 (rank 1)", "stage 2 (rank 1)", "stage 3 (rank 0)"]
    assert not [a for a in artists if isinstance(a, Text) and re.fullmatch(r"\d+([FBIW]\d+)?", a.get_text())]
    assert ax.get_title() == "ZBV"
    colors = {tuple(c.get_facecolor()[0]) for c in artists if isinstance(c, Collection)}
    expected = {matplotlib.colors.to_rgba(KIND_COLORS[k]) for k in "FIW"}
    assert colors == expected
    with pytest.raises(ValueError, match="rank"):
        plot_timeline(ax, tl, by="microbatch")


def test_plot_measured_timeline_in_seconds():
    tl = _measured()
    fig, ax = _ax()
    artists = plot_timeline(ax, tl)
    assert ax.get_xlabel() == "time (s)"
    assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] < 1.0  # shifted to the first action
    send = [c for c in artists if isinstance(c, Collection) and len(c.get_facecolor())
            and tuple(c.get_facecolor()[0]) == matplotlib.colors.to_rgba(KIND_COLORS["SEND"])]
    assert len(send) == 1
    assert bubble_summary(tl) in ax.get_title()


def test_empty_timeline_draws_a_note():
    fig, ax = _ax()
    artists = plot_timeline(ax, Timeline([], source="theory"))
    assert any(isinstance(a, Text) and a.get_text() == "no actions" for a in artists)


def test_side_by_side_new_figure_saves_png(tmp_path):
    measured = _measured()
    ideal = simulate("GPipe", 2, 2, cost=fit_cost(measured))
    fig = plot_side_by_side(measured, ideal)
    assert isinstance(fig, Figure)
    top, bottom = fig.axes[:2]
    assert top.get_xlabel() == bottom.get_xlabel() == "time (s)"
    assert top.get_xlim() == bottom.get_xlim()  # one time scale: the gap to the ideal is visible
    assert "measured" in top.get_title() and "ideal" in bottom.get_title()
    out = tmp_path / "side.png"
    fig.savefig(out)
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_side_by_side_on_given_axes():
    fig = Figure()
    axes = fig.subplots(2, 1)
    got = plot_side_by_side(simulate("GPipe", 2, 4), simulate("1F1B", 2, 4), axes=axes)
    assert got is fig
    assert axes[0].collections and axes[1].collections
    with pytest.raises(ValueError, match="2 axes"):
        plot_side_by_side(simulate("GPipe", 2, 4), simulate("1F1B", 2, 4), axes=[axes[0]])


def test_bubble_sweep(tmp_path):
    ms = [1, 2, 4, 8]
    ideal = [simulate("GPipe", 4, m).metrics()["bubble_fraction"] for m in ms]
    measured = [simulate("GPipe", 4, m, cost=Cost(p2p=0.2)).metrics()["bubble_fraction"] for m in ms]
    measured[1] = None  # a run that failed is skipped, not drawn as zero
    fig, ax = _ax((5, 4))
    artists = plot_bubble_sweep(ax, ms, measured, ideal, pp_size=4)
    lines = {a.get_label(): a for a in artists if hasattr(a, "get_xdata")}
    assert list(lines["measured"].get_xdata()) == [1, 4, 8]
    assert list(lines["ideal (simulated)"].get_ydata()) == ideal
    assert any(label.startswith("closed form") for label in lines)
    assert "idle/(ranks x makespan)" in ax.get_ylabel()
    fig.savefig(tmp_path / "sweep.png")
    with pytest.raises(ValueError, match="values for 4"):
        plot_bubble_sweep(ax, ms, [0.1], None)


def test_kind_legend():
    fig, ax = _ax()
    leg = kind_legend(ax)
    assert isinstance(leg, Legend)
    assert [t.get_text() for t in leg.get_texts()] == [
        "F forward", "B backward", "I backward (inputs)", "W backward (weights)"]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_renders(name, tmp_path):
    spr = 2 if SCHEDULES[name].multi else 1
    tl = simulate(name, 2, 4, spr)
    fig = Figure(figsize=(10, 4))  # no constrained layout: it is the slow part of savefig
    ax1, ax2 = fig.subplots(2, 1)
    plot_timeline(ax1, tl)
    plot_timeline(ax2, tl, by="stage")
    out = tmp_path / f"{name}.png"
    fig.savefig(out, dpi=60)
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_narrow_bars_get_no_label_rather_than_a_cut_one():
    """By rank every label is torch's full `2I1`; a bar too narrow for it gets none (never `I1`, which
    reads as cut off beside `2I1` and does not say which of the rank's stages it is)."""
    tl = simulate("ZBVZeroBubble", 2, 8, 2, Cost(F=1, B=4))  # F 1 unit, I and W 2 units each
    fig, ax = _ax(figsize=(16, 2))  # room for `2I1` in I and W, not in F
    texts = [a.get_text() for a in plot_timeline(ax, tl, legend=False, show_bubble=False) if isinstance(a, Text)]
    labels = [t for t in texts if re.fullmatch(r"\d*[FBIW]\d+|\d+", t)]
    assert labels and all(re.fullmatch(r"\d+[FBIW]\d+", t) for t in labels), labels
    assert {t[1] for t in labels} == {"I", "W"}  # F bars were too narrow and went without
    wide_fig, wide_ax = _ax(figsize=(30, 2))  # room for every full label
    wide = [a.get_text() for a in plot_timeline(wide_ax, tl, legend=False, show_bubble=False) if isinstance(a, Text)]
    assert sorted(t for t in wide if re.fullmatch(r"\d+[FBIW]\d+", t)) == sorted(
        f"{a.stage}{a.kind}{a.microbatch}" for a in tl.compute())


def test_bar_labels_use_one_form_per_plot():
    """bar_labels: by rank only the full form; by stage the short form for every bar once one bar
    lacks room for the full one; a bar too narrow for the chosen form gets none."""
    from labkit.timeline.plot import bar_labels

    acts = [Action(0, 3, 0, "F", 0.0, 10.0), Action(0, 0, 1, "I", 10.0, 12.5), Action(0, 0, 2, "W", 12.5, 13.0)]
    # 0.65 * 7 pt per character + 2: `3F0` needs 15.65 pt, `I1` 11.1 pt; at 5 pt per unit: 50, 12.5 and 2.5 pt
    assert [label for _, label in bar_labels(acts, "rank", 5.0)] == ["3F0"]
    assert [label for _, label in bar_labels(acts, "stage", 5.0)] == ["F0", "I1"]
    assert [label for _, label in bar_labels(acts, "stage", 40.0)] == ["3F0", "0I1", "0W2"]
    assert [label for _, label in bar_labels(acts, "rank", 40.0)] == ["3F0", "0I1", "0W2"]
    fig, ax = _ax(figsize=(16, 2))  # as above: `2F1` does not fit in F, so no bar is labelled `2I1`
    tl = simulate("ZBVZeroBubble", 2, 8, 2, Cost(F=1, B=4))
    by_stage = [a.get_text() for a in plot_timeline(ax, tl, by="stage", legend=False, show_bubble=False)
                if isinstance(a, Text) and re.fullmatch(r"\d*[FBIW]\d+", a.get_text())]
    assert by_stage and all(re.fullmatch(r"[FBIW]\d+", t) for t in by_stage), by_stage


def test_plot_memory_per_rank_sums_the_ranks_stages():
    from labkit.timeline.plot import plot_memory

    tl = Timeline([Action(rank=0, stage=0, kind="F", microbatch=0, start=0.0, end=1.0),
                   Action(rank=0, stage=3, kind="F", microbatch=0, start=1.0, end=2.0),
                   Action(rank=0, stage=3, kind="B", microbatch=0, start=2.0, end=3.0),
                   Action(rank=0, stage=0, kind="B", microbatch=0, start=3.0, end=4.0)], source="measured")
    events = {0: [(1.0, 0, 64, None), (2.0, 3, 128, None), (3.0, 3, 0, None), (4.0, 0, 0, None)]}
    fig, ax = _ax()
    artists = plot_memory(ax, events, tl, planned={0: 192}, unit="B", by="rank")
    curves = [a for a in artists if hasattr(a, "get_ydata") and a.get_label() == "rank 0"]
    assert len(curves) == 1 and max(curves[0].get_ydata()) == 192
    assert ax.get_ylabel() == "activations held (bytes)" and "per rank" in ax.get_title()
    by_stage = plot_memory(_ax()[1], events, tl, unit="B")
    assert {a.get_label() for a in by_stage if hasattr(a, "get_ydata")} == {"stage 0", "stage 3"}
    with pytest.raises(ValueError):
        plot_memory(ax, events, tl, by="device")
