"""PP Lab's kit: launch real torch.distributed.pipelining jobs from notebooks and read their timelines.

    import labkit
    run = labkit.run(schedule="1F1B", pp_size=2, n_microbatches=4)
    run.result["reference_match"]
"""

from .config import PRESETS, SCHEDULES, ConfigError, RunConfig
from .launch import LaunchError, Run, launch, run
from .explorer import explorer

__version__ = "0.1.0"
__all__ = ["ConfigError", "LaunchError", "PRESETS", "Run", "RunConfig", "SCHEDULES", "explorer", "launch", "run"]
