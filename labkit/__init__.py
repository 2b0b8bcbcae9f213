"""PP Lab's kit: launch real torch.distributed.pipelining jobs from notebooks and read their timelines.

    import labkit
    run = labkit.run(schedule="1F1B", pp_size=2, n_microbatches=4)
    run.result["reference_match"]
"""

from .config.presets import PRESETS
from .schedules.table import SCHEDULES
from .core.errors import ConfigError
from .config.run import RunConfig
from .launching.launch import LaunchError, Run, launch, run
from .notebook.explorer import explorer

__version__ = "0.1.0"
__all__ = ["ConfigError", "LaunchError", "PRESETS", "Run", "RunConfig", "SCHEDULES", "explorer", "launch", "run"]

__all__ += ["Ranks", "RanksError"]  # live ranks: labkit.Ranks(nproc=2), and %%ranks after %load_ext labkit


def __getattr__(name):
    # Imported when first used: `import labkit` runs in every torchrun agent of this environment
    # (torch loads the kit's rendezvous plugin, labkit.launching.rendezvous) and in `labkit launch`, which need
    # neither the live ranks nor what they import.
    if name in ("Ranks", "RanksError", "ranks"):
        from importlib import import_module  # not `from . import ranks`: that asks this hook again

        ranks = import_module(".ranks", __name__)
        return ranks if name == "ranks" else getattr(ranks, name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def load_ipython_extension(ip) -> None:
    """`%load_ext labkit`: the `%%ranks` cell magic and the `%ranks` line magic (labkit.ranks.magics)."""
    from .ranks.magics import load_ipython_extension as load

    load(ip)
