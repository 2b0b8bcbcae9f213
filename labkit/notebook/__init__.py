"""The notebook face: the explorer (pure views, then widget wiring), the notebooks' setup call and
deterministic views (`helpers`), the nbval plugin.

May import: everything below it (launching, ranks, timeline, theory, config, ...)."""

from ..core import submodules as _submodules

__getattr__ = _submodules(__name__)  # labkit.notebook.<module> after `import labkit`
