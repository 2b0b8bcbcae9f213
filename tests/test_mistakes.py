"""The mistakes learners make in notebooks 01-13, each made on live ranks (labkit.ranks): the message
names the mistake, and the pool is not restarted (a variable set before is still there after, the
rank processes are the same). One pool of 2 gloo ranks for the whole file.

check_step's own refusals (wrong M, losses on the wrong rank, renumbered stage names, the wrong
group) are raised on every rank before any collective. torch's own errors inside step() leave the
other rank waiting in a send or recv, and step() on one rank only leaves that rank waiting for a
peer that left the cell: the pool releases such ranks (every rank ends its gloo connections, the
waits fail, every rank joins a new process group) instead of restarting.
"""

from __future__ import annotations

import time

import pytest

from conftest import module_pool
from labkit.ranks import RanksError

pytestmark = pytest.mark.launches  # every test here starts, or runs on, processes that import torch

SETUP = """
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from labkit.check.reference import CheckStepError, check_step

torch.manual_seed(0)
full = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
x, y = torch.randn(8, 8), torch.randn(8, 8)
mse = nn.functional.mse_loss

def build(M=4, stage_index=None, part=None, group=None):
    global stage, sched
    part = part if part is not None else (full[0:2] if rank == 0 else full[2:4])
    stage = PipelineStage(part, rank if stage_index is None else stage_index, world_size, device, group=group)
    sched = ScheduleGPipe(stage, n_microbatches=M, loss_fn=mse)

def step(inputs=None):
    global losses
    losses = []
    full.zero_grad(set_to_none=True)
    sched.step(x if inputs is None else inputs) if rank == 0 else sched.step(target=y, losses=losses)

kept = 100 + rank
"""
GOOD = "build(4); step(); check_step(full, [stage], x, y, losses, 4, mse).ok"


pool = module_pool(2, SETUP)  # the suite's warm 2-rank pool (conftest.live_ranks), set up, cleaned after


def _mistake(pool, code: str, timeout: float = 60) -> tuple[str, float]:
    """Run a cell that must fail; its message and how long it took. The pool must not restart."""
    pids, restarts = pool.pids(), pool.status()["restarts"]
    t = time.monotonic()
    with pytest.raises(RanksError) as e:
        pool.exec(code, timeout=timeout)
    took = time.monotonic() - t
    assert not e.value.restarted, str(e.value)
    assert pool.pids() == pids and pool.status()["restarts"] == restarts
    assert pool.exec("kept") == {0: 100, 1: 101}, "every namespace must survive"
    return str(e.value), took


def _works_after(pool) -> None:
    """A correct step and check on the same ranks afterwards (the process group works)."""
    assert pool.exec(GOOD) == {0: True, 1: True}


def test_a_correct_step_matches(pool):
    _works_after(pool)


def test_check_step_with_another_microbatch_count_than_the_schedule(pool):
    """The issue's case: a 4-microbatch step checked with n_microbatches=2. Rank 1 used to raise
    alone while rank 0 entered a broadcast: rank 0 was killed and the pool restarted."""
    msg, _ = _mistake(pool, "build(4); step(); check_step(full, [stage], x, y, losses, 2, mse)")
    assert "Cell" in msg and "failed on ranks 0, 1 (the same error on each)" in msg
    assert "CheckStepError" in msg and "wrong microbatch count" in msg
    assert "stepped the stages with 4 microbatches, check_step got n_microbatches=2" in msg
    assert "rank 1 (the last stage) holds 4 losses" in msg
    assert "broadcast" not in msg and "did not finish" not in msg
    _works_after(pool)


def test_check_step_with_stage_children_renumbered(pool):
    """Stage 1 = nn.Sequential(*full[2:4]): its names are 0.weight..., stage 0's names. It was compared
    with stage 0's gradients and reported as a tolerance problem."""
    msg, _ = _mistake(pool, "build(4, part=full[0:2] if rank == 0 else nn.Sequential(*full[2:4])); step()\n"
                            "check_step(full, [stage], x, y, losses, 4, mse)")
    assert "failed on ranks 0, 1 (the same error on each)" in msg
    assert "parameter names collide across stages" in msg and "(stages 0 and 1)" in msg
    assert "'0.bias', '0.weight'" in msg and "renumbered 0..k" in msg
    assert "tolerance" not in msg and "mismatch" not in msg
    _works_after(pool)


def test_losses_on_the_wrong_rank(pool):
    # check_step: losses passed on the first stage's rank, none on the last's
    msg, _ = _mistake(pool, "build(4); step()\n"
                            "check_step(full, [stage], x, y, [0.0] * 4 if rank == 0 else [], 4, mse)")
    assert "failed on ranks 0, 1 (the same error on each)" in msg
    assert "rank 0 holds no last stage but passed 4 losses" in msg
    assert "rank 1 holds the last stage but got no losses" in msg
    # the step itself: target= and losses= given to the first stage, nothing to the last (torch's error;
    # rank 0 is left waiting in a recv and is released)
    msg, _ = _mistake(pool, "build(4); losses = []\n"
                            "sched.step(x, target=y, losses=losses) if rank == 0 else sched.step()")
    assert "failed on rank 1" in msg and "loss_fn and target required for last stage" in msg
    assert "The pool released rank 0" in msg and "keeps its namespace" in msg
    _works_after(pool)


def test_a_wrong_stage_index(pool):
    msg, _ = _mistake(pool, "build(4, stage_index=0); step()")
    assert msg.startswith("Likely mistake: stage 0 was built on ranks 0, 1")
    assert "a wrong stage_index?" in msg and "The pool released" in msg
    # and check_step, given stages that two ranks hold, says so before comparing anything
    msg, _ = _mistake(pool, "build(4); step()\n"
                            "if rank == 1:\n    stage.stage_index = 0\n"
                            "check_step(full, [stage], x, y, losses, 4, mse)")
    assert "stage 0 is held by rank 0 and rank 1" in msg and "failed on ranks 0, 1 (the same error on each)" in msg
    _works_after(pool)


def test_schedules_built_with_different_microbatch_counts(pool):
    msg, _ = _mistake(pool, "build(4 if rank == 0 else 2); step()")
    assert "different n_microbatches (rank 0: 4, rank 1: 2)" in msg and "The pool released" in msg
    _works_after(pool)


def test_check_step_over_the_wrong_group(pool):
    """Each rank passes a group that holds only itself (e.g. the data-parallel group instead of the
    pipeline's): the check sees one stage of two and says which group to pass."""
    msg, _ = _mistake(pool, "build(4); step()\ngroups = [dist.new_group([0]), dist.new_group([1])]\n"
                            "check_step(full, [stage], x, y, losses, 4, mse, group=groups[rank])")
    assert "no rank of the pipeline holds stage 1 of 2" in msg and "no rank of the pipeline holds stage 0 of 2" in msg
    assert "pass group=the pipeline's process group" in msg
    _works_after(pool)


def test_a_tensor_on_the_wrong_device(pool):
    msg, _ = _mistake(pool, "build(4); step(inputs=x.to('meta'))")
    assert "failed on rank 0" in msg and "is not on the expected device meta" in msg
    assert "The pool released rank 1" in msg
    _works_after(pool)


def test_step_on_one_rank_only(pool):
    """Rank 0 steps, rank 1 does not: rank 0 waits for a peer that already left the cell. The pool
    says so well before the cell's deadline, releases rank 0, and the namespaces live on."""
    msg, took = _mistake(pool, "build(4)\nif rank == 0:\n    step()", timeout=120)
    assert "Rank 0 kept waiting in torch.distributed" in msg and "after rank 1 had left cell" in msg
    assert "step() (or a collective) ran on some ranks only?" in msg
    assert "The pool released rank 0" in msg and "namespace was lost" not in msg
    assert took < 60, f"{took:.1f} s: the stranded rank must be found well before the 120 s deadline"
    print(f"step() on one rank only: answered after {took:.1f} s")
    _works_after(pool)
