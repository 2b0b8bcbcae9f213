"""PP Lab's kit: launch real torch.distributed.pipelining jobs from notebooks and read their timelines.

    import labkit
    run = labkit.run(schedule="1F1B", pp_size=2, n_microbatches=4)
    run.result["reference_match"]
"""

__version__ = "0.1.0"

# torch's heavy imports with Python's cyclic collector paused, in whatever process imports the kit
# before torch (a notebook's kernel, the `labkit` command): labkit.core.startup (LABKIT_GC_PAUSE=0
# turns it off). The launcher's processes get it from the
# ranks' sitecustomize.
from .core.startup import pause_heavy_imports as _pause  # noqa: E402

_pause()

from .core import exports as _exports  # noqa: E402

# The lesson API's face (README, "The lesson API"). Each name is imported when first used: `import labkit`
# runs in every process of a job (the torchrun agent loads the kit's rendezvous plugin, every rank loads
# labkit.spans.record) and none of them needs the launcher, the explorer, the live ranks or torch.
__getattr__, __dir__, __all__ = _exports(__name__, {
    ".config.run": ("RunConfig",),
    ".config.presets": ("PRESETS",),
    ".schedules.table": ("SCHEDULES",),
    ".core.errors": ("ConfigError",),
    ".launching.launch": ("launch", "run"),
    ".launching.rundir": ("LaunchError", "Run", "new_run_dir"),
    ".launching.sweep": ("sweep",),
    ".launching.controlled": ("run_controlled",),
    ".ranks.pool": ("Ranks", "RanksError", "current"),  # labkit.Ranks(nproc=2); %%ranks after %load_ext labkit
    ".ranks.suite": ("run_configs",),
    ".ranks.choose": ("ChoiceTable", "measure_choices", "plot_choice"),
    ".check.reference": ("CheckStepError", "check_step"),
    ".check.stagewise": ("check_stages",),  # the check of a model no rank holds whole (its slices only)
    ".check.watch": ("watch_run",),  # a run, not a step: its first wrong step, the optimizer's update included
    ".check.noise": ("autocast",),  # torch.autocast with its cast cache off, for bf16 steps and their check
    ".notebook.explorer": ("explorer",),
    ".": ("versions",),  # which torch this is and what it has: versions.has("WAIT actions"), versions.installed()
})


def load_ipython_extension(ip) -> None:
    """`%load_ext labkit`: the `%%ranks` cell magic and the `%ranks` line magic (labkit.ranks.magics)."""
    from .ranks.magics import load_ipython_extension as load

    load(ip)
