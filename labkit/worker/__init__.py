"""What runs inside a rank: process-group set-up and results (`distributed`), the tutorial model's
stages (`stages`), the whole-batch reference check (`reference`; `stagewise`: check_stages, for a
model no rank holds whole; `boundaries`: where a failed check departs), memory measurement
(`memory`), work shared by the configs of one batch (`shared`), any schedule's stages built, placed
and stepped in two calls (`pipeline`).

May import: labkit.core, labkit.versions, labkit.schedules, labkit.theory, labkit.config, labkit.spans
(recording). Never the launcher's side (labkit.launching)."""

from ..core import exports as _exports

# the step check itself is public at the top: labkit.check_step (labkit.worker.reference), with
# labkit.autocast (labkit.worker.noise); the check of a model no rank holds whole is here: check_stages
__getattr__, __dir__, __all__ = _exports(__name__, {
    ".stages": ("manual_stage_module", "runtime_from_csv", "stage_input_example"),
    ".reference": ("float64_reference", "microbatched_reference", "stage_grads", "whole_batch_reference"),
    ".memory": ("SavedTensorTracker", "torch_liveness"),
    ".distributed": ("annotate_stages", "run_dir"),
    ".noise": ("NOISE_MULTIPLE", "Figure", "figure"),
    ".stagewise": ("check_stages",),
    ".pipeline": ("build_schedule", "placement", "run_step"),
    ".boundaries": ("Departure", "REPLAY_RTOL"),
    ".": ("distributed",),
})
