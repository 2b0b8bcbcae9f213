"""Running many jobs in a row with one progress bar (bubble vs microbatches, schedule comparisons).

    runs = sweep([RunConfig(schedule="GPipe", n_microbatches=m) for m in (1, 2, 4, 8)])

Each job still streams its own output (quietly by default) and keeps its own run directory; the
sweep's bar counts jobs. Notebook 07 uses it.
"""

from __future__ import annotations

from typing import Callable, Iterable

from ..core.progress import Progress


def sweep(configs: Iterable, runner: Callable | None = None, title: str = "sweep", stream: str = "none",
          progress: bool = True, **launch_kw) -> list:
    """Run each config with `runner` (default: `labkit.run` for RunConfig, `run_controlled` for WorkloadConfig)."""
    from .launch import run
    from ..models.workload import WorkloadConfig
    from .controlled import run_controlled

    configs = list(configs)
    runs = []
    with Progress(title, total=len(configs), enabled=progress) as bar:
        for i, cfg in enumerate(configs):
            go = runner or (run_controlled if isinstance(cfg, WorkloadConfig) else run)
            runs.append(go(cfg, stream=stream, progress=False, **launch_kw))
            bar.update(i + 1)
    return runs
