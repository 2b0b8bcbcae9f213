"""Where a failed step departs (labkit.check.boundaries through check_step and check_stages), on the
suite's warm 2-rank pool: a small pre-norm transformer (labkit.models.small_lm(), 4 blocks, stages
blocks 0-1 and 2-3 + head) with planted bugs, each located by stage and module in float32 and under
bf16 autocast; check_stages where each rank builds only its own layers (1F1B and ZBVZeroBubble), a
transformers Llama whose stages are materialised from `meta` (no rank builds the whole model), and
check_stages' refusals of a call it cannot compare, on every rank."""

from __future__ import annotations

import pytest

from conftest import module_pool

SETUP = """
import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble
import labkit
from labkit.models import cut_small_lm, lm_loss, small_lm
from labkit import CheckStepError

torch.manual_seed(7)
X, Y = torch.randint(0, 128, (8, 16)), torch.randint(0, 128, (8, 16))
PLAN = {"1F1B": {0: [(0, [0, 1])], 1: [(1, [2, 3])]},
        "ZBV": {0: [(0, [0]), (3, [3])], 1: [(1, [1]), (2, [2])]}}

def plant(mod, stage, bug):
    # the bugs a learner makes, in one stage's module only
    if bug == "bias" and "2" in mod.blocks:
        mod.blocks["2"].down.bias_scale = 1.01
    if bug == "residual" and "3" in mod.blocks:
        mod.blocks["3"].attn_residual = False
    if bug == "load" and "1" in mod.blocks:
        with torch.no_grad():
            mod.blocks["1"].up.weight.mul_(1.01)
    if bug == "backward" and "2" in mod.blocks:
        mod.blocks["2"].up.register_full_backward_hook(lambda m, gi, go: (gi[0] * 1.01,))
    return mod

def step(bug=None, dtype=None, schedule="1F1B", whole=True, **kw):
    full = small_lm()
    n = 2 if schedule == "1F1B" else 4
    stages, slices = [], {}
    for k, blocks in PLAN[schedule][rank]:
        first, last = k == 0, k == n - 1
        mod = cut_small_lm(full, blocks, first, last) if whole else small_lm(blocks=blocks, first=first, last=last)
        slices[k] = small_lm(blocks=blocks, first=first, last=last)
        stages.append(PipelineStage(plant(mod, k, bug), k, n, device))
    x = X
    if bug == "swap" and rank == 0:  # microbatches 1 and 2 fed in the other order
        c = list(X.chunk(4)); c[1], c[2] = c[2], c[1]; x = torch.cat(c)
    losses = []
    with labkit.autocast(dtype) if dtype else torch.autocast("cpu", enabled=False):
        if schedule == "1F1B":
            sched = Schedule1F1B(stages[0], 4, loss_fn=lm_loss)
            sched.step(x) if rank == 0 else sched.step(target=Y, losses=losses)
        else:
            sched = ScheduleZBVZeroBubble(stages, 4, loss_fn=lm_loss)
            sched.step(x, target=Y, losses=losses) if rank == 0 else sched.step()
    if whole:
        return labkit.check_step(full, stages, X, Y, losses, 4, lm_loss, autocast=dtype, **kw)
    return labkit.check_stages(slices, stages, X, Y, losses, 4, lm_loss, autocast=dtype, **kw)
"""

pool = module_pool(2, SETUP)


def _verdict(pool, call: str) -> tuple:
    out = pool.exec(f"_c = {call}; (_c.ok, _c.failure or '', _c.compared == _c.expected, _c.worst_ratio)")
    assert out[0][:3] == out[1][:3], "every rank gets the same verdict"
    return out[0]


# each planted bug: the words its failure must contain (the stage, then the module, then the kind)
LOCATED = {
    "bias": ("stage 1 departs at blocks.2.down:", "while its input agrees"),
    "residual": ("stage 1 departs inside blocks.3:", "the input of blocks.3.ln2"),
    "load": ("stage 0's 'blocks.1.up.weight'", "a loading or copying bug"),
    "swap": ("stage 0 received another microbatch's input", "microbatch 1 got microbatch 2's, 2 got 1's",
             "its module computes as the unsplit model"),
    "backward": ("stage 1's forward agrees", "backward-only bug in blocks.2.up"),
}


@pytest.mark.launches
@pytest.mark.parametrize("dtype", [None, "torch.bfloat16"])
def test_a_correct_transformer_step_passes_in_float32_and_bf16(pool, dtype):
    ok, failure, complete, worst = _verdict(pool, f"step(dtype={dtype})")
    assert ok and complete and worst <= 2.0, failure


@pytest.mark.launches
@pytest.mark.parametrize("dtype", [None, "torch.bfloat16"])
@pytest.mark.parametrize("bug", sorted(LOCATED))
def test_each_planted_bug_is_located_by_stage_and_module(pool, bug, dtype):
    ok, failure, _, _ = _verdict(pool, f"step(bug={bug!r}, dtype={dtype})")
    assert not ok
    for words in LOCATED[bug]:
        assert words in failure, failure
    assert failure.index(LOCATED[bug][0]) < 5, "where comes first: " + failure


@pytest.mark.launches
@pytest.mark.parametrize("schedule", ["1F1B", "ZBV"])
def test_check_stages_without_the_whole_model(pool, schedule):
    """Each rank builds only its own blocks; the correct step passes in float32 and bf16, a bias bug
    is located in the stage that holds block 2 (stage 1 under either placement) and a weight loaded
    wrong is named by its parameter."""
    for dtype in (None, "torch.bfloat16"):
        ok, failure, complete, worst = _verdict(pool, f"step(dtype={dtype}, schedule={schedule!r}, whole=False)")
        assert ok and complete and worst <= 2.0, failure
    ok, failure, _, _ = _verdict(pool, f"step(bug='bias', schedule={schedule!r}, whole=False)")
    assert not ok and failure.startswith("stage 2 departs at blocks.2.down:" if schedule == "ZBV" else
                                         "stage 1 departs at blocks.2.down:"), failure
    ok, failure, _, _ = _verdict(pool, f"step(bug='load', schedule={schedule!r}, whole=False)")
    assert not ok and "'blocks.1.up.weight'" in failure and "loading or copying bug" in failure, failure


@pytest.mark.launches
def test_check_stages_refuses_on_every_rank_what_it_cannot_compare(pool):
    code = """
full = small_lm(); stage = PipelineStage(cut_small_lm(full, PLAN["1F1B"][rank][0][1], rank == 0, rank == 1), rank, 2, device)
def refusal(slices, losses):
    try:
        labkit.check_stages(slices, [stage], X, Y, losses, 4, lm_loss)
    except CheckStepError as e:
        return str(e)
    return None
wrong_names = {rank: small_lm(blocks=[3], first=rank == 0, last=rank == 1)}
(refusal(wrong_names, [torch.tensor(1.0)] * 4 if rank == 1 else []),
 refusal({rank: stage.submod}, [torch.tensor(1.0)] * 4 if rank == 1 else []),
 refusal({rank: small_lm(blocks=PLAN["1F1B"][rank][0][1], first=rank == 0, last=rank == 1)}, [torch.tensor(1.0)] * 4),
 refusal({}, [torch.tensor(1.0)] * 4 if rank == 1 else []))
"""
    out = pool.exec(code)
    assert out[0] == out[1], "the same refusal on every rank"
    names, shared, losses, missing = out[0]
    assert "name their parameters differently" in names, names
    assert "shares parameters with the stage module" in shared, shared
    assert "rank 0 holds no last stage but passed 4 losses" in losses, losses
    assert "passed slices for []" in missing, missing


@pytest.mark.launches
def test_check_stages_on_a_llama_no_rank_builds_whole(pool):
    """transformers' Llama from config, 4 decoder layers over 2 ranks: each rank materialises its stage
    and its slice from `meta` (labkit.models.hf.meta_stage); the correct step passes; a 1% error in
    stage 1's last MLP projection is located there."""
    code = """
import dataclasses
from labkit.models import hf
from labkit import PRESETS
pre = dataclasses.replace(PRESETS["tiny"], n_layers=4)
def llama_step(bug=False):
    stage_mod = hf.meta_stage("llama", pre, rank, [0, 2, 4], device)
    if bug and rank == 1:
        stage_mod.get_submodule("model.layers.3.mlp.down_proj").register_forward_hook(lambda m, a, o: o * 1.01)
    x, y, kw = hf.make_batch("llama", pre, 8, 0)
    st = PipelineStage(stage_mod, rank, 2, device)
    losses = []
    sched = Schedule1F1B(st, 4, loss_fn=hf.loss_fn)
    sched.step(x, **kw) if rank == 0 else sched.step(target=y, losses=losses, **kw)
    c = labkit.check_stages({rank: hf.meta_stage("llama", pre, rank, [0, 2, 4], device)}, [st], x, y, losses, 4,
                            hf.loss_fn, kwargs=kw)
    return c.ok, c.failure or "", c.compared == c.expected
(llama_step(), llama_step(bug=True))
"""
    out = pool.exec(code)
    assert out[0] == out[1]
    (ok, failure, complete), (bad, where, _) = out[0]
    assert ok and complete, failure
    assert not bad and where.startswith("stage 1 departs at model.layers.3.mlp.down_proj:"), where
