"""Matplotlib drawings of pipeline timelines: per-rank bars, measured vs ideal, bubble sweeps.

This module owns how a `Timeline` looks. Every helper takes an `ax`, draws on it and returns the
artists it made (matplotlib's `my_plotter(ax, ...)` pattern); none calls `plt.show()` or touches
global rcParams. `plot_side_by_side` builds a `matplotlib.figure.Figure` without pyplot, so a
notebook shows it once (return it from the cell) and tests can `savefig` it headless.
Taught in notebooks 03 (bubbles), 05 (reading a measured timeline) and 06 (measured vs ideal).

Colours are fixed per action kind, from the Okabe-Ito palette (safe for the common colour-vision
deficiencies): F blue, B vermillion, I dark bluish green and W the same hue much lighter (the two
halves of a split backward differ in lightness, so they stay apart in greyscale too), SEND/RECV grey.
Each bar is labelled like torch's actions (`2F1`: stage 2, forward, microbatch 1) where it fits; a bar
too narrow for it gets no label (drawn by stage, where the row names the stage, a plot whose bars
do not all fit `2F1` labels every bar `F1` instead: one form per plot, never a bare number);
idle time is drawn hatched, with each rank's idle share at the right; the title says where the
timeline comes from (spans, both ends of every action measured in the ranks; a profiler trace;
torch's logs, with inferred starts; or simulated, with fitted or nominal costs).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..core.errors import ConfigError
from ..schedules.table import schedule_info
from ..theory import closed_form_bubble
from ..core.actions import COMM_KINDS, COMPUTE_KINDS, FSDP_KINDS, Timeline

__all__ = ["KIND_COLORS", "KIND_LABELS", "bubble_summary", "kind_legend", "plot_timeline", "plot_side_by_side",
           "plot_pipelines", "plot_bubble_sweep", "plot_step_times", "plot_memory"]

STAGE_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")

KIND_COLORS = {"F": "#0072B2", "B": "#D55E00", "I": "#00735A", "W": "#9ADBC5", "SEND": "#7F7F7F", "RECV": "#C7C7C7",
               "UNSHARD": "#E69F00", "RESHARD": "#F0E442", "REDUCE_GRAD": "#CC79A7"}
KIND_LABELS = {"F": "F forward", "B": "B backward", "I": "I backward (inputs)", "W": "W backward (weights)",
               "SEND": "SEND", "RECV": "RECV", "UNSHARD": "UNSHARD (FSDP all-gather)", "RESHARD": "RESHARD (FSDP free)",
               "REDUCE_GRAD": "REDUCE_GRAD (FSDP reduce-scatter)"}
_TEXT_COLORS = {"F": "white", "B": "white", "I": "white", "W": "black"}
IDLE_STYLE = {"facecolor": "none", "edgecolor": "#B0B0B0", "hatch": "////", "linewidth": 0}
_LABEL_FONTSIZE = 7


def _unit(timeline: Timeline) -> str:
    if timeline.source == "theory":
        return timeline.meta.get("unit", "units")
    return "s"  # spans, pp logs and profiler traces are in seconds


def bubble_summary(timeline: Timeline) -> str:
    """Both bubble definitions, named: the line the plots print under their title."""
    m = timeline.metrics()
    return (f"bubble {m['bubble_fraction']:.1%} of wall time (idle/(ranks x makespan)), "
            f"idle/busy {m['bubble_ratio']:.2f}")


def _default_title(timeline: Timeline) -> str:
    meta = timeline.meta
    what = {"theory": "ideal", "profiler": "measured (profiler trace)", "spans": "measured (spans)"}.get(
        timeline.source, "measured (torch's logs)")
    if timeline.source == "theory":
        what = {"fitted": "ideal (simulated, costs fitted to the measured run)",
                "fitted per stage": "ideal (simulated, each stage's costs fitted to the measured step)"}.get(
            meta.get("costs"), "ideal (simulated)")
    name = meta.get("schedule")
    if name:
        try:  # logs name the class (ScheduleDualPipeV); the kit's short name reads better
            name = schedule_info(str(name)).name
        except ConfigError:
            pass
    parts = [f"{name} {what}" if name else f"{what} timeline"]
    if meta.get("pp_size"):
        parts.append(f"pp_size={meta['pp_size']}")
    if meta.get("n_microbatches"):
        parts.append(f"{meta['n_microbatches']} microbatches")
    if meta.get("cost_spread"):  # how far the stages of the measured step differ
        return ", ".join(parts) + f"\n{meta['cost_spread']}"
    return ", ".join(parts)


def kind_legend(ax, kinds: Sequence[str] = COMPUTE_KINDS, idle: bool = False, **kwargs):
    """A legend of the action colours (outside the axes, on the right, unless `loc` is given);
    `idle` adds the hatched idle time."""
    handles = [Patch(facecolor=KIND_COLORS[k], label=KIND_LABELS[k]) for k in kinds]
    if idle:
        handles.append(Patch(**IDLE_STYLE, label="idle"))
    if "loc" not in kwargs:
        kwargs.update(loc="upper left", bbox_to_anchor=(1.07, 1.0), borderaxespad=0.0)
    kwargs.setdefault("fontsize", "small")
    kwargs.setdefault("frameon", False)
    return ax.legend(handles=handles, **kwargs)


def plot_timeline(ax, timeline: Timeline, by: str = "rank", title: str | None = None,
                  label_microbatches: bool = True, show_bubble: bool = True, legend: bool = True) -> list:
    """One row per rank (or per stage), one bar per action, rank 0 on top. Returns the artists.

    Times are drawn from the first action (so measured runs start at 0). The bubble (both
    definitions) goes under the title when `show_bubble`.
    """
    if by not in ("rank", "stage"):
        raise ValueError(f"by must be 'rank' or 'stage', got {by!r}.")
    t = timeline.shifted()
    artists: list = []
    unit = _unit(t)
    ax.set_xlabel(f"time ({unit})")
    heading = _default_title(t) if title is None else title
    if not t.actions:
        artists.append(ax.text(0.5, 0.5, "no actions", ha="center", va="center", transform=ax.transAxes))
        artists.append(ax.set_title(heading))
        return artists

    key = (lambda a: a.rank) if by == "rank" else (lambda a: a.stage)
    rows = sorted({key(a) for a in t.actions})
    row_y = {r: i for i, r in enumerate(rows)}
    stage_rank = {a.stage: a.rank for a in t.compute()}

    makespan = max(a.end for a in t.actions)
    if show_bubble and makespan > 0:  # idle time: hatched under the bars; per rank, its share at the right
        metrics = t.metrics()
        for row in rows:
            artists.append(ax.broken_barh([(0, makespan)], (row_y[row] - 0.4, 0.8), **IDLE_STYLE, zorder=0))
            if by == "rank" and str(row) in metrics["idle"] and metrics["makespan"] > 0:
                share = metrics["idle"][str(row)] / metrics["makespan"]
                artists.append(ax.text(1.0, row_y[row], f" idle {share:.0%}", transform=ax.get_yaxis_transform(),
                                       ha="left", va="center", fontsize="small", color="#555555"))

    groups: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for a in t.actions:
        groups[(key(a), a.kind)].append((a.start, a.duration))
    for (row, kind), xranges in sorted(groups.items()):
        y = row_y[row]
        if kind not in COMPUTE_KINDS:  # transfers, FSDP collectives: a thin strip that must not hide compute
            yrange, style = (y + 0.25, 0.15), {"linewidth": 0}
        else:
            yrange, style = (y - 0.4, 0.8), {"edgecolor": "white", "linewidth": 0.6}
        artists.append(ax.broken_barh(xranges, yrange, facecolors=KIND_COLORS.get(kind, "#555555"), **style))

    ax.set_xlim(0, makespan * 1.01 if makespan > 0 else 1)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # row 0 on top, without invert_yaxis (which toggles)
    ax.set_yticks(range(len(rows)))
    if by == "rank":
        ax.set_yticklabels([f"rank {r}" for r in rows])
    else:
        ax.set_yticklabels([f"stage {s}" + (f" (rank {stage_rank[s]})" if s in stage_rank else "") for s in rows])
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)

    if label_microbatches and makespan > 0:
        for a, label in bar_labels(t.compute(), by, _pt_per_unit(ax, makespan)):
            artists.append(ax.text(a.start + a.duration / 2, row_y[key(a)], label, ha="center", va="center",
                                   fontsize=_LABEL_FONTSIZE, color=_TEXT_COLORS.get(a.kind, "black")))
    if show_bubble:
        heading = f"{heading}\n{bubble_summary(t)}"
    artists.append(ax.set_title(heading, fontsize="medium"))
    if legend:
        present = [k for k in (*COMPUTE_KINDS, *COMM_KINDS, *FSDP_KINDS) if any(a.kind == k for a in t.actions)]
        artists.append(kind_legend(ax, present, idle=show_bubble))
    return artists


def _pt_per_unit(ax, makespan: float) -> float:
    """Points on the page per unit of time on `ax` (its x range is the makespan plus 1%)."""
    return ax.get_window_extent().width * 72.0 / ax.figure.dpi / (makespan * 1.01)


def bar_labels(actions, by: str, pt_per_unit: float) -> list:
    """(action, label) for the bars wide enough for a label, in one form per plot: a bar reading `F1`
    beside bars reading `0F1` looks cut off.

    By rank every label is torch's `2F1` (a rank may hold several stages: `F1` would not say which);
    a bar too narrow for it gets none. By stage the row already names the stage: if any bar is too
    narrow for `2F1`, every bar gets the short `F1`, and a bar too narrow even for that gets none.
    """
    def fits(a, label):
        return a.duration * pt_per_unit >= 0.65 * _LABEL_FONTSIZE * len(label) + 2

    actions = list(actions)
    labels = [f"{a.stage}{a.kind}{a.microbatch}" for a in actions]
    if by == "stage" and not all(fits(a, label) for a, label in zip(actions, labels)):
        labels = [f"{a.kind}{a.microbatch}" for a in actions]
    return [(a, label) for a, label in zip(actions, labels) if fits(a, label)]


def plot_side_by_side(measured: Timeline, ideal: Timeline, axes=None, by: str = "rank") -> Figure:
    """Measured timeline above, ideal below; one time scale when both are in the same unit.

    Returns the Figure (a new one without pyplot, or the one holding `axes`).
    """
    if axes is None:
        n_rows = len({a.rank if by == "rank" else a.stage for a in measured.actions}) + \
            len({a.rank if by == "rank" else a.stage for a in ideal.actions})
        fig = Figure(figsize=(11, 2.2 + 0.45 * max(n_rows, 2)), layout="constrained")
        axes = fig.subplots(2, 1)
    else:
        if len(axes) != 2:
            raise ValueError(f"plot_side_by_side draws on 2 axes (measured, ideal), got {len(axes)}.")
        fig = axes[0].figure
    plot_timeline(axes[0], measured, by=by)
    plot_timeline(axes[1], ideal, by=by)
    if _unit(measured) == _unit(ideal) and measured.actions and ideal.actions:
        right = max(axes[0].get_xlim()[1], axes[1].get_xlim()[1])
        for ax in axes:
            ax.set_xlim(0, right)
    return fig


def plot_pipelines(views) -> Figure:
    """Each pipeline (replica) of a run, its measured step above its own fitted ideal: `views` as
    `labkit.timeline.compare.pipelines_vs_ideal` gives them ([(measured, ideal, summary)], one per pipeline).
    One time scale for all panels in the same unit. Returns a new Figure (notebook 12)."""
    views = list(views)
    if not views:
        raise ValueError("plot_pipelines needs at least one (measured, ideal, summary) view.")
    if len(views) == 1:
        return plot_side_by_side(views[0][0], views[0][1])
    rows = [len({a.rank for a in tl.actions}) for m, i, _ in views for tl in (m, i)]
    fig = Figure(figsize=(11, 1.6 * len(rows) + 0.45 * sum(rows)), layout="constrained")
    axes = fig.subplots(len(rows), 1)
    for k, (measured, ideal, summary) in enumerate(views):
        name = f"pipeline {summary.get('pipeline', k)} (ranks {', '.join(map(str, summary.get('ranks', [])))}): "
        plot_timeline(axes[2 * k], measured, title=name + _default_title(measured))
        plot_timeline(axes[2 * k + 1], ideal, title=name + _default_title(ideal))
    timed = [ax for ax, tl in zip(axes, (tl for m, i, _ in views for tl in (m, i))) if tl.actions]
    if len({_unit(tl) for m, i, _ in views for tl in (m, i)}) == 1 and timed:
        right = max(ax.get_xlim()[1] for ax in timed)
        for ax in timed:
            ax.set_xlim(0, right)
    return fig


def plot_bubble_sweep(ax, ms: Sequence[int], measured: Sequence[float | None] | None,
                      ideal: Sequence[float | None] | None, pp_size: int | None = None,
                      definition: str = "fraction") -> list:
    """Bubble against the number of microbatches: measured, simulated ideal, and (with `pp_size`)
    the GPipe/1F1B closed form. Values are in the given `definition` ("fraction" or "ratio")."""
    artists: list = []
    ms = list(ms)
    if pp_size is not None:  # drawn first, wide and pale: an ideal that matches it shows on top of it
        curve = [closed_form_bubble(pp_size, m, definition) for m in ms]
        formula = "(p-1)/(m+p-1)" if definition == "fraction" else "(p-1)/m"
        artists.extend(ax.plot(ms, curve, color="#BBBBBB", linewidth=5, solid_capstyle="round",
                               label=f"closed form {formula}, p={pp_size}"))
    for values, style in ((measured, {"marker": "o", "label": "measured", "color": "#C44E52"}),
                          (ideal, {"marker": "s", "label": "ideal (simulated)", "color": "#4C72B0",
                                   "linestyle": "--"})):
        if values is None:
            continue
        values = list(values)
        if len(values) != len(ms):
            raise ValueError(f"{style['label']} has {len(values)} values for {len(ms)} microbatch counts.")
        pts = [(m, v) for m, v in zip(ms, values) if v is not None]
        if pts:
            artists.extend(ax.plot([m for m, _ in pts], [v for _, v in pts], **style))
    ax.set_xlabel("microbatches (n_microbatches)")
    ax.set_ylabel("bubble: idle/(ranks x makespan)" if definition == "fraction" else "bubble: idle/busy")
    ax.set_xticks(ms)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    artists.append(ax.legend(fontsize="small"))
    return artists


def plot_step_times(ax, measured: dict[int, Sequence[float]], ideal: dict[int, float],
                    batch_only: dict[int, float] | None = None, unit: str = "s") -> list:
    """Step time against the number of microbatches: each m's measured steps (median, with a bar
    from the fastest to the slowest), the ideal with the fitted per-action cost, and (`batch_only`)
    the ideal without it. Returns the artists (notebook 05)."""
    ms = sorted(measured)
    artists: list = []
    if batch_only:
        artists.extend(ax.plot(sorted(batch_only), [batch_only[m] for m in sorted(batch_only)], color="#BBBBBB",
                               linewidth=4, solid_capstyle="round", label="ideal, batch's share only"))
    artists.extend(ax.plot(sorted(ideal), [ideal[m] for m in sorted(ideal)], marker="s", linestyle="--",
                           color="#4C72B0", label="ideal + fitted cost per action"))
    mid = [sorted(measured[m])[len(measured[m]) // 2] for m in ms]
    low = [mid[i] - min(measured[m]) for i, m in enumerate(ms)]
    high = [max(measured[m]) - mid[i] for i, m in enumerate(ms)]
    artists.append(ax.errorbar(ms, mid, yerr=[low, high], marker="o", color="#C44E52", capsize=3,
                               label="measured (median, min-max)"))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("microbatches m")
    ax.set_ylabel(f"step time ({unit})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    artists.append(ax.legend(fontsize="small"))
    return artists


def plot_memory(ax, events: dict, timeline: Timeline, planned: dict[int, int] | None = None,
                unit: str = "KiB", by: str = "stage") -> list:
    """Measured activation memory under a timeline: bytes held for the backward over the step (a
    `memory.SavedTensorTracker`'s events, `{rank: [(time, stage, bytes held by that stage, allocated)]}`),
    on the timeline's time axis (0 = its first action). `by="stage"`: one curve per stage; `by="rank"`:
    one per rank, the sum of its stages (what a device must hold when a rank has several stages, the V
    placement). `planned`: `{stage or rank: bytes}` drawn dashed, e.g. microbatches in flight times one
    microbatch's bytes (`orders.rank_peak_bytes` per rank). Returns the artists."""
    if by not in ("rank", "stage"):
        raise ValueError(f"by must be 'rank' or 'stage', got {by!r}.")
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20}[unit]
    t0 = min(a.start for a in timeline.actions) if timeline.actions else 0.0
    end = max(a.end for a in timeline.actions) - t0 if timeline.actions else 0.0
    curves: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for rank, evs in events.items():
        now: dict[int, int] = {}  # per stage, what it holds after each event of this rank
        for t, stage, held, _allocated in sorted(evs, key=lambda e: e[0]):
            now[stage] = held
            if by == "stage":
                curves[stage].append((t - t0, held))
            else:
                curves[int(rank)].append((t - t0, sum(now.values())))
    artists: list = []
    for key in sorted(curves):
        pts = sorted(curves[key], key=lambda p: p[0])
        xs = [0.0] + [t for t, _ in pts] + [max(end, pts[-1][0])]
        ys = [0.0] + [h / scale for _, h in pts] + [pts[-1][1] / scale]
        color = STAGE_COLORS[key % len(STAGE_COLORS)]
        artists.extend(ax.step(xs, ys, where="post", color=color, linewidth=1.6, label=f"{by} {key}"))
        if planned and key in planned:
            artists.append(ax.axhline(planned[key] / scale, color=color, linestyle="--", linewidth=1,
                                      label=f"{by} {key} planned peak"))
    ax.set_xlim(0, end * 1.01 if end > 0 else 1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"time ({_unit(timeline)})")
    ax.set_ylabel("activations held" + (" (bytes)" if unit == "B" else f" ({unit})"))
    ax.grid(alpha=0.3)
    artists.append(ax.set_title(f"activations held for the backward, per {by} (measured: saved-tensor hooks)",
                                fontsize="medium"))
    artists.append(ax.legend(loc="upper left", bbox_to_anchor=(1.07, 1.0), borderaxespad=0.0, fontsize="small",
                             frameon=False))
    return artists


CAUSE_COLOURS = {"fill / drain": "#DDDDDD", "waiting for a neighbour": "#56B4E9", "sends and receives": "#999999",
                 "instrument overhead": "#F0E442", "descheduled: the machine was busy": "#CC79A7",
                 "runtime overhead": "#E69F00", "descheduled inside actions": "#882255"}


def plot_idle_causes(ax, reports: dict, title: str | None = None) -> list:
    """One horizontal bar per idle report (`{label: IdleReport}`, e.g. {"idle machine": a, "busy
    loops": b}): the step's idle share split by cause (`labkit.spans.idle`), then, hatched, the
    share its ranks were descheduled inside their actions (not idle: the actions ran slower). What a
    busy machine adds shows as the pink parts (notebook 06b)."""
    artists, labels = [], list(reports)
    seen = set()
    for y, label in enumerate(labels):
        rep, left = reports[label], 0.0
        parts = [(c, rep.total(c)) for c in rep.causes]
        if rep.descheduled_in_actions:
            parts.append(("descheduled inside actions",
                          sum(rep.descheduled_in_actions.values()) / (len(rep.idle) * rep.makespan)))
        for cause, share in parts:
            if share <= 0:
                continue
            artists.append(ax.barh(y, share, left=left, color=CAUSE_COLOURS.get(cause, "#777777"),
                                   hatch="//" if cause == "descheduled inside actions" else None, edgecolor="white",
                                   label=cause if cause not in seen else None))
            seen.add(cause)
            left += share
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("share of ranks x step")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    if title:
        ax.set_title(title)
    artists.append(ax.legend(fontsize="small", loc="lower right"))
    return artists
