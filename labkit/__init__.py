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

from .ranks import Ranks, RanksError  # live ranks: labkit.Ranks(nproc=2), and %%ranks after %load_ext labkit

__all__ += ["Ranks", "RanksError"]


def load_ipython_extension(ip) -> None:
    """`%load_ext labkit`: the `%%ranks` cell magic and the `%ranks` line magic (labkit.ranks.magics)."""
    from .ranks.magics import load_ipython_extension as load

    load(ip)
