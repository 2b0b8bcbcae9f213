"""What runs inside a rank: process-group set-up and results (`distributed`), the tutorial model's
stages (`stages`), the whole-batch reference check (`reference`), memory measurement (`memory`).

May import: labkit.core, labkit.versions, labkit.schedules, labkit.theory, labkit.config, labkit.spans
(recording). Never the launcher's side (labkit.launching)."""

from ..core import submodules as _submodules

__getattr__ = _submodules(__name__)  # labkit.worker.<module> after `import labkit`
