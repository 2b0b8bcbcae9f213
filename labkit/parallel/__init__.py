"""Pipelining composed with other parallelisms: `compose` (the (pp, dp, tp) mesh of a run, data
parallelism replicated or by FSDP2, tensor parallelism by DTensor plans, the whole-global-batch check).
Used by the reference job (`labkit run --dp-size D --tp-size T [--fsdp]`).

May import: labkit.core, labkit.versions, labkit.worker (process groups, collectives).
"""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__, {
    ".compose": ("full_grads", "tp_plan"),
    ".checkpoint": ("clip_grad_norm", "saved_names"),
})
