"""labkit.watch_run with slices= (issue 64 item 3: a model no rank holds whole) on the suite's warm 2-rank pool:
each rank passes only its slices of the unsplit model, as labkit.check_stages takes them, and the watch's checks
run check_stages' chains from the weights each checked step began from (labkit.check.gradients). Clean runs hold
under 1F1B (the small LM, AdamW with weight decay, a warm-up LambdaLR, clipping by the global norm) and an
interleaved schedule (two stages a rank); planted bugs are named at their exact step and stage with every=4,
found by replaying from the last good check: a lost optimizer state, clipping by a stage's own norm, a stage's
own code going wrong (placed by the float64 replay of each stage against its slice)."""

from __future__ import annotations

import pytest

from conftest import module_pool

pytestmark = pytest.mark.launches  # the suite's warm pool

SETUP = """
import copy
import torch, torch.nn as nn
import torch.distributed as dist
import torch.distributed.pipelining as P
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
import labkit
from labkit.models import lm_loss, small_lm
from labkit.worker import build_schedule, run_step

def clip_global(params, max_norm):
    sq = torch.tensor([sum(float(p.grad.double().pow(2).sum()) for p in params)])
    dist.all_reduce(sq)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt()[0])

def sliced_lm(bug=None, at=0, every=4, n=9, on=1, spill=None):
    # each rank builds only its part of the LM (its stage module, and again its slice: small_lm's parts are
    # each built from their own seed, as a user who cannot hold the whole model builds them)
    part = lambda: small_lm(blocks=[[0, 1], [2, 3]][rank], first=rank == 0, last=rank == 1)
    mod = part()
    stage = PipelineStage(mod, rank, 2, device)
    sched = Schedule1F1B(stage, 4, loss_fn=lm_loss)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1)
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    watch = labkit.watch_run([stage], opt, lm_loss, 4, slices={rank: part()}, every=every, spill=spill)
    g = torch.Generator().manual_seed(0)
    mine = rank == on
    try:
        for step in range(n):
            x, y = torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g)
            watch.begin(x, y)
            opt.zero_grad()
            losses = []
            sched.step(x) if rank == 0 else sched.step(target=y, losses=losses)
            if bug == "stage-clip" and step >= at:
                torch.nn.utils.clip_grad_norm_(mod.parameters(), 0.5)
            else:
                clip_global(list(mod.parameters()), 0.5)
            if bug == "lost-state" and step == at and mine:
                opt.state.clear()
            opt.step()
            lrs.step()
            watch.end(losses)
    finally:
        globals()["STORE"] = type(watch._last.seen).__name__ if watch._last else None  # where the snapshots were
        watch.close()
    r = watch.report
    return r.ok, r.first_wrong_step, r.stage, r.failure or "", [s.ok for s in r.steps]

class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(d), nn.Linear(d, d)
        self.scale = 1.0
    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x))) * self.scale

mse = lambda o, t: ((o - t) ** 2).mean()

def sliced_blocks(name="ScheduleInterleaved1F1B", bug=None, at=0, stage_bug=None, every=4, n=5):
    # two stages a rank; each stage's slice a copy of that block of the unsplit model
    n_stages = 2 * dist.get_world_size()
    torch.manual_seed(0)
    full = nn.Sequential(*[Block() for _ in range(n_stages)])
    stages, sched = build_schedule(getattr(P, name), copy.deepcopy(full), 4, loss_fn=mse)
    slices = {int(s.stage_index): copy.deepcopy(full[int(s.stage_index)]) for s in stages}
    del full  # no rank keeps the unsplit model
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    watch = labkit.watch_run(stages, opt, mse, 4, slices=slices, every=every)
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(n):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
            watch.begin(x, y)
            if bug == "module" and step == at:  # a stage's own code goes wrong from this step
                for s in stages:
                    if s.stage_index == stage_bug:
                        s.submod.scale = 1.01
            losses = run_step(sched, stages, x, y)
            if bug == "stage-clip" and step >= at:
                torch.nn.utils.clip_grad_norm_(params, 0.05)
            else:
                clip_global(params, 0.05)
            opt.step()
            lrs.step()
            opt.zero_grad()
            watch.end(losses)
    finally:
        watch.close()
    r = watch.report
    return r.ok, r.first_wrong_step, r.stage, r.failure or "", [s.ok for s in r.steps]

def refused():
    # a slice that does not match its stage: refused before the run starts, on every rank
    part = lambda: small_lm(blocks=[[0, 1], [2, 3]][rank], first=rank == 0, last=rank == 1)
    mod = part()
    stage = PipelineStage(mod, rank, 2, device)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    wrong = small_lm(blocks=[[0], [2, 3]][rank], first=rank == 0, last=rank == 1)
    try:
        labkit.watch_run([stage], opt, lm_loss, 4, slices={rank: wrong}, every=4).close()
    except labkit.CheckStepError as e:
        return str(e)
    return ""
"""

pool = module_pool(2, SETUP)


def _run(pool, call: str) -> tuple:
    out = pool.exec(call)
    assert out[0] == out[1], "every rank gets the same report"
    return out[0]


@pytest.mark.parametrize("call", ["sliced_lm(every=1, n=4)", "sliced_lm(every=4, n=9)",
                                  "sliced_blocks('ScheduleInterleaved1F1B', every=2, n=4)"])
def test_a_clean_run_with_slices_holds_at_every_checked_step(pool, call):
    ok, first, stage, failure, steps = _run(pool, call)
    assert ok and first is None and failure == "", failure
    every = 1 if "every=1" in call else 2 if "every=2" in call else 4
    assert all(steps[t] for t in range(0, len(steps), every)), steps


# each planted bug with slices= and every=4: its call, the step and stage it must be named at, words its failure holds
BUGS = {
    "lost state at 10": ("sliced_lm('lost-state', 10, n=12)", 10, 1, "optimizer state of stage 1"),
    "lost state at 6 on rank 0": ("sliced_lm('lost-state', 6, n=9, on=0)", 6, 0, "optimizer state of stage 0"),
    # the snapshots held in memory instead (labkit.check.spill; slices= keeps them off memory by default)
    "lost state at 6 held in memory": ("sliced_lm('lost-state', 6, n=9, spill=False)", 6, 1,
                                       "optimizer state of stage 1"),
    "stage clipping from 5": ("sliced_lm('stage-clip', 5, n=9)", 5, 0, "clipping by a stage's own norm"),
    "interleaved stage clipping from 3": ("sliced_blocks(bug='stage-clip', at=3, n=5)", 3, 0,
                                          "clipping by a stage's own norm"),
    "interleaved stage 2's code from 2": ("sliced_blocks(bug='module', at=2, stage_bug=2, n=5)", 2, 2, "stage 2"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_is_named_at_its_step_and_stage_with_slices(pool, bug):
    call, step, stage, words = BUGS[bug]
    ok, first, where, failure, steps = _run(pool, call)
    assert not ok and (first, where) == (step, stage), (first, where, failure)
    assert words in failure, failure
    assert all(s is not False for s in steps[:step]) and steps[step] is False


def test_with_slices_the_snapshots_are_kept_off_memory_unless_told(pool):
    # labkit.check.spill: by default with slices= (memory is the point), held in memory with spill=False
    for call, store in (("sliced_lm(every=2, n=3)", "Spilled"), ("sliced_lm(every=2, n=3, spill=False)", "HostCopies")):
        ok, _, _, failure, _ = _run(pool, call)
        assert ok, failure
        assert pool.exec("STORE") == {0: store, 1: store}


def test_slices_that_do_not_match_their_stages_are_refused_up_front(pool):
    said = _run(pool, "refused()")
    assert said.startswith("watch_run cannot watch this run") and "slice" in said, said
