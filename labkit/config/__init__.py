"""What a run is, checked before anything starts: presets (`presets`) and `RunConfig` with every rule
about a valid run (`run`). Imports no torch.

May import: labkit.core, labkit.schedules, labkit.versions."""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__)  # labkit.config.<module> after `import labkit`
