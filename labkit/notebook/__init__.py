"""The notebook face: the explorer (pure views, then widget wiring), the notebooks' setup call and
deterministic views (`helpers`; with the orders' per-rank peaks and `labkit doctor`'s report, what a
lesson imports from `labkit.notebook`), the nbval plugin.

May import: everything below it (launching, ranks, timeline, theory, config, ...)."""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__, {
    ".helpers": ("compress_names", "default_device", "facts", "format_order", "order_csv", "param_groups",
                 "peak_in_flight", "pick_preset", "pipe_summary", "rank_locations", "rank_orders",
                 "saved_activation_bytes", "setup", "shown", "solution", "stack_frames", "torch_actions", "tree",
                 "wrapped"),
    "..schedules.orders": ("rank_peak_bytes", "rank_peak_in_flight"),
    "..doctor": ("doctor", "format_report"),
})
