"""What runs a rank: process-group set-up, collectives and results (`distributed`), the tutorial
model's stages (`stages`), memory measurement (`memory`), work shared by the configs of one batch
(`shared`: traces and references computed once), any schedule's stages built, placed and stepped in
two calls (`pipeline`). The step check that runs on these ranks is labkit.check.

May import: labkit.core, labkit.versions, labkit.schedules, labkit.theory, labkit.config. Never the
launcher's side (labkit.launching)."""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__, {
    ".stages": ("manual_stage_module", "runtime_from_csv", "stage_input_example"),
    ".memory": ("SavedTensorTracker", "torch_liveness"),
    ".distributed": ("annotate_stages", "run_dir"),
    ".pipeline": ("build_schedule", "placement", "run_step"),
    ".": ("distributed",),
})
