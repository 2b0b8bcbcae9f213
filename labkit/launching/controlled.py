"""Launching the controlled workload (`labkit.models.workload`: stages whose compute time you set)
as a real torchrun job (`labkit.jobs.controlled_workload`): the model does not launch itself."""

from __future__ import annotations

from ..models.workload import WorkloadConfig


def run_controlled(cfg: WorkloadConfig | None = None, **kwargs):
    """Launch the controlled job (`labkit.jobs.controlled_workload`); kwargs not of WorkloadConfig go to `launch`."""
    from .launch import launch

    fields = set(WorkloadConfig.__dataclass_fields__)
    if cfg is None:
        cfg = WorkloadConfig(**{k: v for k, v in kwargs.items() if k in fields})
    elif any(k in fields for k in kwargs):
        cfg = WorkloadConfig(**{**cfg.to_dict(), **{k: v for k, v in kwargs.items() if k in fields}})
    launch_kw = {k: v for k, v in kwargs.items() if k not in fields}
    launch_kw.setdefault("name", f"controlled-{cfg.schedule}-p{cfg.pp_size}-m{cfg.n_microbatches}-{cfg.mode}")
    return launch("labkit.jobs.controlled_workload", module=True, nproc=cfg.pp_size, config=cfg.to_dict(), **launch_kw)
