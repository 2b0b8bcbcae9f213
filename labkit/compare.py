"""A measured run beside its ideal: load a run's timeline, find its shape, fit costs, simulate.

`measured_vs_ideal(run_dir)` is what `labkit timeline --plot`, the explorer, `%%ranks --timeline` (notebooks 04-05) and notebook 06
use: the measured timeline (spans where the run has them, else the PP logs or profiler traces), and the ideal timeline of
the same schedule with costs fitted from the measurement, with both bubble numbers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .config import schedule_info
from .timeline import Action, Timeline

SOURCES = ("auto", "spans", "logs", "profiler")

LOGS_NOTE = ("from torch's PP logs: GPipe and 1F1B log one line when an action ENDS and none when it starts, so "
             "a start there is inferred (the previous line, moved past the neighbour's send, then trimmed): "
             "overhead and waits between actions can read as compute. Spans measure both ends.")


def load_timeline(paths, source: str = "auto", trim: bool = True) -> Timeline:
    """The measured timeline of a run directory, a live-ranks cell directory, or log files.

    `source`: `spans` (both ends of every action measured in the rank: `labkit.spans`), `logs`
    (derived from torch's PP log lines), `profiler` (torch.profiler traces, `--profile`), or `auto`:
    spans where the run has them, else profiler traces, else the logs. The timeline's `source`
    says which it is ("spans", "profiler", or "measured" for the logs, with `meta["starts"]` saying
    why its starts are inferred).

    Log timelines have their waits taken out unless `trim=False` (the raw reading folds every wait
    into the next action and hides the bubble): `waits="trim"` of `labkit.logs.intervals`. On the
    controlled workload (actions of known length) they agree with the profiler within 0.03; on real
    models trimming can err either way (notebook 06), which is why spans are the default.
    """
    from .logs.intervals import timeline_from_path

    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if not isinstance(paths, (str, os.PathLike)):
        paths = list(paths)  # read an iterator once: it is used again below
    single = paths if isinstance(paths, (str, os.PathLike)) else (paths[0] if len(paths) == 1 else None)
    if source in ("spans", "auto"):
        from .spans.paths import span_files

        where = single if single is not None and Path(single).is_dir() else (Path(paths[0]).parent if paths else None)
        if where is not None and span_files(where):
            from .spans.read import timeline_from_spans

            return timeline_from_spans(where)
        if source == "spans":
            raise FileNotFoundError(f"No spans in {where}: runs recorded before spans existed, or a job whose "
                                    f"ranks never imported torch's pipelining. Use --source logs.")
    if source in ("profiler", "auto") and single is not None:
        from .logs.profiler import profile_files, timeline_from_profile

        if profile_files(single) or source == "profiler":
            return timeline_from_profile(single)
    tl = timeline_from_path(paths, waits="trim" if trim else "fold")
    tl.meta["starts"] = LOGS_NOTE
    return tl


@dataclass
class Shape:
    schedule: str
    pp_size: int
    n_microbatches: int
    stages_per_rank: int


def run_shape(tl: Timeline, run_dir: str | os.PathLike | None = None) -> Shape:
    """Schedule, ranks, microbatches and stages per rank of a run: from result.json, else from the timeline."""
    if run_dir is not None and (Path(run_dir) / "result.json").exists():
        r = json.loads((Path(run_dir) / "result.json").read_text())
        if all(k in r for k in ("schedule", "pp_size", "n_microbatches", "stages_per_rank")):
            return Shape(r["schedule"], r["pp_size"], r["n_microbatches"], r["stages_per_rank"])
    comp = tl.compute()
    if not comp:
        raise ValueError("The timeline has no compute actions: was the run logged with TORCH_LOGS=+pp?")
    name = tl.meta.get("schedule")
    if not name:
        raise ValueError("Cannot tell which schedule ran (no 'Using Schedule...' line): pass the run directory.")
    ranks = {a.rank for a in comp}
    n_stages = max(a.stage for a in comp) + 1
    return Shape(schedule_info(name).name, len(ranks), max(a.microbatch for a in comp) + 1, n_stages // len(ranks))


def one_step(tl: Timeline, which: str = "last") -> Timeline:
    """One step's actions: the `last` (warmed up, the default) or the `first` of a multi-step run."""
    steps = int(tl.meta.get("steps") or 1)
    if steps <= 1:
        return tl
    keep: list[Action] = []
    for r in tl.ranks:
        mine = sorted((a for a in tl.compute() if a.rank == r), key=lambda a: a.start)
        n = len(mine) // steps
        keep += mine[-n:] if which == "last" else mine[:n]
    return Timeline(sorted(keep, key=lambda a: (a.start, a.rank)), tl.source,
                    {**tl.meta, "steps": 1, "step": f"{which} of {steps}"})


def fitted_ideal(tl: Timeline, shape: Shape) -> Timeline:
    from .theory import fit_cost, simulate

    ideal = simulate(shape.schedule, shape.pp_size, shape.n_microbatches, shape.stages_per_rank, fit_cost(tl))
    ideal.meta["costs"] = "fitted"  # the plots' titles say so
    return ideal


def _run_order(path) -> dict | None:
    """The order a --schedule-csv run ran (result.json's `order`), or None."""
    res = Path(path) / "result.json"
    if not (Path(path).is_dir() and res.exists()):
        return None
    try:
        order = json.loads(res.read_text()).get("order")
    except ValueError:
        return None
    return {int(r): acts for r, acts in order.items()} if order else None


def order_ideal(tl: Timeline, order: dict) -> Timeline:
    """The ideal of a run whose order was given (--schedule-csv, labkit search): that order simulated
    with the costs fitted to the measurement (the search's prediction at the measured costs)."""
    from .theory import fit_cost, simulate_order

    ideal = simulate_order(order, cost=fit_cost(tl), meta={"schedule": "order from --schedule-csv"})
    ideal.meta["costs"] = "fitted"
    return ideal


def measured_vs_ideal(path, source: str = "auto") -> tuple[Timeline, Timeline, dict]:
    """(measured step, fitted ideal, summary) of a run directory (the last step of a multi-step run)."""
    measured = one_step(load_timeline(path, source))
    shape = run_shape(measured, path if Path(path).is_dir() else None)
    order = _run_order(path)
    ideal = fitted_ideal(measured, shape) if order is None else order_ideal(measured, order)
    m, i = measured.metrics(), ideal.metrics()
    summary = {"schedule": shape.schedule, "pp_size": shape.pp_size, "n_microbatches": shape.n_microbatches,
               "stages_per_rank": shape.stages_per_rank, "source": measured.source,
               "measured_bubble_fraction": m["bubble_fraction"], "ideal_bubble_fraction": i["bubble_fraction"],
               "measured_bubble_ratio": m["bubble_ratio"], "ideal_bubble_ratio": i["bubble_ratio"],
               "measured_makespan": m["makespan"], "ideal_makespan": i["makespan"]}
    return measured, ideal, summary
