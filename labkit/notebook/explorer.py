"""The explorer: one ipywidgets panel to pick a schedule and sizes, see the ideal timeline, and run it.

This module owns the widget and nothing else: every decision is a pure function of
`labkit.notebook.explorer_views` (validation, the ideal and measured views, the table of runs), and the
`Explorer` class only wires those to widgets. Taught in notebook 07 (the explorer) and used as a
playground after notebooks 03 and 06.

- Theory answers instantly as the controls move (nothing is launched).
- Run launches a real job (`labkit.launching.launch.run`) in a background thread with live output and a
  progress bar, then draws the measured timeline above the ideal one fitted to the measured costs,
  and adds a row to a table of the runs made so far. Stop ends the job cleanly (every rank
  stopped, the run marked "interrupted").
- Invalid combinations are explained with the SAME validation as the command line and Run stays
  disabled.

Displaying the panel launches nothing and prints nothing: safe in notebooks tested with nbval.
ipywidgets is imported only when a panel is made, so `import labkit` stays fast and works without
the `lab` extra.
"""

from __future__ import annotations

import html
import threading
import time
import traceback
from dataclasses import dataclass, field
from functools import lru_cache

from ..config.run import DEVICES, SPLIT_MODES, RunConfig
from ..config.presets import PRESETS
from ..schedules.table import SCHEDULES
from ..core.errors import ConfigError
from .explorer_views import (
    CONTROL_NAMES,
    DEFAULT_CONTROLS,
    history_table_html,
    measured_view,
    stages_per_rank_for,
    status_line,
    summarize_run,
    theory_view,
    validate,
)

__all__ = ["Explorer", "explorer"]


# --------------------------------------------------------------------------------------------------
# The widget: wiring only
# --------------------------------------------------------------------------------------------------

@dataclass
class _RunState:
    thread: threading.Thread | None = None
    """The job's thread while it runs (None once it has finished: the panel reads it)."""
    worker: threading.Thread | None = None
    """The same thread, kept after it ends, so `wait()` can join it even when it finished first."""
    stop_event: threading.Event | None = None
    pending: list = field(default_factory=list)
    last_flush: float = 0.0


class Explorer:
    """Builds the panel (`self.panel`, an ipywidgets VBox) and connects its controls to the pure
    functions of `labkit.notebook.explorer_views`. `labkit.explorer()` returns the panel;
    `panel.explorer` is this object."""

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
        self._build_controls(w, values)
        self._build_outputs(w)
        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        for c in self.controls.values():
            c.observe(self._on_change, names="value")
        self.panel = self._build_panel(w, values)
        self.refresh()

    def _build_controls(self, w, values: dict) -> None:
        """The run's controls (`self.controls`: schedule, sizes, split, model, device), set to `values`."""
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

    def _build_outputs(self, w) -> None:
        """What the panel shows: the config, errors, the theory, the Run / Stop buttons, the measured run."""
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

    def _build_panel(self, w, values: dict):
        """The controls and outputs laid out in one VBox (`panel.explorer` is this object)."""
        panel = _panel_class()([
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
        panel.add_class("pplab-explorer")
        panel.explorer = self
        panel._pplab_repr = (f"PP Lab explorer ({values['schedule']}, pp_size={values['pp_size']}, "
                             f"{values['n_microbatches']} microbatches): press Run to launch a job")
        return panel

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
        t = threading.Thread(target=self._job, args=(cfg,), name="pplab-explorer-run", daemon=True)
        self._state.thread = self._state.worker = t
        t.start()

    def stop(self) -> None:
        """Ask the running job to end (what Stop does)."""
        if self._state.stop_event is not None and self._state.thread is not None:
            self._state.stop_event.set()
            self.stop_button.disabled = True
            self.status.value = "stopping: ending every rank ..."

    def wait(self, timeout: float | None = None) -> None:
        """Block until the running job (if any) and its drawing are done (for scripts and tests)."""
        t = self._state.worker  # not .thread: the job clears that before its last redraw
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
        from ..launching.launch import run as launch_run

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
                view = measured_view(run.run_dir)
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
