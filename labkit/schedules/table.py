"""The schedule table: every schedule torch ships, what it needs (stages per rank, V placement,
split backward) and the rules of a valid shape (ranks, microbatches, stages). Imports no torch, so
bad input is refused in milliseconds (notebook 09 teaches the rules)."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ConfigError, positive_int


@dataclass(frozen=True)
class ScheduleInfo:
    """What the kit needs to know about one torch schedule class."""

    name: str
    """Short name used on the command line (`GPipe`, `1F1B`, ...)."""
    cls: str
    """Class name in `torch.distributed.pipelining`."""
    multi: bool
    """True for `PipelineScheduleMulti` schedules (a list of stages per rank)."""
    v_shaped: bool = False
    """Stages `rank` and `2*pp_size-1-rank` live on a rank (needs exactly 2 stages per rank)."""
    split_backward: bool = False
    """Backward is split into I (input grad) and W (weight grad) actions."""


SCHEDULES: dict[str, ScheduleInfo] = {
    s.name: s
    for s in (
        ScheduleInfo("GPipe", "ScheduleGPipe", multi=False),
        ScheduleInfo("1F1B", "Schedule1F1B", multi=False),
        ScheduleInfo("Interleaved1F1B", "ScheduleInterleaved1F1B", multi=True),
        ScheduleInfo("LoopedBFS", "ScheduleLoopedBFS", multi=True),
        ScheduleInfo("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", multi=True, split_backward=True),
        ScheduleInfo("ZBVZeroBubble", "ScheduleZBVZeroBubble", multi=True, v_shaped=True, split_backward=True),
        ScheduleInfo("DualPipeV", "ScheduleDualPipeV", multi=True, v_shaped=True, split_backward=True),
    )
}


def schedule_info(name: str) -> ScheduleInfo:
    """Look a schedule up by name (case-insensitive, with or without the `Schedule` prefix)."""
    key = name.strip().lower().removeprefix("schedule")
    for info in SCHEDULES.values():
        if info.name.lower() == key:
            return info
    raise ConfigError(
        f"Unknown schedule {name!r}. Choose one of: {', '.join(SCHEDULES)}."
    )


def validate_sizes(pp_size: int, n_microbatches: int) -> None:
    """Ranks and microbatches are whole numbers >= 1 (RunConfig, WorkloadConfig and theory share this)."""
    positive_int("pp_size", pp_size, "Pass --nproc N with N >= 1 ranks.")
    positive_int("n_microbatches", n_microbatches, "Pass --microbatches M with M >= 1.")


def validate_schedule(info: ScheduleInfo, pp_size: int, stages_per_rank: int | None, inference: bool = False) -> int:
    """Stages per rank the schedule needs (default 1, or 2 for multi-stage); raises ConfigError with a fix."""
    if stages_per_rank is None:
        stages_per_rank = 2 if info.multi else 1
    positive_int("stages_per_rank", stages_per_rank, "Pass --stages-per-rank K with K >= 1.")
    if not info.multi and stages_per_rank != 1:
        raise ConfigError(
            f"{info.name} runs exactly one stage per rank, got --stages-per-rank {stages_per_rank}. "
            f"Drop --stages-per-rank, or pick a multi-stage schedule such as Interleaved1F1B."
        )
    if info.multi and stages_per_rank == 1 and pp_size > 1:
        raise ConfigError(
            f"{info.name} is a multi-stage schedule: with one stage per rank use GPipe or 1F1B instead, "
            f"or pass --stages-per-rank 2."
        )
    if info.v_shaped and stages_per_rank != 2:
        raise ConfigError(
            f"{info.name} is V-shaped: each rank holds stages rank and 2*pp_size-1-rank, so it needs "
            f"exactly --stages-per-rank 2 (got {stages_per_rank})."
        )
    if inference and info.v_shaped:
        raise ConfigError(
            f"{info.name} cannot run forward-only: torch plans its I/W backward actions even with "
            f"loss_fn=None and fails ('can't steal_bwd_input if this stage doesn't have backward'). "
            f"For --inference use GPipe, 1F1B, Interleaved1F1B, LoopedBFS or InterleavedZeroBubble."
        )
    return stages_per_rank


def validate_microbatches(info: ScheduleInfo, pp_size: int, n_stages: int, n_microbatches: int) -> None:
    """Microbatch counts torch's schedules refuse, explained before anything starts."""
    if info.name == "1F1B" and n_microbatches < n_stages:
        raise ConfigError(
            f"1F1B needs at least as many microbatches as stages ({n_stages}), got {n_microbatches}: with fewer "
            f"it cannot reach its steady state (torch refuses it). Use --microbatches {n_stages} or more, or GPipe."
        )
    if info.v_shaped and n_microbatches < n_stages:
        raise ConfigError(
            f"{info.name} needs at least as many microbatches as stages ({n_stages}), got "
            f"{n_microbatches}. Use --microbatches {n_stages} or more."
        )
    if info.name == "Interleaved1F1B" or info.name == "InterleavedZeroBubble":
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise ConfigError(
                f"{info.name} runs microbatches in rounds of pp_size: {n_microbatches} microbatches "
                f"on {pp_size} ranks give {rounds} rounds, which do not divide them. Use a multiple "
                f"of {pp_size} microbatches (e.g. {pp_size * rounds})."
            )


def stage_placement(pp_size: int, stages_per_rank: int, v_shaped: bool) -> list[list[int]]:
    """Stages on each rank. Loop: rank r holds r, r+p, r+2p...; V: rank r holds r and 2p-1-r."""
    if v_shaped:
        return [[r, 2 * pp_size - 1 - r] for r in range(pp_size)]
    return [[r + k * pp_size for k in range(stages_per_rank)] for r in range(pp_size)]


def layer_bounds(n_layers: int, n_stages: int) -> list[int]:
    """Layer index where each stage starts, plus n_layers at the end (as even as possible)."""
    return [round(s * n_layers / n_stages) for s in range(n_stages + 1)]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
