"""Pipelining in practice: the helpers notebook 14 (`14_pipelining_in_practice.ipynb`) needs beyond the worker's.

Owns two small concerns, each in its module:

- `loss`: losses normalised by a GLOBAL count of valid tokens (padding, `ignore_index=-100`), the check of
  such a step against the unsplit model's token mean (`check_token_step`, a thin layer over
  `labkit.check.reference.check_step`), and the least-squares weights of an accumulated gradient over
  per-batch reference gradients (how `scale_grads=True` turns a sum of steps into a moving average);
- `measure`: what a step costs beside its time: bytes sent between ranks (`SentBytes`), autocast's
  weight copies saved for the backward (`WeightCopies`), a fresh activation tracker per measured step
  (`fresh_tracker`, `rank_peak`), the median of warm step times (`time_steps`), the forwards each module
  ran, recomputations included (`ForwardCounts`).

Runs inside the ranks (live ranks' cells).

May import: labkit.core (lazy exports), labkit.worker (memory), labkit.check (reference). Never the launching side.
"""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__, {
    ".loss": ("check_token_step", "fit_weights", "token_loss", "token_sum_loss", "valid_tokens"),
    ".measure": ("ForwardCounts", "SentBytes", "WeightCopies", "fresh_tracker", "rank_peak", "time_steps"),
})
