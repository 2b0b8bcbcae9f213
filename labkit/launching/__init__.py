"""Launching real torchrun jobs from a cell or a shell: `launch.launch()` / `launch.run()` put the parts
together: rundir (Run record, run directories), command (torchrun argv and env), rendezvous (the
loopback-only store), stream (live output; its progress bars are labkit.core.progress), stop (ending a job's
processes, parent death), diagnose (which rank failed, where each rank was), clean (orphans a kernel left behind),
sweep and controlled (many jobs; the controlled workload's job), slurm (batch scripts).

May import: labkit.core, labkit.versions, labkit.logs (the log format), labkit.spans (paths), labkit.schedules,
labkit.config, labkit.models (the controlled workload's config), labkit.timeline (a Run's timeline).
"""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__)  # labkit.launching.<module> after `import labkit`
