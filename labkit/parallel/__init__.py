"""Pipelining composed with other parallelisms: `compose` (the (pp, dp, tp) mesh of a run, data
parallelism replicated or by FSDP2, tensor parallelism by DTensor plans, the whole-global-batch check).
Used by the reference job (`labkit run --dp-size D --tp-size T [--fsdp]`).

May import: labkit.core, labkit.worker (process groups, collectives).
"""

from ..core import submodules as _submodules

__getattr__ = _submodules(__name__)  # labkit.parallel.<module> after `import labkit`
