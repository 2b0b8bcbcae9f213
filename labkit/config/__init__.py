"""What a run is, checked before anything starts: presets (`presets`) and `RunConfig` with every rule
about a valid run (`run`). Imports no torch.

May import: labkit.core, labkit.schedules, labkit.versions."""

from ..core import submodules as _submodules

__getattr__ = _submodules(__name__)  # labkit.config.<module> after `import labkit`
