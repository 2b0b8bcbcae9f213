"""A measured run beside its ideal: load a run's timeline, find its shape, fit costs, simulate.

`measured_vs_ideal(run_dir)` is what `labkit timeline --plot`, the explorer, `%%ranks --timeline`
(notebooks 04-05) and notebook 06b use: the measured timeline (spans where the run has them, else the
PP logs or profiler traces), and the ideal timeline of the same schedule with costs fitted from the
measurement, stage by stage (the ideal of THIS step), with both bubble numbers and the ideal with one
cost per kind beside it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError
from ..schedules.table import schedule_info
from ..core.actions import COMPUTE_KINDS, Action, Timeline

SOURCES = ("auto", "spans", "logs", "profiler")

LOGS_NOTE = ("from torch's PP logs: GPipe and 1F1B log one line when an action ENDS and none when it starts, so "
             "a start there is inferred (the previous line, moved past the neighbour's send, then trimmed): "
             "overhead and waits between actions can read as compute. Spans measure both ends.")


def load_timeline(paths, source: str = "auto", trim: bool = True) -> Timeline:
    """The measured timeline of a run directory, a live-ranks cell directory, log files or profiler traces.

    `source`: `spans` (both ends of every action measured in the rank: `labkit.spans`), `logs`
    (derived from torch's PP log lines), `profiler` (torch.profiler traces, `--profile`), or `auto`,
    which decides by what `paths` hold: a directory gives its spans where the run has them, else its
    profiler traces, else its logs; files are read as what their content is (`labkit.logs.sniff`:
    a PP log in any format, plain or gzipped, or a Chrome trace), whatever their names, and anything
    else is refused with one ConfigError saying what was expected. The timeline's `source`
    says which it is ("spans", "profiler", or "measured" for the logs, with `meta["starts"]` saying
    why its starts are inferred).

    Log timelines have their waits taken out unless `trim=False` (the raw reading folds every wait
    into the next action and hides the bubble): `waits="trim"` of `labkit.logs.intervals`. On the
    controlled workload (actions of known length) they agree with the profiler within 0.03; on real
    models trimming can err either way (notebooks 06 and 06b), which is why spans are the default.
    """
    from ..logs.intervals import timeline_from_path
    from ..logs.sniff import EXPECTED

    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)  # an iterator is read once
    if not paths:
        raise ConfigError(f"No path given. {EXPECTED}")
    for p in paths:
        if not Path(p).exists():
            raise FileNotFoundError(f"{p} does not exist: pass a run directory, its log files or a profiler trace.")
    single = paths[0] if len(paths) == 1 else None
    in_dir = single is not None and Path(single).is_dir()
    if source == "auto" and not any(Path(p).is_dir() for p in paths):
        return _files_by_content(paths, trim)
    if source in ("spans", "auto"):
        from ..spans.paths import span_files

        where = single if in_dir else Path(paths[0]).parent
        if span_files(where):
            from ..spans.read import timeline_from_spans

            return timeline_from_spans(where)
        if source == "spans":
            raise FileNotFoundError(f"No spans in {where}: runs recorded before spans existed, or a job whose "
                                    f"ranks never imported torch's pipelining. Use --source logs.")
    if source in ("profiler", "auto") and single is not None:
        from ..logs.profiler import profile_files, timeline_from_profile

        if profile_files(single) or source == "profiler":
            return timeline_from_profile(single)
    if source == "auto" and in_dir:
        from ..logs.files import log_files

        if not log_files(single):
            raise FileNotFoundError(f"{single} holds no spans (spans/rank<N>.jsonl), no profiler traces "
                                    f"(profile/rank<N>.json) and no logs (logs/<id>/attempt_<n>/<rank>/stderr.log, "
                                    f"*.log, *.txt). {EXPECTED}")
    if source == "logs" and not any(Path(p).is_dir() for p in paths):
        from ..logs.sniff import file_kind, not_readable

        kinds = [(p, *file_kind(p)) for p in paths]
        if not any(kind == "log" for _, kind, _ in kinds):  # --source logs on a trace: say so, not an empty timeline
            p, kind, why = kinds[0]
            raise ConfigError(not_readable(p, why if kind is None else f"is {why}, not a PP log"))
    tl = timeline_from_path(paths, waits="trim" if trim else "fold")
    tl.meta["starts"] = LOGS_NOTE
    return tl


def _files_by_content(paths: list, trim: bool) -> Timeline:
    """`load_timeline(files, "auto")`: every file read as what it holds (`labkit.logs.sniff.file_kind`)."""
    from ..logs.intervals import timeline_from_path
    from ..logs.sniff import NO_PP_LINES, file_kind, not_readable

    found = {str(p): file_kind(p) for p in paths}
    kinds = {k for k, _ in found.values() if k}
    for p, (kind, why) in found.items():
        # beside other ranks' logs, a rank's log without pipelining lines is a rank that logged nothing
        if kind is None and not (kinds == {"log"} and why in (NO_PP_LINES, "is empty")):
            raise ConfigError(not_readable(p, why))
    if len(kinds) > 1:
        raise ConfigError("These files are of different kinds (" + "; ".join(
            f"{p}: {why}" for p, (_, why) in found.items()) + "): pass log files, profiler traces or a run "
            "directory, one kind at a time.")
    kind = kinds.pop()
    if kind == "trace":
        from ..logs.profiler import timeline_from_profile

        return timeline_from_profile(paths[0] if len(paths) == 1 else paths)
    if kind == "spans":
        if len(paths) > 1:
            raise ConfigError("Several spans files: pass the run or cell directory that holds them "
                              "(its spans/ folder).")
        from ..spans.read import timeline_from_spans

        return timeline_from_spans(paths[0])
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
    if n_stages % len(ranks):  # e.g. 2 stages on 4 ranks: several pipelines (pp x dp), not one
        raise ValueError(f"{len(ranks)} ranks ran {n_stages} stages: they form several pipelines (replicas, pp x dp), "
                         f"and this timeline does not say which ranks are in which (spans record it: rerun with "
                         f"the kit's spans on, then use Timeline.split_pipelines()).")
    return Shape(schedule_info(name).name, len(ranks), max(a.microbatch for a in comp) + 1, n_stages // len(ranks))


_OPENS = ("UNSHARD", "RECV")  # between two steps: these belong to the next one, the rest to the one before


def one_step(tl: Timeline, which: str = "last") -> Timeline:
    """One step's actions: the `last` (warmed up, the default) or the `first` of a multi-step run."""
    steps = int(tl.meta.get("steps") or 1)
    if steps <= 1:
        return tl
    keep: list[Action] = []
    for r, mine in _compute_by_rank(tl).items():
        n = len(mine) // steps
        if not n:
            continue
        kept = mine[-n:] if which == "last" else mine[:n]
        keep += kept
        # the step's other actions (transfers, FSDP's collectives): those among its computes, and between
        # two steps those that open a step (UNSHARD, a receive) or close one (REDUCE_GRAD, RESHARD, a send)
        c0, c1 = kept[0].start, max(a.end for a in kept)
        before = mine[-n - 1].end if which == "last" and len(mine) > n else float("-inf")
        after = mine[n].start if which != "last" and len(mine) > n else float("inf")
        keep += [a for a in tl.actions if a.rank == r and a.kind not in COMPUTE_KINDS and (
            c0 <= a.start < c1 or (before <= a.start < c0 and a.kind in _OPENS) or
            (c1 <= a.start < after and a.kind not in _OPENS))]
    return Timeline(sorted(keep, key=lambda a: (a.start, a.rank)), tl.source,
                    {**tl.meta, "steps": 1, "step": f"{which} of {steps}"}, tl.recorded)


def compute_steps(tl: Timeline) -> list[Timeline]:
    """Each step's compute actions, in order, of a multi-step run (each rank's actions cut into
    `steps` equal runs): per-step metrics, e.g. a median over steps that one disturbed step (a busy
    machine) cannot move. A single-step timeline is one step."""
    steps = int(tl.meta.get("steps") or 1)
    per_rank = _compute_by_rank(tl)
    out = []
    for i in range(steps):
        acts = [a for mine in per_rank.values() for a in mine[i * (len(mine) // steps):(i + 1) * (len(mine) // steps)]]
        out.append(Timeline(sorted(acts, key=lambda a: (a.start, a.rank)), tl.source,
                            {**tl.meta, "steps": 1, "step": f"{i + 1} of {steps}"}, tl.recorded))
    return out


def _compute_by_rank(tl: Timeline) -> dict[int, list[Action]]:
    """{rank: its compute actions in time order}: what `one_step` and `compute_steps` cut into steps."""
    return {r: sorted((a for a in tl.compute() if a.rank == r), key=lambda a: a.start) for r in tl.ranks}


def fitted_ideal(tl: Timeline, shape: Shape) -> Timeline:
    """The schedule's ideal with THIS step's costs: each stage's own mean F, B, I, W (`fit_stage_costs`),
    so uneven stages stay uneven in the ideal; `meta["cost_spread"]` says how far the stages differ."""
    from ..theory import fit_stage_costs, simulate

    costs = fit_stage_costs(tl)
    return _fitted(simulate(shape.schedule, shape.pp_size, shape.n_microbatches, shape.stages_per_rank, costs), costs)


def _fitted(ideal: Timeline, costs) -> Timeline:
    ideal.meta["costs"] = "fitted per stage"  # the plots' titles say so, with the spread
    ran = {a.kind for a in ideal.compute()}  # a schedule without I and W gets no I or W costs in its title
    ideal.meta["cost_spread"] = costs.spread_text(tuple(k for k in ("F", "B", "I", "W") if k in ran))
    return ideal


def uniform_ideal(tl: Timeline, shape: Shape) -> Timeline:
    """The schedule's ideal with one cost per kind (the mean over all stages: `fit_cost`), what the
    closed forms assume; `fitted_ideal` is this step's own."""
    from ..theory import fit_cost, simulate

    ideal = simulate(shape.schedule, shape.pp_size, shape.n_microbatches, shape.stages_per_rank, fit_cost(tl))
    ideal.meta["costs"] = "fitted"
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
    from ..theory import fit_stage_costs, simulate_order

    costs = fit_stage_costs(tl)
    return _fitted(simulate_order(order, cost=costs, meta={"schedule": "order from --schedule-csv"}), costs)


def measured_vs_ideal(path, source: str = "auto") -> tuple[Timeline, Timeline, dict]:
    """(measured step, fitted ideal, summary) of a run directory (the last step of a multi-step run).
    A run whose ranks form several pipelines (pp x dp) has one ideal per pipeline: `measured_vs_ideal_by_pipeline`."""
    views = measured_vs_ideal_by_pipeline(path, source)
    if len(views) > 1:
        raise ValueError(f"This run's ranks form {len(views)} pipelines ("
                         + "; ".join("ranks " + ", ".join(map(str, v[2]["ranks"])) for v in views)
                         + "): each has its own ideal. Use labkit.timeline.compare.measured_vs_ideal_by_pipeline(path) "
                           "(`labkit timeline RUN --plot` draws each).")
    return views[0]


def measured_vs_ideal_by_pipeline(path, source: str = "auto") -> list[tuple[Timeline, Timeline, dict]]:
    """[(measured step, fitted ideal, summary)] of a run directory, one per pipeline (replica) its ranks
    formed (one for a plain pipeline): `pipelines_vs_ideal` of its last step. Notebook 12."""
    measured = one_step(load_timeline(path, source))
    return pipelines_vs_ideal(measured, path if Path(path).is_dir() else None)


def pipelines_vs_ideal(measured: Timeline, run_dir=None) -> list[tuple[Timeline, Timeline, dict]]:
    """Each pipeline of a measured step (`Timeline.split_pipelines`: the groups the ranks recorded, or
    result.json's `pipelines`) beside its own ideal, the costs fitted to that pipeline alone. The
    ideal's ranks are the pipeline's (its i-th rank is the pipeline's i-th: its process group's order)."""
    with_pipelines(measured, run_dir)
    order = _run_order(run_dir) if run_dir is not None else None
    views = []
    for index, part in enumerate(measured.split_pipelines()):
        ranks = part.pipelines[0] if part.actions else []
        shape = run_shape(part, run_dir)
        ideal = fitted_ideal(part, shape) if order is None else order_ideal(part, order)
        if len(measured.pipelines) > 1:
            ideal = _on_ranks(ideal, ranks)
            ideal.meta["pipeline"], ideal.meta["pipelines"] = index, [list(ranks)]
        m, i = part.metrics(), ideal.metrics()
        summary = {"schedule": shape.schedule, "pp_size": shape.pp_size, "n_microbatches": shape.n_microbatches,
                   "stages_per_rank": shape.stages_per_rank, "source": part.source,
                   "measured_bubble_fraction": m["bubble_fraction"], "ideal_bubble_fraction": i["bubble_fraction"],
                   "measured_bubble_ratio": m["bubble_ratio"], "ideal_bubble_ratio": i["bubble_ratio"],
                   "measured_makespan": m["makespan"], "ideal_makespan": i["makespan"],
                   "cost_spread": ideal.meta.get("cost_spread", "")}
        if order is None:  # the same schedule with one cost per kind: what the closed forms describe
            summary["uniform_ideal_bubble_fraction"] = uniform_ideal(part, shape).metrics()["bubble_fraction"]
        if len(measured.pipelines) > 1:
            summary = {"pipeline": index, "ranks": list(ranks), **summary}
        views.append((part, ideal, summary))
    return views


def with_pipelines(tl: Timeline, run_dir=None) -> Timeline:
    """`tl` with the pipelines its run recorded: the spans' own (already in `tl.meta`), else a run
    directory's result.json `pipelines` (a `labkit run --dp-size/--tp-size` run: read from its mesh),
    for timelines read from its logs or profiler traces. Never guessed from the shape."""
    if "pipelines" not in tl.meta and run_dir is not None and Path(run_dir).is_dir() \
            and (Path(run_dir) / "result.json").exists():
        try:
            recorded = json.loads((Path(run_dir) / "result.json").read_text()).get("pipelines")
        except ValueError:
            recorded = None
        if recorded and len(recorded) > 1:
            tl.meta["pipelines"] = recorded
    return tl


def _on_ranks(ideal: Timeline, ranks: list[int]) -> Timeline:
    """The ideal with its ranks 0..p-1 named as the pipeline's global ranks (the rows then read alike)."""
    if len(set(a.rank for a in ideal.actions)) > len(ranks):
        return ideal
    acts = [a._replace(rank=ranks[a.rank]) for a in ideal.actions]
    return Timeline(acts, ideal.source, dict(ideal.meta))
