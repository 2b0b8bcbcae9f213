"""Any schedule on live ranks in two calls: this rank's stages of a model and their schedule
(`build_schedule`), one step of it with the inputs and targets only where they belong (`run_step`), and
where each stage goes
(`placement`: one stage per rank, looped r, r + p, or V-shaped r, 2p - 1 - r).

    stages, schedule = build_schedule(ScheduleZBVZeroBubble, full, 4, loss_fn=mse)  # full: nn.Sequential of stages
    losses = run_step(schedule, stages, x, y)       # [] on ranks without the last stage
    check_step(full, stages, x, y, losses, 4, mse)  # the stage modules are full[i]: names inferred

What notebooks 05, 13 and 14 do on every schedule, and what a learner's own script needs.

May import: torch, labkit.schedules."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from ..schedules.table import stage_placement

V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def placement(schedule_cls, n_stages: int, rank: int | None = None, world_size: int | None = None) -> list[int]:
    """The stage indices `rank` holds under `schedule_cls` (default: this process's rank and world):
    one stage per rank when there are as many stages as ranks, else looped (r, r + p, ...) or, for the
    V-shaped schedules (ZBVZeroBubble, DualPipeV), r and 2p - 1 - r."""
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    if n_stages % world_size:
        raise ValueError(f"{n_stages} stages cannot be spread evenly over {world_size} ranks: use a multiple of "
                         f"{world_size} (one stage per rank, or two for a looped or V-shaped schedule).")
    v = getattr(schedule_cls, "__name__", str(schedule_cls)) in V_SHAPED
    if v and n_stages != 2 * world_size:
        raise ValueError(f"{schedule_cls.__name__} places two stages per rank, V-shaped: build it with "
                         f"{2 * world_size} stages on {world_size} ranks, not {n_stages}.")
    return stage_placement(world_size, n_stages // world_size, v)[rank]


def build_schedule(schedule_cls, full: nn.Sequential, n_microbatches: int, device=None, **schedule_kwargs):
    """This rank's PipelineStages of `full` (an nn.Sequential whose children are the stages, each stage
    module `full[i]`), placed by `placement`, and `schedule_cls` built on them (single-stage schedules
    get the one stage). `schedule_kwargs`: loss_fn, scale_grads... Returns (stages, schedule)."""
    from torch.distributed.pipelining import PipelineStage

    device = device if device is not None else next(full.parameters()).device
    stages = [PipelineStage(full[i], i, len(full), device) for i in placement(schedule_cls, len(full))]
    return stages, schedule_cls(stages[0] if len(stages) == 1 else stages, n_microbatches, **schedule_kwargs)


def run_step(schedule, stages, x, y=None, method: str = "step", **kwargs) -> list:
    """One step (or `method="eval"`: forwards only) of `schedule`, with `x` on the rank holding stage 0
    and the target `y` where the last stage is; returns the losses it filled ([] elsewhere)."""
    held, n_stages = {int(s.stage_index) for s in stages}, int(stages[0].num_stages)
    losses: list = []
    args = (x,) if 0 in held else ()
    tail = dict(target=y, losses=losses) if n_stages - 1 in held and y is not None else {}
    getattr(schedule, method)(*args, **tail, **kwargs)
    return losses
