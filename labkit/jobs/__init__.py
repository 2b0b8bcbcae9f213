"""torchrun entry points of the kit, run as `python -m labkit.jobs.<name>` (the launcher passes `-m`).

Each reads its config from the run directory's config.json ($LABKIT_RUN_DIR), writes result.json there.

May import: labkit.core, labkit.versions, labkit.schedules, labkit.config, labkit.worker, labkit.check,
labkit.models, labkit.parallel, labkit.spans (recording). Never the launcher's side (labkit.launching) nor
the notebook face.
"""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__)  # labkit.jobs.<module> after `import labkit`
