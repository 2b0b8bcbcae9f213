"""The explorer's logic as pure functions: what the panel shows for given controls or a finished run.

This module owns the explorer's views; `labkit.notebook.explorer` only wires them to widgets, so tests reach
every decision without a browser or a kernel (`tests/test_explorer.py`). Taught in notebook 07 (the
explorer) and used as a playground after notebooks 03 and 06.

- `validate`: the SAME checks as the command line (`RunConfig`, then the launcher's device check);
  an invalid combination comes back as the ConfigError's text.
- `theory_view`: the ideal timeline of the schedule and both bubble definitions, from
  `labkit.theory.simulate` (nothing is launched).
- `measured_view`: a run's measured timeline beside the ideal fitted to its costs, from
  `labkit.timeline.compare.measured_vs_ideal`.
- `summarize_run`, `status_line`, `history_table_html`: the table of runs and the status line.

matplotlib is imported only when a picture is made, so `import labkit` stays fast.
"""

from __future__ import annotations

import html
import io
import json
from functools import lru_cache
from pathlib import Path

from ..core.errors import ConfigError
from ..config.run import RunConfig
from ..schedules.table import schedule_info

__all__ = [
    "DEFAULT_CONTROLS", "CONTROL_NAMES", "validate", "stages_per_rank_for", "theory_view", "measured_view",
    "summarize_run", "status_line", "history_table_html", "timeline_png",
]

CONTROL_NAMES = ("schedule", "pp_size", "stages_per_rank", "n_microbatches", "split", "preset", "device")
# What a 2-core laptop runs in a few seconds (most of it torchrun starting two interpreters).
DEFAULT_CONTROLS = {"schedule": "GPipe", "pp_size": 2, "stages_per_rank": 1, "n_microbatches": 4,
                    "split": "manual", "preset": "small", "device": "auto"}
# The ideal timeline's costs for the WHOLE model on one microbatch; divided by stages_per_rank, so
# that schedules are compared at equal model size (theory.simulate's docstring explains why).
THEORY_F, THEORY_B = 1.0, 2.0

BUBBLE_FRACTION_NAME = "bubble_fraction = idle / (ranks x makespan), the idle share of wall time"
BUBBLE_RATIO_NAME = "bubble_ratio = idle / busy, idle over the ideal compute"


def validate(controls: dict, check_device: bool = True) -> tuple[RunConfig | None, str]:
    """(RunConfig, what will run) for valid controls, else (None, the ConfigError text).

    The same checks as `labkit run`: `RunConfig` itself, then (with `check_device`) the launcher's
    GPU count check for device "cuda".
    """
    unknown = set(controls) - set(CONTROL_NAMES)
    if unknown:
        return None, f"Unknown controls {sorted(unknown)}; the explorer knows {', '.join(CONTROL_NAMES)}."
    try:
        cfg = RunConfig(**controls)
        if check_device:
            from ..launching.launch import preflight_device, preflight_torch

            if cfg.device == "cuda":
                preflight_device(cfg.device, cfg.pp_size)
            preflight_torch()
    except ConfigError as e:
        return None, str(e)
    except TypeError as e:  # a control of the wrong type that RunConfig could not even take
        return None, f"Invalid controls: {e}"
    micro = cfg.batch_size // cfg.n_microbatches
    stages = "stage" if cfg.stages_per_rank == 1 else "stages"
    return cfg, (f"{cfg.schedule}: {cfg.pp_size} ranks x {cfg.stages_per_rank} {stages} per rank = "
                 f"{cfg.n_stages} stages of the {cfg.preset!r} model ({cfg.model.n_layers} layers); batch of "
                 f"{cfg.batch_size} cut into {cfg.n_microbatches} microbatches of {micro}; {cfg.split} split, "
                 f"device {cfg.device}.")


def stages_per_rank_for(schedule: str, current: int) -> int:
    """The stages_per_rank to show after picking `schedule`: 1 for GPipe/1F1B, 2 for V-shaped
    schedules, else the current value when it is 2 or more (multi-stage schedules need it)."""
    try:
        info = schedule_info(schedule)
    except ConfigError:
        return current
    if not info.multi:
        return 1
    if info.v_shaped:
        return 2
    return current if current >= 2 else 2


def _sizes(cfg) -> dict:
    """schedule, pp_size, n_microbatches, stages_per_rank from a RunConfig or a controls dict."""
    if isinstance(cfg, RunConfig):
        return {"schedule": cfg.schedule, "pp_size": cfg.pp_size, "n_microbatches": cfg.n_microbatches,
                "stages_per_rank": cfg.stages_per_rank}
    return {k: cfg.get(k, DEFAULT_CONTROLS[k]) for k in ("schedule", "pp_size", "n_microbatches", "stages_per_rank")}


def theory_view(cfg, png: bool = True) -> dict:
    """The ideal timeline of a RunConfig (or controls dict) and both bubble definitions, named.

    Keys: timeline, bubble_fraction, bubble_ratio, makespan, closed_form ({"fraction", "ratio"} for
    GPipe/1F1B, else None), note (torch's caveat, or ""), html (the panel text), png (bytes, or
    None with png=False), error (the reason no timeline could be made, else None).
    """
    s = _sizes(cfg)
    key = (str(s["schedule"]), s["pp_size"], s["n_microbatches"], s["stages_per_rank"])
    try:
        view = dict(_theory_cached(*key))
    except Exception as e:  # ConfigError/ScheduleError carry their own explanation
        return {"timeline": None, "bubble_fraction": None, "bubble_ratio": None, "makespan": None,
                "closed_form": None, "note": "", "png": None, "error": str(e),
                "html": f"<b>No ideal timeline:</b> {html.escape(str(e))}"}
    view["png"] = timeline_png(view["timeline"]) if png else None
    return view


@lru_cache(maxsize=128)
def _theory_cached(schedule: str, pp_size: int, n_microbatches: int, stages_per_rank: int) -> dict:
    from ..theory import Cost, closed_form_bubble, simulate

    info = schedule_info(schedule)
    spr = stages_per_rank
    cost = Cost(F=THEORY_F / spr, B=THEORY_B / spr)
    tl = simulate(info.name, pp_size, n_microbatches, spr, cost)
    m = tl.metrics()
    closed = None
    if not info.multi:
        closed = {"fraction": closed_form_bubble(pp_size, n_microbatches, "fraction"),
                  "ratio": closed_form_bubble(pp_size, n_microbatches, "ratio")}
    note = tl.meta.get("note", "")
    per_stage = "" if spr == 1 else f" (F={cost.F:g}, B={cost.B:g} per stage with {spr} stages per rank)"
    lines = [
        f"<b>Ideal {html.escape(info.name)}</b>, pp_size={pp_size}, {n_microbatches} microbatches, "
        f"{spr} stage{'s' if spr > 1 else ''} per rank:",
        f"<span class='pplab-ideal-fraction'>bubble_fraction <b>{m['bubble_fraction']:.1%}</b></span> "
        f"(idle / (ranks x makespan), the idle share of wall time); "
        f"<span class='pplab-ideal-ratio'>bubble_ratio <b>{m['bubble_ratio']:.2f}</b></span> "
        f"(idle / busy); makespan {m['makespan']:g} units.",
    ]
    if closed:
        lines.append(f"Closed form for {info.name}: (p-1)/(m+p-1) = {closed['fraction']:.1%}, "
                     f"(p-1)/m = {closed['ratio']:.2f}.")
    lines.append(f"Cost model: F={THEORY_F:g}, B={THEORY_B:g} units for the whole model on one microbatch"
                 f"{per_stage}, no p2p latency.")
    if note:
        lines.append(f"<b>Note:</b> {html.escape(note)}")
    return {"timeline": tl, "bubble_fraction": m["bubble_fraction"], "bubble_ratio": m["bubble_ratio"],
            "makespan": m["makespan"], "closed_form": closed, "note": note, "error": None,
            "html": "<br>".join(lines)}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, metadata={"Software": None})  # no version stamp: same bytes each time
    return buf.getvalue()


def timeline_png(timeline, width: float = 10.0) -> bytes:
    """One timeline (theory or measured) drawn by `labkit.timeline.plot.plot_timeline`, as PNG bytes."""
    from matplotlib.figure import Figure

    from ..timeline.plot import plot_timeline

    rows = max(len(timeline.ranks), 1)
    fig = Figure(figsize=(width, 1.3 + 0.4 * rows), layout="constrained")
    plot_timeline(fig.subplots(), timeline)
    return _png(fig)


def measured_view(run_dir, png: bool = True) -> dict:
    """The measured timeline of a run directory beside its ideal with the measured (fitted) costs.

    Both come from `labkit.timeline.compare.measured_vs_ideal`: the last step, waits shown as idle time (the
    bubble), and the run's shape from its result.json (else from its logs). Keys: measured, ideal
    (Timelines), measured_metrics, ideal_metrics, cost (the fitted `Cost`), html, png (measured
    above ideal, one time scale), error (why there is no timeline, else None).
    """
    from ..timeline.compare import measured_vs_ideal  # lazily: only once a job has run
    from ..theory import fit_cost

    empty = {"measured": None, "ideal": None, "measured_metrics": None, "ideal_metrics": None, "cost": None,
             "png": None}
    try:
        measured, ideal, summary = measured_vs_ideal(Path(run_dir))
    except Exception as e:  # no logs, a parser that cannot read them, a timeline without compute
        msg = f"{type(e).__name__}: {e}"
        return {**empty, "error": msg, "html": f"<b>No measured timeline:</b> {html.escape(msg)}"}
    for key in ("schedule", "pp_size", "n_microbatches"):  # the plot's labels, when the logs do not say
        if not measured.meta.get(key):
            measured.meta[key] = summary[key]
    cost = fit_cost(measured)  # the costs the ideal was simulated with, for the text
    mm, im = measured.metrics(), ideal.metrics()
    steps = measured.meta.get("steps") or 1
    costs = ", ".join(f"{k}={v * 1e3:.2f} ms" for k, v in (("F", cost.F), ("B", cost.B)) if v)
    if any(a.kind in ("I", "W") for a in measured.compute()):
        costs += f", I={cost.input_grad * 1e3:.2f} ms, W={cost.weight_grad * 1e3:.2f} ms"
    lines = [
        f"<b>Measured</b> ({steps} step{'s' if steps != 1 else ''}): "
        f"<span class='pplab-measured-fraction'>bubble_fraction <b>{mm['bubble_fraction']:.1%}</b></span> "
        f"(idle share of wall time), bubble_ratio <b>{mm['bubble_ratio']:.2f}</b> (idle / busy), "
        f"makespan {mm['makespan'] * 1e3:.1f} ms.",
        f"<b>Ideal with each stage's measured mean costs</b> (over all stages {costs}; "
        f"{html.escape(ideal.meta.get('cost_spread', ''))}; no p2p latency): bubble_fraction "
        f"<b>{im['bubble_fraction']:.1%}</b>, bubble_ratio <b>{im['bubble_ratio']:.2f}</b>, "
        f"makespan {im['makespan'] * 1e3:.1f} ms.",
    ]
    lines.append("Measured from spans: both ends of every action, recorded in the ranks (labkit.spans)."
                 if measured.source == "spans" else
                 "Measured from the PP logs, waits taken out (labkit.timeline.compare.load_timeline): "
                 "starts are inferred.")
    view = {"measured": measured, "ideal": ideal, "measured_metrics": mm, "ideal_metrics": im, "cost": cost,
            "error": None, "html": "<br>".join(lines), "png": None}
    if png:
        from ..timeline.plot import plot_side_by_side

        view["png"] = _png(plot_side_by_side(measured, ideal))
    return view


def _run_config(run) -> dict:
    try:
        return json.loads((Path(run.run_dir) / "config.json").read_text())
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def summarize_run(run, view: dict | None = None) -> dict:
    """One row of the history table from a finished `Run` (and its `measured_view`, if any)."""
    result = run.result or {}
    config = _run_config(run)

    def pick(key):
        return result.get(key, config.get(key))

    steps = result.get("step_time_s") or []
    mm = (view or {}).get("measured_metrics") or {}
    im = (view or {}).get("ideal_metrics") or {}
    return {
        "schedule": pick("schedule"), "pp_size": pick("pp_size"), "stages_per_rank": pick("stages_per_rank"),
        "n_microbatches": pick("n_microbatches"), "split": pick("split"), "preset": pick("preset"),
        "status": run.status, "reference_match": result.get("reference_match"),
        "measured_bubble_fraction": mm.get("bubble_fraction"), "measured_bubble_ratio": mm.get("bubble_ratio"),
        "ideal_bubble_fraction": im.get("bubble_fraction"), "ideal_bubble_ratio": im.get("bubble_ratio"),
        "step_time_s": steps[-1] if steps else None, "run_dir": str(run.run_dir),
    }


def status_line(run) -> tuple[str, str]:
    """(kind, sentence) for a finished run: kind is "ok", "mismatch", "interrupted" or "failed"."""
    result = run.result or {}
    match = result.get("reference_match")
    if run.status == "ok" and match:
        steps = result.get("step_time_s") or []
        t = f", step time {steps[-1]:.3f} s" if steps else ""
        return "ok", (f"ok: reference match (the pipelined step equals the unsplit model, max abs diff "
                      f"{result.get('max_abs_diff', 0):.1e}){t}")
    if match is False:
        return "mismatch", f"{run.status}: NO reference match ({result.get('failure') or 'see the log'})"
    if run.status == "interrupted":
        return "interrupted", f"interrupted: {run.error or 'stopped'}"
    return "failed", f"{run.status}: {run.error or 'the job failed'} (run directory {run.run_dir})"


def _fmt_bubble(fraction, ratio) -> str:
    if fraction is None:
        return "-"
    return f"{fraction:.1%} / {ratio:.2f}" if ratio is not None else f"{fraction:.1%}"


_CELL = " style='padding:2px 10px;border-bottom:1px solid #ddd;text-align:left'"


def history_table_html(rows: list[dict]) -> str:
    """An HTML table of runs (newest last), bubbles given as "bubble_fraction / bubble_ratio"."""
    if not rows:
        return "<p class='pplab-history-empty'>No runs yet: press Run to add one.</p>"
    names = ["#", "schedule", "pp_size", "stages/rank", "microbatches", "split", "status", "reference match",
             "measured bubble", "ideal bubble", "step time"]
    head = "<tr>" + "".join(f"<th{_CELL}>{n}</th>" for n in names) + "</tr>"
    body = []
    for i, r in enumerate(rows, 1):
        match = {True: "yes", False: "NO", None: "-"}[r.get("reference_match")]
        step = f"{r['step_time_s']:.3f} s" if r.get("step_time_s") is not None else "-"
        cells = [i, r.get("schedule"), r.get("pp_size"), r.get("stages_per_rank"), r.get("n_microbatches"),
                 r.get("split"), r.get("status"), match,
                 _fmt_bubble(r.get("measured_bubble_fraction"), r.get("measured_bubble_ratio")),
                 _fmt_bubble(r.get("ideal_bubble_fraction"), r.get("ideal_bubble_ratio")), step]
        tds = "".join(f"<td{_CELL}>{html.escape('-' if c is None else str(c))}</td>" for c in cells)
        body.append(f"<tr class='pplab-run-{html.escape(str(r.get('status')))}'>{tds}</tr>")
    return ("<table class='pplab-history-table' style='border-collapse:collapse'>"
            f"<thead>{head}</thead><tbody>{''.join(body)}</tbody></table>"
            "<small>bubble = bubble_fraction (idle share of wall time) / bubble_ratio (idle / busy); "
            "ideal = the schedule simulated with the run's measured mean F/B costs.</small>")
