"""labkit.watch_run (labkit.check.watch) on the suite's warm 2-rank pool: the small LM (labkit.models.small_lm)
cut in two stages, 1F1B, AdamW with weight decay, a warm-up LambdaLR, clipping by the global norm. A clean run
holds at every step; each planted bug is named at its exact step and stage (a lost optimizer state, the lr
scheduler stepped once more on one rank, zero_grad skipped on one rank, clipping by a stage's own norm, a
resume that does not load the optimizer's state), checked every step and every 4 steps."""

from __future__ import annotations

import pytest

from conftest import module_pool

pytestmark = pytest.mark.launches  # the suite's warm pool

SETUP = """
import copy
import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
import labkit
from labkit.models import cut_small_lm, lm_loss, small_lm

def watched(bug=None, at=0, every=1, n=12, dtype=None):
    full = small_lm()
    mod = cut_small_lm(full, [[0, 1], [2, 3]][rank], rank == 0, rank == 1)
    stage = PipelineStage(mod, rank, 2, device)
    sched = Schedule1F1B(stage, 4, loss_fn=lm_loss)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1)
    warm = lambda s: min(1.0, (s + 1) / 20)
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    watch = labkit.watch_run([stage], opt, lm_loss, 4, full=full, every=every, autocast=dtype)
    g = torch.Generator().manual_seed(0)
    try:
        for step in range(n):
            x, y = torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g)
            if bug and bug.startswith("resume") and step == at:  # a checkpoint loaded into a new optimizer
                saved = copy.deepcopy(opt.state_dict()), lrs.state_dict()
                opt = torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1)
                lrs = torch.optim.lr_scheduler.LambdaLR(opt, warm)
                if not (bug == "resume-no-state" and rank == 1):
                    opt.load_state_dict(saved[0])
                lrs.load_state_dict(saved[1])
            watch.begin(x, y)
            losses = []
            with labkit.autocast(dtype) if dtype else torch.autocast("cpu", enabled=False):
                sched.step(x) if rank == 0 else sched.step(target=y, losses=losses)
            if bug == "stage-clip":
                torch.nn.utils.clip_grad_norm_(mod.parameters(), 0.5)
            else:
                sq = torch.tensor([sum(float(p.grad.double().pow(2).sum()) for p in mod.parameters())])
                dist.all_reduce(sq)
                for p in mod.parameters():
                    p.grad.mul_(min(1.0, 0.5 / (float(sq) ** 0.5 + 1e-6)))
            if bug == "lost-state" and step == at and rank == 1:
                opt.state.clear()
            opt.step()
            lrs.step()
            if bug == "extra-lr-step" and step == at and rank == 1:
                lrs.step()
            if not (bug == "no-zero-grad" and step >= at - 1 and rank == 1):
                opt.zero_grad()
            watch.end(losses)
    finally:
        watch.close()
    r = watch.report
    return r.ok, r.first_wrong_step, r.stage, r.failure or "", [s.ok for s in r.steps]

def scenario(bug=None, at=0, every=1, n=20, on=1, spill=None):
    # the issue's check as a user writes it: 20 steps, zero_grad first in each step, the bug on rank `on`
    full = small_lm()
    mod = cut_small_lm(full, [[0, 1], [2, 3]][rank], rank == 0, rank == 1)
    stage = PipelineStage(mod, rank, 2, device)
    sched = Schedule1F1B(stage, 4, loss_fn=lm_loss)
    make = lambda: torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1)
    opt = make()
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    watch = labkit.watch_run([stage], opt, lm_loss, 4, full=full, every=every, spill=spill)
    g = torch.Generator().manual_seed(0)
    mine = rank == on
    try:
        for step in range(n):
            x, y = torch.randint(0, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g)
            if bug in ("resume", "resume-no-state") and step == at:  # a checkpoint loaded into a new optimizer
                saved = copy.deepcopy(opt.state_dict()), lrs.state_dict()
                opt = make()
                lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
                if not (bug == "resume-no-state" and mine):
                    opt.load_state_dict(saved[0])
                lrs.load_state_dict(saved[1])
            if bug == "state-rewritten" and step == at:  # loaded again in place, the same values (as dcp.load)
                for v in (v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)):
                    v.copy_(v.clone())
            if bug == "state-zeroed" and step == at and mine:
                for s in opt.state.values():
                    s["exp_avg"].zero_()
            if bug == "weights-edited" and step == at and mine:
                with torch.no_grad():
                    next(mod.parameters()).mul_(1.001)
            watch.begin(x, y)
            if not (bug == "no-zero-grad" and step >= at and mine):
                opt.zero_grad()
            losses = []
            sched.step(x) if rank == 0 else sched.step(target=y, losses=losses)
            if bug == "stage-clip":
                torch.nn.utils.clip_grad_norm_(mod.parameters(), 0.5)
            else:
                sq = torch.tensor([sum(float(p.grad.double().pow(2).sum()) for p in mod.parameters())])
                dist.all_reduce(sq)
                torch.nn.utils.clip_grads_with_norm_(mod.parameters(), 0.5, sq.sqrt()[0])
            if bug == "lost-state" and step == at and mine:
                opt.state.clear()
            opt.step()
            lrs.step()
            if bug == "extra-lr-step" and step == at and mine:
                lrs.step()
            watch.end(losses)
    finally:
        watch.close()
    r = globals()["LAST"] = watch.report
    return r.ok, r.first_wrong_step, r.stage, r.failure or "", [s.ok for s in r.steps]
"""

pool = module_pool(2, SETUP)


def _run(pool, call: str) -> tuple:
    out = pool.exec(call)
    assert out[0] == out[1], "every rank gets the same report"
    return out[0]


@pytest.mark.parametrize("every", [1, 4])
def test_clean_run_holds_at_every_step(pool, every):
    ok, first, stage, failure, steps = _run(pool, f"watched(every={every}, n=9)")
    assert ok and first is None and failure == "", failure
    assert all(steps[t] for t in range(0, 9, every))


def test_clean_run_under_bf16_autocast(pool):
    ok, first, _, failure, _ = _run(pool, "watched(n=4, dtype=torch.bfloat16)")
    assert ok, failure


# each planted bug: its call, the step and stage it must be named at, words its failure must hold
BUGS = {
    "lost-state": ("watched('lost-state', 10, n=12)", 10, 1, "optimizer state of stage 1"),
    "extra-lr-step": ("watched('extra-lr-step', 6, n=8)", 6, 1, "learning rate"),
    "no-zero-grad": ("watched('no-zero-grad', 8, n=10)", 8, 1, "not zeroed"),
    "stage-clip": ("watched('stage-clip', n=2)", 0, 0, "clipping by a stage's own norm"),
    "no-zero-grad every 4": ("watched('no-zero-grad', 7, every=4, n=9)", 7, 1, "not zeroed"),
    "resume every 4": ("watched('resume-no-state', 6, every=4, n=9)", 6, 1, "optimizer state of stage 1"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_is_named_at_its_step_and_stage(pool, bug):
    call, step, stage, words = BUGS[bug]
    ok, first, where, failure, steps = _run(pool, call)
    assert not ok and (first, where) == (step, stage), (first, where, failure)
    assert words in failure, failure
    assert all(s is not False for s in steps[:step]) and steps[step] is False


def test_a_correct_resume_checked_every_4_steps_holds(pool):
    ok, _, _, failure, _ = _run(pool, "watched('resume', 6, every=4, n=9)")
    assert ok, failure


# the issue's own check (2 ranks, 1F1B, AdamW with weight decay, a warm-up LambdaLR, clipping by the global
# norm, 20 steps, zero_grad first in each step): each bug named at its exact step and stage
SCENARIOS = {
    "clean": ("scenario()", None, None, ""),
    "clean every 4": ("scenario(every=4)", None, None, ""),
    "lost state at 10": ("scenario('lost-state', 10)", 10, 1, "optimizer state of stage 1"),
    "lost state at 10 on rank 0": ("scenario('lost-state', 10, on=0)", 10, 0, "optimizer state of stage 0"),
    "extra lr step at 12": ("scenario('extra-lr-step', 12)", 12, 1, "learning rate"),
    "no zero_grad from 8": ("scenario('no-zero-grad', 8)", 8, 1, "not zeroed"),
    "no zero_grad from 8 every 4": ("scenario('no-zero-grad', 8, every=4)", 8, 1, "not zeroed"),
    "stage clipping": ("scenario('stage-clip')", 0, 0, "clipping by a stage's own norm"),
    "resume every 4": ("scenario('resume', 10, every=4)", None, None, ""),
    "resume without state every 4": ("scenario('resume-no-state', 10, every=4)", 10, 1,
                                     "optimizer state of stage 1"),
    # the fingerprints are taken again only where a tensor was written since (labkit.versions.unchanged_token):
    # a state written again with its own values holds, one zeroed in place or weights edited are named
    "state written again in place": ("scenario('state-rewritten', 6, n=9, every=4)", None, None, ""),
    "state zeroed in place at 6": ("scenario('state-zeroed', 6, n=9, every=4)", 6, 1, "optimizer state of stage 1"),
    "weights edited at 5": ("scenario('weights-edited', 5, n=7, every=4)", 5, 1, "changed between"),
}


@pytest.mark.parametrize("case", list(SCENARIOS))
def test_the_issues_20_step_scenarios(pool, case):
    call, step, stage, words = SCENARIOS[case]
    ok, first, where, failure, steps = _run(pool, call)
    assert (first, where) == (step, stage), (first, where, failure)
    assert ok == (step is None) and words in failure, failure
    if step is not None:
        assert all(s is not False for s in steps[:step]) and steps[step] is False


@pytest.mark.parametrize("case", ["lost state at 10", "no zero_grad from 8 every 4", "resume without state every 4"])
def test_snapshots_kept_off_memory_give_the_same_verdicts(pool, case):
    # labkit.check.spill: with full= the snapshots are held in memory by default; spill=True keeps them in a file
    call, step, stage, words = SCENARIOS[case]
    ok, first, where, failure, _ = _run(pool, call.replace(")", ", spill=True)", 1) if "(" in call else call)
    assert (first, where) == (step, stage) and ok == (step is None) and words in failure, (first, where, failure)


def test_a_spill_that_is_not_a_folder_is_refused_up_front(pool):
    said = pool.exec("""
try:
    labkit.watch_run([], None, lm_loss, 4, full=small_lm(), spill="/no/such/folder")
except labkit.CheckStepError as e:
    said = str(e)
said""")
    assert said[0] == said[1] and "spill must be True" in said[0] and "'/no/such/folder'" in said[0], said


def test_each_checked_step_carries_its_loss_floor_and_stage_distances(pool):
    _run(pool, "scenario(n=4)")
    steps = _run(pool, "[(s.loss, s.reference_loss, s.loss_err, s.loss_floor, s.stages) for s in LAST.steps]")
    for loss, ref, err, floor, stages in steps:
        assert floor > 0 and err <= 2 * floor and abs(loss - ref) == err, (loss, ref, err, floor)
        assert sorted(stages) == [0, 1] and all(e <= 2 * f for e, f in stages.values()), stages
    said = _run(pool, "LAST.drift([s.loss for s in LAST.steps]).text")
    assert said.startswith("noise: every step held") and "within its loss floor" in said, said


def test_wire_shares_named_tensors_of_several_dtypes_from_one_rank(pool):
    # labkit.check.wire: what the watch sends at a check (weights, references' gradients), one broadcast per dtype
    got = pool.exec("""
from labkit.check import wire
g = torch.Generator().manual_seed(5)
made = {"b.w": torch.randn(3, 4, generator=g), "a.t": torch.randn(5, generator=g, dtype=torch.float64),
        "c.n": torch.arange(6).reshape(2, 3), "d.s": torch.randn((), generator=g)}
meta = [None, None]
dist.all_gather_object(meta, wire.layout(made) if rank == 1 else None)
out = wire.share(None, 1, meta[1], made if rank == 1 else None, wire.wire_device(None, "cpu"))
sorted(out) == sorted(made) and all(out[n].dtype == made[n].dtype and torch.equal(out[n], made[n]) for n in made)
""")
    assert got == {0: True, 1: True}, got


@pytest.mark.parametrize("case", ["clean every 4", "lost state at 10", "no zero_grad from 8 every 4"])
def test_the_update_replayed_in_pieces_gives_the_same_verdicts(pool, case):
    # labkit.check.update.REPLAY_ELEMENTS: the update replayed a few parameters at a time (bounded memory at a
    # check); here so small that most parameters are a piece of their own
    call, step, stage, words = SCENARIOS[case]
    pool.exec("import labkit.check.update as U; U.REPLAY_ELEMENTS, _kept = 600, U.REPLAY_ELEMENTS")
    try:
        ok, first, where, failure, _ = _run(pool, call)
    finally:
        pool.exec("U.REPLAY_ELEMENTS = _kept")
    assert (first, where) == (step, stage) and ok == (step is None) and words in failure, (first, where, failure)


def test_replay_chunks_keeps_each_group_and_name_in_order():
    import torch

    from labkit.check.update import replay_chunks

    weights = {n: torch.zeros(s) for n, s in [("a", 3), ("b", 5), ("c", 2), ("d", 4), ("e", 1), ("f", 9)]}
    import labkit.check.update as U

    kept, U.REPLAY_ELEMENTS = U.REPLAY_ELEMENTS, 8
    try:
        got = replay_chunks({1: ["c", "d"], 0: ["a", "b"], 2: ["e", "f"]}, weights)
    finally:
        U.REPLAY_ELEMENTS = kept
    # in order of group, then name; a piece closes before it would pass 8 elements; one larger than 8 alone
    assert got == [([0], [["a", "b"]]), ([1, 2], [["c", "d"], ["e"]]), ([2], [["f"]])], got
