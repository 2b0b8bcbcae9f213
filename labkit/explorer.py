"""The explorer: one ipywidgets panel to pick a schedule and sizes, see the ideal timeline, and run it.

This module owns the explorer widget. Its logic lives in pure functions that tests reach without a
browser or a kernel (`validate`, `theory_view`, `measured_view`, `summarize_run`, `status_line`,
`history_table_html`); the `Explorer` class only wires them to widgets. Taught in notebook 07
(the explorer) and used as a playground after notebooks 03 and 06.

- Theory answers instantly as the controls move: the ideal timeline of the schedule and both bubble
  definitions, from `labkit.theory.simulate` (no job is launched).
- Run launches a real job (`labkit.launch.run`) in a background thread with live output and a
  progress bar, then draws the measured timeline (torch's own pipelining logs, `labkit.pplog`) above
  the ideal one fitted to the measured costs, and adds a row to a table of the runs made so far.
  Stop ends the job cleanly (every rank stopped, the run marked "interrupted").
- Invalid combinations are explained with the SAME validation as the command line (`RunConfig`,
  then the launcher's device check) and Run stays disabled.

Displaying the panel launches nothing and prints nothing: safe in notebooks tested with nbval.
ipywidgets and matplotlib are imported only when a panel or a picture is made, so `import labkit`
stays fast and works without the `lab` extra.
"""

from __future__ import annotations

import html
import io
import json
import threading
import time
import traceback
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from .config import DEVICES, PRESETS, SCHEDULES, SPLIT_MODES, ConfigError, RunConfig, schedule_info

__all__ = [
    "DEFAULT_CONTROLS", "CONTROL_NAMES", "Explorer", "explorer", "validate", "stages_per_rank_for",
    "theory_view", "measured_view", "summarize_run", "status_line", "history_table_html", "timeline_png",
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


# --------------------------------------------------------------------------------------------------
# Pure logic (tested in tests/test_explorer.py)
# --------------------------------------------------------------------------------------------------

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
        if check_device and cfg.device == "cuda":
            from .launch import preflight_device

            preflight_device(cfg.device, cfg.pp_size)
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
    from .theory import Cost, closed_form_bubble, simulate

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
    """One timeline (theory or measured) drawn by `labkit.plot.plot_timeline`, as PNG bytes."""
    from matplotlib.figure import Figure

    from .plot import plot_timeline

    rows = max(len(timeline.ranks), 1)
    fig = Figure(figsize=(width, 1.3 + 0.4 * rows), layout="constrained")
    plot_timeline(fig.subplots(), timeline)
    return _png(fig)


def measured_view(run_dir, cfg: RunConfig | None = None, png: bool = True) -> dict:
    """The measured timeline of a run directory beside its ideal with the measured (fitted) costs.

    Keys: measured, ideal (Timelines), measured_metrics, ideal_metrics, cost (the fitted `Cost`),
    html, png (measured above ideal, one time scale), error (why there is no timeline, else None).
    `cfg` gives the sizes for the ideal (default: the run's config.json).
    """
    from .compare import Shape, fitted_ideal, load_timeline, one_step  # lazily: only once a job has run
    from .theory import fit_cost

    run_dir = Path(run_dir)
    empty = {"measured": None, "ideal": None, "measured_metrics": None, "ideal_metrics": None, "cost": None,
             "png": None}
    try:
        if cfg is None:
            cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
        # waits shown as idle time (the bubble), not folded into the compute after them
        measured = one_step(load_timeline(run_dir))
        measured.meta.setdefault("pp_size", cfg.pp_size)
        measured.meta.setdefault("n_microbatches", cfg.n_microbatches)
        if not measured.meta.get("schedule"):
            measured.meta["schedule"] = cfg.schedule
        cost = fit_cost(measured)
        ideal = fitted_ideal(measured, Shape(cfg.schedule, cfg.pp_size, cfg.n_microbatches, cfg.stages_per_rank))
    except Exception as e:  # no logs, a parser that cannot read them, a timeline without compute
        msg = f"{type(e).__name__}: {e}"
        return {**empty, "error": msg, "html": f"<b>No measured timeline:</b> {html.escape(msg)}"}
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
        f"<b>Ideal with the measured mean costs</b> ({costs}, no p2p latency): bubble_fraction "
        f"<b>{im['bubble_fraction']:.1%}</b>, bubble_ratio <b>{im['bubble_ratio']:.2f}</b>, "
        f"makespan {im['makespan'] * 1e3:.1f} ms.",
    ]
    lines.append("Waits for a neighbour's tensor are taken out of the logged spans (labkit.compare.load_timeline); "
                 "run with profile=True for exact compute spans.")
    view = {"measured": measured, "ideal": ideal, "measured_metrics": mm, "ideal_metrics": im, "cost": cost,
            "error": None, "html": "<br>".join(lines), "png": None}
    if png:
        from .plot import plot_side_by_side

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


# --------------------------------------------------------------------------------------------------
# The widget: wiring only
# --------------------------------------------------------------------------------------------------

@dataclass
class _RunState:
    thread: threading.Thread | None = None
    stop_event: threading.Event | None = None
    pending: list = field(default_factory=list)
    last_flush: float = 0.0


class Explorer:
    """Builds the panel (`self.panel`, an ipywidgets VBox) and connects its controls to the pure
    functions above. `labkit.explorer()` returns the panel; `panel.explorer` is this object."""

    def __init__(self, runs_root=None, timeout: float | None = None, **controls):
        import ipywidgets as w

        values = {**DEFAULT_CONTROLS, **controls}
        unknown = set(values) - set(CONTROL_NAMES)
        if unknown:
            raise TypeError(f"explorer() got unknown controls {sorted(unknown)}; known: {', '.join(CONTROL_NAMES)}.")
        self.runs_root = runs_root
        self.timeout = timeout
        self.rows: list[dict] = []
        self.last_run = None
        self._state = _RunState()
        self._lock = threading.Lock()
        self._holding = False

        style = {"description_width": "initial"}
        self.schedule = w.Dropdown(options=list(SCHEDULES), value=values["schedule"], description="schedule",
                                   style=style, layout=w.Layout(width="230px"))
        self.pp_size = w.BoundedIntText(value=values["pp_size"], min=1, max=16, description="pp_size",
                                        style=style, layout=w.Layout(width="130px"))
        self.stages_per_rank = w.BoundedIntText(value=values["stages_per_rank"], min=1, max=8,
                                                description="stages_per_rank", style=style,
                                                layout=w.Layout(width="170px"))
        self.n_microbatches = w.BoundedIntText(value=values["n_microbatches"], min=1, max=64,
                                               description="n_microbatches", style=style,
                                               layout=w.Layout(width="170px"))
        self.split = w.ToggleButtons(options=list(SPLIT_MODES), value=values["split"], description="split",
                                     style={**style, "button_width": "70px"}, layout=w.Layout(width="auto"))
        self.preset = w.Dropdown(options=[(f"{k} ({p.note})", k) for k, p in PRESETS.items()],
                                 value=values["preset"], description="model", style=style,
                                 layout=w.Layout(width="330px"))
        self.device = w.ToggleButtons(options=list(DEVICES), value=values["device"], description="device",
                                      style={**style, "button_width": "60px"}, layout=w.Layout(width="auto",
                                                                                          margin="0 0 0 24px"))
        self.controls = {"schedule": self.schedule, "pp_size": self.pp_size, "stages_per_rank": self.stages_per_rank,
                         "n_microbatches": self.n_microbatches, "split": self.split, "preset": self.preset,
                         "device": self.device}
        for name, c in self.controls.items():
            c.add_class(f"pplab-{name.replace('_', '-')}")
        self.n_microbatches.add_class("pplab-microbatches")

        self.config_info = w.HTML().add_class("pplab-config")
        self.error_panel = w.HTML(layout=w.Layout(display="none", border="1px solid #C44E52", padding="2px 8px"))
        self.error_panel.add_class("pplab-error")
        self.theory_text = w.HTML().add_class("pplab-theory-bubble")
        self.theory_image = w.Image(format="png", layout=w.Layout(max_width="820px")).add_class("pplab-theory-image")

        self.run_button = w.Button(description="Run", button_style="primary", icon="play",
                                   tooltip="Launch a real torchrun job with these settings").add_class("pplab-run")
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                                    tooltip="End the job (every rank is stopped)").add_class("pplab-stop")
        self.progress = w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="160px")).add_class("pplab-progress")
        self.status = w.HTML("ready: press Run to launch a job").add_class("pplab-status")
        self.log = w.Output(layout=w.Layout(max_height="180px", overflow="auto", border="1px solid #ddd"))
        self.log.add_class("pplab-log")
        self.measured_text = w.HTML().add_class("pplab-measured-bubble")
        self.timeline_image = w.Image(format="png", layout=w.Layout(display="none", max_width="900px"))
        self.timeline_image.add_class("pplab-timeline")
        self.history = w.HTML(history_table_html([])).add_class("pplab-history")

        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        for c in self.controls.values():
            c.observe(self._on_change, names="value")

        self.panel = _panel_class()([
            w.HTML("<b>PP Lab explorer</b>: pick a schedule and sizes; the ideal timeline follows at once, "
                   "Run measures the real one."),
            w.HBox([self.schedule, self.preset]),
            w.HBox([self.pp_size, self.stages_per_rank, self.n_microbatches]),
            w.HBox([self.split, self.device]),
            self.config_info,
            self.error_panel,
            w.HTML("<b>Theory</b> (instant, nothing launched)"),
            self.theory_text,
            self.theory_image,
            w.HTML("<b>Measured</b> (a real torchrun job)"),
            w.HBox([self.run_button, self.stop_button, self.progress, self.status]),
            self.log,
            self.measured_text,
            self.timeline_image,
            w.HTML("<b>Runs so far</b>"),
            self.history,
        ])
        self.panel.add_class("pplab-explorer")
        self.panel.explorer = self
        self.panel._pplab_repr = (f"PP Lab explorer ({values['schedule']}, pp_size={values['pp_size']}, "
                                  f"{values['n_microbatches']} microbatches): press Run to launch a job")
        self.refresh()

    # -- controls -----------------------------------------------------------------------------------

    def values(self) -> dict:
        return {name: c.value for name, c in self.controls.items()}

    def _on_change(self, change) -> None:
        if self._holding:
            return
        if change["owner"] is self.schedule:
            spr = stages_per_rank_for(self.schedule.value, self.stages_per_rank.value)
            if spr != self.stages_per_rank.value:
                self._holding = True  # one refresh for both changes
                try:
                    self.stages_per_rank.value = spr
                finally:
                    self._holding = False
        self.refresh()

    def refresh(self) -> None:
        """Validate the controls and redraw the theory (called on every control change)."""
        cfg, message = validate(self.values())
        running = self._state.thread is not None
        self.run_button.disabled = cfg is None or running
        if cfg is None:
            self.error_panel.value = f"<b>Cannot run this combination.</b> {html.escape(message)}"
            self.error_panel.layout.display = None
            self.config_info.value = ""
        else:
            self.error_panel.value = ""
            self.error_panel.layout.display = "none"
            self.config_info.value = html.escape(message)
        view = theory_view(cfg if cfg is not None else self.values())
        text = view["html"]
        if cfg is None and view["error"] is None:
            text += "<br><i>Theory only: this configuration cannot run (see above).</i>"
        self.theory_text.value = text
        if view["png"]:
            self.theory_image.value = view["png"]
            self.theory_image.layout.display = None
        else:
            self.theory_image.layout.display = "none"

    # -- running ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Launch a job with the current controls in a background thread (what Run does)."""
        cfg, message = validate(self.values())
        if cfg is None or self._state.thread is not None:
            return
        self._state = _RunState(stop_event=threading.Event())
        self.run_button.disabled = True
        self.stop_button.disabled = False
        self.progress.value, self.progress.max, self.progress.bar_style = 0, max(cfg.steps, 1), "info"
        self.status.value = html.escape(f"running {cfg.schedule}, pp_size={cfg.pp_size}, "
                                        f"{cfg.n_microbatches} microbatches ...")
        self.log.outputs = ()
        self.measured_text.value = ""
        self.timeline_image.layout.display = "none"
        self._state.thread = threading.Thread(target=self._job, args=(cfg,), name="pplab-explorer-run", daemon=True)
        self._state.thread.start()

    def stop(self) -> None:
        """Ask the running job to end (what Stop does)."""
        if self._state.stop_event is not None and self._state.thread is not None:
            self._state.stop_event.set()
            self.stop_button.disabled = True
            self.status.value = "stopping: ending every rank ..."

    def wait(self, timeout: float | None = None) -> None:
        """Block until the running job (if any) and its drawing are done (for scripts and tests)."""
        t = self._state.thread
        if t is not None:
            t.join(timeout)

    def _echo(self, line: str) -> None:
        with self._lock:
            self._state.pending.append(line + "\n")
        if time.monotonic() - self._state.last_flush > 0.3:  # each append re-sends the log: batch lines
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            text, self._state.pending[:] = "".join(self._state.pending), []
            self._state.last_flush = time.monotonic()
        if text:
            self.log.append_stdout(text)

    def _on_progress(self, done: int, total: int | None) -> None:
        self.progress.max = max(total or 1, 1)
        self.progress.value = min(done, self.progress.max)

    def _job(self, cfg: RunConfig) -> None:
        from .launch import run as launch_run

        kind = "failed"
        try:
            kwargs = {} if self.timeout is None else {"timeout": self.timeout}
            run = launch_run(cfg, runs_root=self.runs_root, stop_event=self._state.stop_event, echo=self._echo,
                             on_progress=self._on_progress, progress=False, check=False, **kwargs)
            self._flush()
            self.last_run = run
            kind, sentence = status_line(run)
            view = None
            if run.status != "interrupted":
                view = measured_view(run.run_dir, cfg)
                self.measured_text.value = view["html"]
                if view["png"]:
                    self.timeline_image.value = view["png"]
                    self.timeline_image.layout.display = None
            self.rows.append(summarize_run(run, view))
            self.history.value = history_table_html(self.rows)
            self.status.value = html.escape(sentence)
        except ConfigError as e:  # e.g. the device check found fewer GPUs than ranks
            self.status.value = html.escape(f"not launched: {e}")
        except Exception as e:  # never leave the panel stuck in "running"
            self._flush()
            self.log.append_stderr(traceback.format_exc())
            self.status.value = html.escape(f"error in the explorer: {type(e).__name__}: {e}")
        finally:
            self.progress.bar_style = {"ok": "success", "interrupted": "warning"}.get(kind, "danger")
            self._state.thread = None
            self.stop_button.disabled = True
            self.refresh()


@lru_cache(maxsize=1)
def _panel_class():
    import ipywidgets as w

    class ExplorerPanel(w.VBox):
        """The explorer's top widget; its text form is short and fixed (what nbval compares)."""

        def __repr__(self) -> str:
            return getattr(self, "_pplab_repr", "PP Lab explorer")

    return ExplorerPanel


def explorer(runs_root=None, timeout: float | None = None, **controls):
    """The explorer panel (an ipywidgets VBox): `labkit.explorer()` or `labkit.explorer(schedule="1F1B")`.

    Controls default to a job a 2-core laptop runs in seconds (GPipe, pp_size 2, 4 microbatches,
    the "small" model, device auto). `runs_root` is where run directories go (default `runs/`);
    `timeout` the job deadline in seconds (default: the launcher's). Displaying it launches nothing.
    """
    return Explorer(runs_root=runs_root, timeout=timeout, **controls).panel
