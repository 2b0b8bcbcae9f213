"""Drawing the memory frontier (`labkit.theory.frontier`): one step's time against peak memory.

`plot_frontier(ax, data)` draws the searched orders as two step curves (one stage per rank, and
torch's V placement), torch's built-in schedules as labelled points, and optional measured steps
(name -> (peak, makespan in the same units)) as crosses; it returns the artists. Taught in notebook 13.
"""

from __future__ import annotations

MARKERS = {"1F1B": "s", "Interleaved1F1B": "D", "InterleavedZeroBubble": "^", "ZBVZeroBubble": "v",
           "DualPipeV": "P"}


def plot_frontier(ax, data: dict, *, measured: dict | None = None, title: str | None = None,
                  label_points: bool = True) -> list:
    """Draw `data` (from `labkit.theory.frontier.frontier`) on `ax`; return the artists drawn."""
    artists = []
    for key, label, color in (("searched", "searched, 1 stage per rank", "tab:blue"),
                              ("searched_v", "searched, V (2 stages per rank)", "tab:green")):
        pts = sorted((q["peak"], q["makespan"]) for q in data[key])
        if pts:
            xs, ys = zip(*pts)
            artists += ax.step(xs, ys, where="post", color=color, marker="o", ms=4, label=label)
    at: dict[tuple, list[str]] = {}  # schedules on the same point share one label
    for q in data["built_in"]:
        if "makespan" not in q:
            continue
        at.setdefault((q["peak"], q["makespan"]), []).append(q["name"])
        artists.append(ax.scatter([q["peak"]], [q["makespan"]], marker=MARKERS.get(q["name"], "o"), s=60,
                                  color="tab:red", edgecolor="black", zorder=3,
                                  label=None if label_points else q["name"]))
    if label_points:
        for (x, y), names in at.items():
            artists.append(ax.annotate("\n".join(names), (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8,
                                       va="bottom"))
    columns: dict[float, list[tuple[float, str]]] = {}  # measured steps at one peak: labels stacked 10 pt apart
    for name, (peak, makespan) in (measured or {}).items():
        artists.append(ax.scatter([peak], [makespan], marker="x", s=70, color="black", zorder=4))
        columns.setdefault(peak, []).append((makespan, name))
    for peak, points in columns.items():
        points.sort()
        for k, (makespan, name) in enumerate(points):
            artists.append(ax.annotate(f"{name} (measured)", (peak, makespan), textcoords="offset points",
                                       xytext=(-14, 10 * (k - (len(points) - 1) / 2)), ha="right", va="center",
                                       fontsize=7, arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "gray"}))
    artists.append(ax.axhline(data["busy"], color="gray", ls=":", lw=1, label="no idle time, M(F+I+W)"))
    ax.set_xlabel("peak activation memory per rank (1F1B stage microbatches; 1F1B holds P)")
    ax.set_ylabel("one step's makespan (units)")
    ax.set_title(title or f"P={data['pp_size']}, M={data['n_microbatches']}, per-action cost {data['per_action']:g}")
    ax.legend(fontsize=7, loc="upper right")
    return artists
