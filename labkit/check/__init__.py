"""The verdict: whether a pipelined step computed what the unsplit model computes, and where it did not.

- `reference`: `check_step`, one step against the unsplit model on the whole batch (public at the top:
  `labkit.check_step`), and the references it holds the step against (whole batch, microbatched, float64);
- `noise`: the float-noise floor each compared tensor is judged against (`figure`, `NOISE_MULTIPLE`),
  where a step went wrong, and `autocast` (public at the top: `labkit.autocast`);
- `calls`: whether a call can compare at all; `fits`: whether the references fit on a rank;
- `compared`: the step's gradients and losses held against the references, a figure each;
- `compiled_floor`: what compiling a stage changes in its numbers, added to the floors;
- `inputs`, `boundaries`, `located`: where a failed step departs (what a stage received, each stage
  replayed in float64 on the reference's input at its cut, the sentence that says it), and why a
  parameter got no gradient;
- `stagewise`: `check_stages`, the check of a model no rank holds whole (public at the top:
  `labkit.check_stages`), in less memory by `lean` and `pieces`;
- `watch`: `watch_run`, a training run watched step after step (public at the top: `labkit.watch_run`), its
  first wrong step named with its stage; `gradients`: a checked step's gradients against the re-anchored
  references; `update`: the optimizer's update replayed, and the fingerprints kept between checks; `spill`: the
  snapshots the watch holds, kept off memory with slices=; `runs`:
  the watch's report (each step's loss, distances and floors, `drift`, `plot_run`).

Runs inside the ranks (a job's, or live ranks' cells). Taught in notebook 09b.

May import: labkit.core (lazy exports), labkit.versions (unchanged_token), labkit.spans (received,
compiled), labkit.worker (distributed, shared). Never the launching side (labkit.launching).
"""

from ..core import exports as _exports

# the checks themselves are public at the top: labkit.check_step (reference), labkit.check_stages
# (stagewise), labkit.autocast (noise); here, what a lesson reads of them
__getattr__, __dir__, __all__ = _exports(__name__, {
    ".reference": ("float64_reference", "microbatched_reference", "stage_grads", "whole_batch_reference"),
    ".noise": ("NOISE_MULTIPLE", "Figure", "figure"),
    ".boundaries": ("Departure", "REPLAY_RTOL"),
})
