"""A hung or crashed run drawn (`plot_stuck`): each rank's last actions before the job stopped, and the
action it was left in marked after them (hatched, to the right edge, named: what it waits for and from
which rank, "outside the schedule" with its frame, or that it had ended). The reading itself is
`labkit.timeline.stuck`; colours are `labkit.timeline.plot`'s. Takes an `ax`, draws on it, returns the
artists. Taught in notebook 09.

May import: labkit.core, labkit.timeline.
"""

from __future__ import annotations

from ..core.actions import COMPUTE_KINDS, Timeline
from .plot import KIND_COLORS, kind_legend

__all__ = ["plot_stuck", "open_label"]

OPEN_STYLE = {"facecolor": "none", "edgecolor": "#D55E00", "hatch": "xx", "linewidth": 1.2}
_QUIET = {"facecolor": "none", "edgecolor": "#7F7F7F", "hatch": "..", "linewidth": 0.8}


def open_label(state) -> str:
    """A short name for what a rank was left in (a `labkit.timeline.stuck.RankState`)."""
    act = state.action_words()
    if state.doing == "wait":
        waits = sorted(state.waits, key=lambda t: t.op != "recv")
        if not waits:
            return f"{act} waits" if act else "waits"
        t = waits[0]
        what = f"mb {t.mb} {t.what}" if t.mb is not None else t.what
        peer = f"rank {t.peer_rank}" if t.peer_rank is not None else f"stage {t.peer_stage}"
        return f"{act + ' ' if act else ''}waits: {'recv' if t.op == 'recv' else 'send'} {what} " \
               f"{'from' if t.op == 'recv' else 'to'} {peer}"
    if state.doing == "setup":
        return "first step's set-up: waits for every rank"
    if state.doing == "compute":
        return f"computes {act}" if act else "computes"
    if state.doing == "outside":
        return f"outside the schedule: {state.frame()}"
    if state.doing == "exited":
        return "ended" + (f" (exit code {state.exitcode})" if state.exitcode is not None else "")
    return state.doing


def plot_stuck(ax, stuck, timeline: Timeline | None = None, last: int = 8, title: str | None = None) -> list:
    """Each rank's `last` compute actions of `timeline` (a run's log timeline holds the hung step's
    actions too: `run.timeline("logs")`; spans stop at the last finished step) and, after them, the
    action `stuck` (`run.where_stuck()`) says it was left in, rank 0 on top. Times from the first action
    drawn. Returns the artists."""
    ranks = sorted(stuck.ranks)
    shown = _last_actions(timeline, ranks, last)
    ends = [a.end for acts in shown.values() for a in acts] + [s.last_time for s in stuck.ranks.values()
                                                              if s.last_time is not None]
    starts = [a.start for acts in shown.values() for a in acts]
    t0 = min(starts or ends or [0.0])
    t_end = max(ends or [t0 + 1.0])
    right = t_end + max(0.6 * (t_end - t0), 1e-3)  # room for the open action's name, inside its box
    artists: list = []
    for y, r in enumerate(ranks):
        for a in shown.get(r, []):
            artists.append(ax.broken_barh([(a.start - t0, a.end - a.start)], (y - 0.4, 0.8),
                                          facecolors=KIND_COLORS.get(a.kind, "#555555"), edgecolor="white",
                                          linewidth=0.6))
        s = stuck.ranks[r]
        begin = max([a.end for a in shown.get(r, [])] + ([s.last_time] if s.last_time is not None else [t0]))
        style = OPEN_STYLE if s.doing in ("wait", "setup") else _QUIET
        artists.append(ax.broken_barh([(begin - t0, right - begin)], (y - 0.4, 0.8), **style))
        artists.append(ax.text(right - t0, y, f"{open_label(s)} ", ha="right", va="center", fontsize="small",
                               bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5}))
    ax.set_xlim(0, (right - t0) * 1.02)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" + (f", step {stuck.ranks[r].step}" if stuck.ranks[r].step else "")
                        for r in ranks])
    ax.set_xlabel("time (s)")
    heading = title if title is not None else "where each rank was left (hatched: the action it was in)"
    if stuck.causes:
        heading += "\n" + _short(stuck.causes[0])
    artists.append(ax.set_title(heading, fontsize="medium"))
    present = [k for k in COMPUTE_KINDS if any(a.kind == k for acts in shown.values() for a in acts)]
    if present:
        artists.append(kind_legend(ax, present))
    return artists


def _last_actions(timeline: Timeline | None, ranks: list, last: int) -> dict:
    if timeline is None:
        return {}
    out = {}
    for r in ranks:
        mine = sorted((a for a in timeline.actions if a.rank == r and a.kind in COMPUTE_KINDS), key=lambda a: a.end)
        out[r] = mine[-last:]
    return out


def _short(text: str, n: int = 110) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
