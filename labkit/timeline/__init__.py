"""Timelines read and compared: a measured run beside its fitted ideal (`compare`), matplotlib
drawings that take an `ax` (`plot`), Chrome/Perfetto export (`perfetto`), why one measurement's step
is slower than another's, by cause (`slowdown`), where a hung or crashed run's ranks were, in pipeline
terms, and why (`stuck`, from each rank's steps as its PP log tells them, `logged_steps`, and the causes,
`stuck_causes`); whether two runs computed the same numbers, bit for bit (`runs_compare`). The data model
itself is `labkit.core.actions`.

May import: labkit.core, labkit.logs, labkit.spans, labkit.schedules, labkit.theory, labkit.config."""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__, {
    ".compare": ("Shape", "compute_steps", "fitted_ideal", "load_timeline", "measured_vs_ideal_by_pipeline", "one_step",
                 "order_ideal"),
    ".plot": ("plot_bubble_sweep", "plot_idle_causes", "plot_memory", "plot_pipelines", "plot_side_by_side",
              "plot_step_times", "plot_timeline"),
    ".frontier_plot": ("plot_frontier",),
    ".perfetto": ("write_chrome_trace",),
    ".slowdown": ("Slowdown", "explain_slowdown"),
})
