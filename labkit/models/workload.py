"""A controlled workload: pipeline stages whose compute time you set (notebooks 04-05, fidelity bench).

Each stage is `n_blocks` of `TimedBlock`: forward takes `fwd_ms`, the backward for the input
(I) `bwd_ms/2` and the backward for the weight (W) `bwd_ms/2`, so a full backward B takes
`bwd_ms`. Two ways to spend the time:

- `mode="sleep"`: the rank sleeps. Sleeping ranks do not compete for CPU cores, so even 4 or 8
  ranks on a 2-core laptop keep the schedule's shape: the measured timeline can be held against
  the ideal one. This is the mode for seeing schedules.
- `mode="spin"`: the rank burns that much CPU time. With more ranks than cores the
  ranks steal each other's cores, actions stretch and the timeline smears: that is what
  oversubscription does to a real model on a laptop (notebook 04 shows both).

The maths is elementwise (`y = x * w`), so the pipelined step can still be checked against the
unsplit model on the whole batch, with the timing switched off for the reference.
"""

from __future__ import annotations
import os
import time
from dataclasses import asdict, dataclass, field
import torch
import torch.nn as nn
from ..schedules.table import SCHEDULES, schedule_info, validate_microbatches, validate_schedule
from ..core.errors import ConfigError
from ..config.run import read_config_json


MODES = ("sleep", "spin")


def _spend(seconds: float, mode: str) -> None:
    if seconds <= 0:
        return
    if mode == "sleep":
        time.sleep(seconds)
        return
    # CPU time, not wall time: a rank that shares its core with others takes longer, as real compute does.
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


class _Timed(torch.autograd.Function):
    """Identity whose forward takes `fwd_s` and whose backward takes `bwd_s`."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s, mode):
        ctx.bwd_s, ctx.mode = bwd_s, mode
        _spend(fwd_s, mode)
        return x.clone()  # not a view: V-shaped schedules detach stage outputs in place

    @staticmethod
    def backward(ctx, grad):
        _spend(ctx.bwd_s, ctx.mode)
        return grad, None, None, None


class TimedBlock(nn.Module):
    """`y = x * w`; F costs fwd_s, the input gradient (I) i_s and the weight gradient (W) w_s."""

    timing = True  # switched off for the reference computation

    def __init__(self, dim: int, fwd_s: float, i_s: float, w_s: float, mode: str):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.fwd_s, self.i_s, self.w_s, self.mode = fwd_s, i_s, w_s, mode

    def forward(self, x):
        on = TimedBlock.timing
        # W: the weight's own path; I: on the product, which needs a gradient on every stage
        # (even stage 0, whose input needs none), so each stage's full backward costs I + W.
        w = _Timed.apply(self.w, 0.0, self.w_s if on else 0.0, self.mode)
        return _Timed.apply(x * w, self.fwd_s if on else 0.0, self.i_s if on else 0.0, self.mode)


@dataclass
class WorkloadConfig:
    """A run of the controlled job (`python -m labkit.jobs.controlled_workload`); validated like RunConfig
    (the same schedule rules, from labkit.config.run). The job reads it from its run directory's config.json."""

    schedule: str = "GPipe"
    pp_size: int = 2
    n_microbatches: int = 4
    stages_per_rank: int | None = None
    fwd_ms: float = 40.0
    """Forward time of one stage on one microbatch."""
    bwd_ms: float = 80.0
    """Full backward time (I + W, half each) of one stage on one microbatch."""
    mode: str = "sleep"
    """`sleep` (no core contention: the schedule's shape survives oversubscription) or `spin`."""
    slow_stage: int | None = None
    """Optional stage index that is `slow_factor` times slower (an unbalanced pipeline)."""
    slow_factor: float = 2.0
    dim: int = 16
    batch_size: int | None = None
    steps: int = 1
    seed: int = 0
    profile: bool = False
    """Also record a torch.profiler trace per rank (exact compute spans)."""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be 'sleep' or 'spin', got {self.mode!r}.")
        for name in ("fwd_ms", "bwd_ms", "slow_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {v!r}.")
        if self.batch_size is None:
            self.batch_size = self.n_microbatches * 2
        info = schedule_info(self.schedule)
        self.schedule = info.name
        for name in ("pp_size", "n_microbatches", "batch_size", "steps", "dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {v!r}.")
        self.stages_per_rank = validate_schedule(info, self.pp_size, self.stages_per_rank)
        validate_microbatches(info, self.pp_size, self.n_stages, self.n_microbatches)
        if self.batch_size % self.n_microbatches:
            raise ConfigError(f"batch_size {self.batch_size} is not divisible by {self.n_microbatches} microbatches.")
        if self.slow_stage is not None and not 0 <= self.slow_stage < self.n_stages:
            raise ConfigError(f"slow_stage must be a stage index 0..{self.n_stages - 1}, got {self.slow_stage}.")

    @property
    def n_stages(self) -> int:
        return self.pp_size * self.stages_per_rank

    @property
    def info(self):
        return SCHEDULES[self.schedule]

    def stage_costs_ms(self, stage: int) -> tuple[float, float, float]:
        k = self.slow_factor if stage == self.slow_stage else 1.0
        return self.fwd_ms * k, self.bwd_ms * k / 2, self.bwd_ms * k / 2

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "WorkloadConfig":
        return cls(**read_config_json(path))


def stage_module(cfg: WorkloadConfig, stage: int) -> nn.Module:
    f, i, w = (ms / 1000 for ms in cfg.stage_costs_ms(stage))
    return TimedBlock(cfg.dim, f, i, w, cfg.mode)


def full_model(cfg: WorkloadConfig) -> nn.Sequential:
    return nn.Sequential(*[stage_module(cfg, s) for s in range(cfg.n_stages)])


def make_batch(cfg: WorkloadConfig, device="cpu"):
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch_size, cfg.dim, generator=g)
    y = torch.randn(cfg.batch_size, cfg.dim, generator=g)
    return x.to(device), y.to(device)


def mse(out, target):
    return ((out - target) ** 2).mean()
