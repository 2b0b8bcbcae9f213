"""PP Lab's kit: launch real torch.distributed.pipelining jobs from notebooks and read their timelines.

    import labkit
    run = labkit.run(schedule="1F1B", pp_size=2, n_microbatches=4)
    run.result["reference_match"]
"""

__version__ = "0.1.0"

# Every public name is imported when first used. `import labkit` runs in every process of a job:
# the torchrun agent (torch loads the kit's rendezvous plugin, labkit.launching.rendezvous), every
# rank (the spans' sitecustomize loads labkit.spans.record) and `labkit launch`; none of them needs
# the launcher, the explorer or the live ranks, and importing them all cost ~0.25 s in each.
_HOME = {"PRESETS": "config.presets", "SCHEDULES": "schedules.table", "ConfigError": "core.errors",
         "RunConfig": "config.run", "LaunchError": "launching.launch", "Run": "launching.launch",
         "launch": "launching.launch", "run": "launching.launch", "explorer": "notebook.explorer",
         "Ranks": "ranks", "RanksError": "ranks"}  # live ranks: labkit.Ranks(nproc=2), %%ranks after %load_ext labkit
__all__ = sorted(_HOME)

# torch's heavy imports with Python's cyclic collector paused, in whatever process imports the kit
# before torch (a notebook's kernel, the `labkit` command): about a second less of CPU per process
# (labkit.core.startup; LABKIT_GC_PAUSE=0 turns it off). The launcher's processes get it from the
# ranks' sitecustomize.
from .core.startup import pause_heavy_imports as _pause  # noqa: E402

_pause()


def __getattr__(name):
    from importlib import import_module  # not `from . import x`: that asks this hook again

    if name in _HOME:
        return getattr(import_module(f".{_HOME[name]}", __name__), name)
    try:  # a subpackage (labkit.notebook, labkit.theory, ...) used as an attribute after `import labkit`
        return import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def load_ipython_extension(ip) -> None:
    """`%load_ext labkit`: the `%%ranks` cell magic and the `%ranks` line magic (labkit.ranks.magics)."""
    from .ranks.magics import load_ipython_extension as load

    load(ip)
