"""What each torch schedule plans: the per-rank ORDER of compute actions, read from torch itself.

The multi-stage schedules compute `pipeline_order` in their constructor, which we call with mock
stages (no process group needed). GPipe and 1F1B run a hand-written loop in torch, mirrored here.
torch is imported only when a multi-stage schedule is planned, so the rest of the kit stays fast.
The rules for sizes and stages per rank are `labkit.config.run`'s. Taught in notebooks 04 and 05.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

from ..core.errors import ConfigError
from ..schedules.table import ScheduleInfo, schedule_info, stage_placement, validate_sizes, validate_schedule
from ..schedules.orders import PlannedAction, ScheduleError
from ..core.actions import COMPUTE_KINDS


def resolve(schedule: str, pp_size, n_microbatches, stages_per_rank: int | None) -> tuple[ScheduleInfo, int]:
    """(the schedule, its stages per rank) after `labkit.config.run`'s checks; ConfigError says how to fix them.

    The microbatch rules of a RUN (`config.validate_microbatches`) are not applied: theory also
    answers for sizes torch refuses for 1F1B (notebook 03's bubble formula), and torch's own
    constructor speaks for the multi-stage schedules.
    """
    info = schedule_info(schedule)
    validate_sizes(pp_size, n_microbatches)
    return info, validate_schedule(info, pp_size, stages_per_rank)


def _gpipe_order(pp_size: int, m: int) -> dict[int, list[PlannedAction]]:
    # ScheduleGPipe._step_microbatches: every forward, then every backward, in microbatch order.
    return {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp_size)}


def _1f1b_order(pp_size: int, m: int) -> dict[int, list[PlannedAction]]:
    # Mirrors Schedule1F1B._step_microbatches (torch 2.13), NOT Schedule1F1B.pipeline_order: the
    # latter is only a drawing aid and is off by one on the last rank (it plans F1 first and an F<m>).
    order = {}
    for r in range(pp_size):
        acts: list[PlannedAction] = []
        warmup = min(m, pp_size - r)  # stage 0 runs pp_size forwards before its first backward
        f = b = 0
        for _ in range(warmup):
            acts.append(("F", r, f))
            f += 1
        while True:  # 1B1F: one backward, then one forward, until every forward is done
            acts.append(("B", r, b))
            b += 1
            if f == m:
                break
            acts.append(("F", r, f))
            f += 1
        while b < m:  # cooldown
            acts.append(("B", r, b))
            b += 1
        order[r] = acts
    return order


def torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        return "(not installed)"


def _torch_order(info, pp_size: int, m: int, stages_per_rank: int) -> dict[int, list[PlannedAction]]:
    """`pipeline_order` of a multi-stage torch schedule, built with mock stages (no process group)."""
    cached = _torch_order_cached(info, pp_size, m, stages_per_rank)
    return {r: list(acts) for r, acts in cached.items()}  # callers may edit their copy


def mock_schedule(schedule: str, pp_size: int, n_microbatches: int, stages_per_rank: int = 1):
    """torch's schedule object for rank 0, built with mock stages (no process group): enough for what
    a schedule plans (`pipeline_order`) and what torch 2.15 analyses from it (`labkit.worker.memory`)."""
    from ..versions import planning_stages, schedule_class

    info = schedule_info(schedule)
    m = n_microbatches
    try:
        schedule_cls = schedule_class(info.cls)
    except ImportError as e:
        raise ScheduleError(f"torch {torch_version()} has no torch.distributed.pipelining ({e}). "
                            f"The kit needs torch >= 2.11; check `labkit doctor`.") from e
    if schedule_cls is None:
        raise ScheduleError(f"torch {torch_version()} has no torch.distributed.pipelining.{info.cls}. "
                            f"The kit needs torch >= 2.11; check `labkit doctor`.")

    n_stages = pp_size * stages_per_rank
    # The schedules only read sizes from the stages when planning (labkit.versions.planning_stages)
    stages = planning_stages(stage_placement(pp_size, stages_per_rank, info.v_shaped)[0], pp_size, n_stages)
    try:
        return schedule_cls(stages if info.multi else stages[0], m)
    except ValueError as e:  # torch's own rule for this combination: pass it on, it is the lesson
        raise ConfigError(f"torch refuses {info.name} with pp_size={pp_size}, stages_per_rank={stages_per_rank}, "
                          f"n_microbatches={m}: {e}") from e
    except Exception as e:  # a torch version whose constructor needs more than sizes
        raise ScheduleError(
            f"Could not read the planned order of {info.cls} from torch {torch_version()} with mock stages "
            f"({type(e).__name__}: {e}). This is a kit bug for this torch version: please report it, and use "
            f"`simulate_order` with an order written by hand meanwhile."
        ) from e


@lru_cache(maxsize=256)  # sweeps (notebook 03, the explorer) ask for the same plans again and again
def _torch_order_cached(info, pp_size: int, m: int, stages_per_rank: int) -> dict[int, tuple[PlannedAction, ...]]:
    schedule = mock_schedule(info.name, pp_size, m, stages_per_rank)
    raw = getattr(schedule, "pipeline_order", None)
    if not isinstance(raw, dict) or sorted(raw) != list(range(pp_size)):
        raise ScheduleError(f"{info.cls} in torch {torch_version()} has no pipeline_order for ranks 0..{pp_size - 1} "
                            f"(got {type(raw).__name__}); please report this kit bug.")
    return {r: tuple(_expand_torch_actions(raw[r])) for r in range(pp_size)}


def _expand_torch_actions(actions: Iterable) -> Iterable[PlannedAction]:
    """torch `_Action`s -> (kind, stage, mb), read by attribute (no private import); None = idle step."""
    for a in actions:
        if a is None:
            continue
        subs = getattr(a, "sub_actions", None)
        if subs:  # OVERLAP_F_B (DualPipeV): the runtime runs its parts one after the other
            yield from _expand_torch_actions(subs)
            continue
        kind = getattr(a.computation_type, "value", str(a.computation_type))
        if kind in COMPUTE_KINDS:
            yield (kind, int(a.stage_index), int(a.microbatch_index))
        # UNSHARD / RESHARD / REDUCE_GRAD / SEND / RECV are not compute: the simulator models p2p as latency


def planned_actions(schedule: str, pp_size: int, n_microbatches: int,
                    stages_per_rank: int | None = None) -> dict[int, list[PlannedAction]]:
    """The per-rank ORDER of compute actions `(kind, stage, microbatch)` that `schedule` plans.

    Multi-stage schedules: read from torch (`Schedule*.pipeline_order`, built with mock stages);
    torch's own errors for invalid sizes come back as `ConfigError`. GPipe and 1F1B: the loop of
    their `_step_microbatches`. 1F1B with fewer microbatches than ranks is refused by torch; the
    order is still defined (as slow as GPipe) and is returned here for the bubble formula.
    """
    info, spr = resolve(schedule, pp_size, n_microbatches, stages_per_rank)
    if info.name == "GPipe":
        return _gpipe_order(pp_size, n_microbatches)
    if info.name == "1F1B":
        return _1f1b_order(pp_size, n_microbatches)
    order = _torch_order(info, pp_size, n_microbatches, spr)
    expected = stage_placement(pp_size, spr, info.v_shaped)
    for r in range(pp_size):
        seen = sorted({s for _, s, _ in order[r]})
        if seen != sorted(expected[r]):
            raise ScheduleError(f"torch {torch_version()} places stages {seen} on rank {r} for {info.name}, but "
                                f"labkit.schedules.table.stage_placement says {expected[r]}: please report this kit "
                                f"bug.")
    return order
