"""The lesson helpers a learner copied by hand (issue 53): labkit.worker.pipeline places, builds and
steps any schedule on live ranks, and check_step infers the stage names; labkit.practice.ForwardCounts
counts each module's forwards, recomputations included."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import module_pool
from labkit.worker.pipeline import placement

SETUP = """
import torch, torch.nn as nn
from torch.distributed.pipelining import (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
import labkit
from labkit.worker import build_schedule, run_step

def mlp(n_stages):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(n_stages)])

x, y = torch.randn(8, 16), torch.randn(8, 16)
mse = nn.functional.mse_loss

def checked(cls, n_stages):
    full = mlp(n_stages)
    stages, schedule = build_schedule(cls, full, 4, loss_fn=mse)
    losses = run_step(schedule, stages, x, y)
    c = labkit.check_step(full, stages, x, y, losses, 4, mse)   # names inferred: each stage is full[i]
    return c.ok, sorted(int(s.stage_index) for s in stages), any("inferred" in n for n in c.notes)
"""

pool = module_pool(2, SETUP)


@pytest.mark.launches
@pytest.mark.parametrize("cls, n_stages, held", [
    ("ScheduleGPipe", 2, {0: [0], 1: [1]}), ("Schedule1F1B", 2, {0: [0], 1: [1]}),
    ("ScheduleInterleaved1F1B", 4, {0: [0, 2], 1: [1, 3]}), ("ScheduleInterleavedZeroBubble", 4, {0: [0, 2], 1: [1, 3]}),
    ("ScheduleZBVZeroBubble", 4, {0: [0, 3], 1: [1, 2]})])
def test_any_schedule_is_built_stepped_and_checked_in_two_calls(pool, cls, n_stages, held):
    out = pool.exec(f"checked({cls}, {n_stages})")
    assert {r: v[1] for r, v in out.items()} == held
    assert all(ok and inferred for ok, _, inferred in out.values()), out


def test_placement_refuses_what_cannot_be_placed():
    class ScheduleZBVZeroBubble:  # only the name decides V-shaped
        pass
    assert placement(ScheduleZBVZeroBubble, 4, rank=1, world_size=2) == [1, 2]
    with pytest.raises(ValueError, match="V-shaped"):
        placement(ScheduleZBVZeroBubble, 2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="evenly"):
        placement(type("Schedule1F1B", (), {}), 3, rank=0, world_size=2)


def test_forward_counts_include_checkpointing_recomputations():
    from torch.utils.checkpoint import checkpoint

    from labkit.practice import ForwardCounts

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with ForwardCounts({"a": a, "b": b}) as counts:
        out = checkpoint(a, x, use_reentrant=False) + b(x)   # a is recomputed in the backward, b is not
        out.sum().backward()
    assert dict(counts) == {"a": 2, "b": 1}
    b(x)
    assert counts["b"] == 1  # the hooks are gone once the block ends
