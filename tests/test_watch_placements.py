"""labkit.watch_run on every schedule of the suite (issue 64): clean runs of a few steps hold on 2 ranks in
float32 (all seven schedules, one and two stages a rank), a few under bf16 autocast, and on 4 ranks, with
AdamW (weight decay), a warm-up LambdaLR and clipping by the global norm; a rank holding two stages is
watched stage by stage (a bug planted on one of them is named on that stage)."""

from __future__ import annotations

import pytest

from conftest import module_pool

pytestmark = pytest.mark.launches  # the suite's warm pools

SETUP = """
import copy
import torch, torch.nn as nn
import torch.distributed as dist
import torch.distributed.pipelining as P
import labkit
from labkit.worker import build_schedule, run_step

class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(d), nn.Linear(d, d)
        self.scale = 1.0
    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x))) * self.scale

mse = lambda o, t: ((o - t) ** 2).mean()
M = 8  # DualPipeV wants as many microbatches as stages

def placed(name, per_rank, n=3, every=1, dtype=None, bug=None, at=1, kind="grad"):
    cls = getattr(P, name)
    n_stages = dist.get_world_size() * per_rank
    torch.manual_seed(0)
    full = nn.Sequential(*[Block() for _ in range(n_stages)])
    model = copy.deepcopy(full)
    stages, sched = build_schedule(cls, model, M, loss_fn=mse)
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    watch = labkit.watch_run(stages, opt, mse, M, full=full, every=every, autocast=dtype)
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(n):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
            watch.begin(x, y)
            if kind == "module" and step == at:  # the stage's own code goes wrong from this step
                for s in stages:
                    if s.stage_index == bug:
                        s.submod.scale = 1.01
            with labkit.autocast(dtype) if dtype else torch.autocast("cpu", enabled=False):
                fed = x.roll(2, 0) if kind == "input" and step == at else x  # each microbatch gets the next one's
                losses = run_step(sched, stages, fed, y)
            sq = torch.tensor([sum(float(p.grad.double().pow(2).sum()) for p in params)])
            dist.all_reduce(sq)
            for p in params:
                p.grad.mul_(min(1.0, 0.05 / (float(sq) ** 0.5 + 1e-6)))
            if kind == "grad" and bug is not None and step == at:
                for s in stages:
                    if s.stage_index == bug:
                        s.submod.lin.weight.grad.mul_(1.01)
            opt.step()
            lrs.step()
            opt.zero_grad()
            watch.end(losses)
    finally:
        watch.close()
    r = watch.report
    return r.ok, r.first_wrong_step, r.stage, r.failure or "", [s.ok for s in r.steps]

def one_step_of_check_stages():
    torch.manual_seed(0)
    full = nn.Sequential(*[Block() for _ in range(dist.get_world_size())])
    stages, sched = build_schedule(P.Schedule1F1B, copy.deepcopy(full), M, loss_fn=mse)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    losses = run_step(sched, stages, x, y)
    slices = {int(s.stage_index): copy.deepcopy(full[int(s.stage_index)]) for s in stages}
    return labkit.check_stages(slices, stages, x, y, losses, M, mse).ok

def refused(call, on=1):
    import labkit.check.fits as fits
    free = fits.free_bytes
    if rank == on:
        fits.free_bytes = lambda device: 1_000   # a rank with 1 kB free
    try:
        said = repr(eval(call))
    except labkit.CheckStepError as e:
        said = str(e)
    finally:
        fits.free_bytes = free
    return said
"""

pool2 = module_pool(2, SETUP)
pool4 = module_pool(4, SETUP)

SINGLE = ["ScheduleGPipe", "Schedule1F1B"]
LOOPED = ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble"]
V = ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
EVERY = [(s, 1) for s in SINGLE] + [(s, 2) for s in LOOPED + V]


def _run(pool, call: str) -> tuple:
    out = pool.exec(call)
    assert all(o == out[0] for o in out.values()), f"every rank gets the same report: {out}"
    return out[0]


@pytest.mark.parametrize("name,per_rank", EVERY)
def test_a_clean_run_holds_on_every_schedule_on_2_ranks(pool2, name, per_rank):
    ok, first, stage, failure, steps = _run(pool2, f"placed({name!r}, {per_rank})")
    assert ok and steps == [True] * 3, (first, stage, failure)


@pytest.mark.parametrize("name,per_rank", [("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2),
                                           ("ScheduleZBVZeroBubble", 2)])
def test_a_clean_run_holds_under_bf16_autocast(pool2, name, per_rank):
    ok, first, stage, failure, steps = _run(pool2, f"placed({name!r}, {per_rank}, dtype=torch.bfloat16)")
    assert ok and steps == [True] * 3, (first, stage, failure)


@pytest.mark.parametrize("name,per_rank", [("ScheduleGPipe", 1), ("ScheduleLoopedBFS", 2),
                                           ("ScheduleDualPipeV", 2)])
def test_a_clean_run_holds_on_4_ranks(pool4, name, per_rank):
    ok, first, stage, failure, steps = _run(pool4, f"placed({name!r}, {per_rank}, every=2)")
    assert ok and steps == [True, None, True], (first, stage, failure)


def test_a_clean_run_holds_on_4_ranks_under_bf16_autocast(pool4):
    ok, first, stage, failure, steps = _run(pool4, "placed('ScheduleInterleaved1F1B', 2, dtype=torch.bfloat16)")
    assert ok and steps == [True] * 3, (first, stage, failure)


@pytest.mark.parametrize("name", ["ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"])
def test_a_bug_on_a_rank_with_two_stages_is_named_on_its_stage(pool4, name):
    # looped: rank 1 holds stages 1 and 5; V-shaped: rank 2 holds stages 2 and 5
    ok, first, stage, failure, steps = _run(pool4, f"placed({name!r}, 2, bug=5, at=1)")
    assert not ok and (first, stage) == (1, 5), (first, stage, failure)


@pytest.mark.parametrize("name,per_rank,every", [("Schedule1F1B", 1, 1), ("ScheduleInterleaved1F1B", 2, 2)])
def test_a_stage_computing_wrong_is_placed_at_its_module(pool2, name, per_rank, every):
    # stage 1's block scales its branch by 1.01 from step 1: the watch names the step, the stage and, as
    # check_step does, the module it departs at (every 2: found by the replay from step 0's good check)
    ok, first, stage, failure, steps = _run(pool2, f"placed({name!r}, {per_rank}, n=3, every={every}, bug=1, "
                                                   "kind='module')")
    assert not ok and (first, stage) == (1, 1), (first, stage, failure)
    assert failure.startswith("stage 1 departs at 1") or failure.startswith("stage 1's output"), failure
    assert "differ from the unsplit model's beyond float noise" in failure, failure


def test_a_stage_fed_the_wrong_input_is_named_with_what_it_received(pool2):
    # at step 1 the user feeds the schedule the batch rolled by one microbatch (the watch was given the batch)
    ok, first, stage, failure, steps = _run(pool2, "placed('Schedule1F1B', 1, n=3, bug=0, kind='input')")
    assert not ok and (first, stage) == (1, 0), (first, stage, failure)
    assert failure.startswith("stage 0 received"), failure


@pytest.mark.parametrize("call,words", [
    ("placed('Schedule1F1B', 1, n=1)", "watch_run needs at least"),
    ("one_step_of_check_stages()", "check_stages needs at least"),
])
def test_what_cannot_fit_on_a_rank_is_refused_on_every_rank_before_it_starts(pool2, call, words):
    """Rank 1 alone has 1 kB free: every rank raises the same CheckStepError with the estimate, before any
    collective of the check that could wait (the pool is not restarted), and the same call then runs."""
    out = pool2.exec(f"refused({call!r})")
    assert out[0] == out[1], out
    assert out[0].startswith(("watch_run cannot watch this run", "check_stages cannot compare")), out[0]
    assert f"rank 1: {words}" in out[0] and "KiB" in out[0] and "it has 1.0 KiB available" in out[0], out[0]
    again = pool2.exec(call)
    assert again[0] == again[1] and (again[0] is True or again[0][0] is True), again
