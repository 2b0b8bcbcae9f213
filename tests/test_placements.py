"""No false failure on any placement or naming (issue 56): every schedule (all seven; one and two stages
per rank, looped and V-shaped placement) on 2 and 4 live ranks, with stage modules that share their
parameter names (each stage one `Block`: 'lin.weight' on every stage) and with the unsplit model's
distinct names (a manual cut that keeps 'blocks.<i>.'), checked by check_step and by check_stages:
every correct step passes; a planted bug still fails, placed by stage; names that cannot be mapped
raise CheckStepError with the fix, on every rank; a parameter given no gradient is named with which of
three reasons it was (its module never ran, its output was cut off from the loss, it never used the
parameter), measured, on both checks."""

from __future__ import annotations

import pytest

from conftest import module_pool

SETUP = """
import copy
import torch, torch.nn as nn
import torch.distributed as dist
import torch.distributed.pipelining as P
from torch.distributed.pipelining import PipelineStage
import labkit
from labkit.worker import placement, run_step

class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(d), nn.Linear(d, d)
        self.scale = 1.0
    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x))) * self.scale

class Net(nn.Module):   # the unsplit model, names 'blocks.<i>.lin.weight'
    def __init__(self, n):
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(n)})
    def forward(self, x):
        for b in self.blocks.values():
            x = b(x)
        return x

def keep(net, k):   # a manual cut: the unsplit model with the other stages' blocks deleted (its names kept)
    m = copy.deepcopy(net)
    for key in list(m.blocks):
        if key != str(k):
            del m.blocks[key]
    return m

mse = lambda o, t: ((o - t) ** 2).mean()
g = torch.Generator().manual_seed(3)
X, Y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
M = 8  # DualPipeV wants as many microbatches as stages

def case(name, per_rank, shared, how, bug=None):
    cls = getattr(P, name)
    n = dist.get_world_size() * per_rank
    torch.manual_seed(0)
    net = Net(n)
    full = nn.Sequential(*[copy.deepcopy(b) for b in net.blocks.values()])  # names '<i>.lin.weight'
    held = placement(cls, n)
    mods = {k: copy.deepcopy(full[k]) if shared else keep(net, k) for k in held}
    if bug is not None and bug in mods:
        (mods[bug] if shared else mods[bug].blocks[str(bug)]).scale = 1.01
    stages = [PipelineStage(mods[k], k, n, device) for k in held]
    multi = issubclass(cls, P.schedules.PipelineScheduleMulti)
    sched = cls(stages if multi else stages[0], M, loss_fn=mse)
    losses = run_step(sched, stages, X, Y)
    if how == "step":
        c = labkit.check_step(full if shared else net, stages, X, Y, losses, M, mse)
    else:
        slices = {k: copy.deepcopy(full[k]) if shared else keep(net, k) for k in held}
        c = labkit.check_stages(slices, stages, X, Y, losses, M, mse)
    return c.ok, c.failure or "", c.compared == c.expected
"""

pool2 = module_pool(2, SETUP)
pool4 = module_pool(4, SETUP)

SINGLE = ["ScheduleGPipe", "Schedule1F1B"]
LOOPED = ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble"]
V = ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
PLACEMENTS = [(s, 1) for s in SINGLE + LOOPED] + [(s, 2) for s in LOOPED + V]


def _run(pool, name, per_rank, shared, how, bug=None):
    out = pool.exec(f"case({name!r}, {per_rank}, {shared}, {how!r}, {bug!r})")
    assert all(o == out[0] for o in out.values()), f"every rank gets the same verdict: {out}"
    return out[0]


@pytest.mark.launches
@pytest.mark.parametrize("ranks", [2, 4])
def test_every_correct_step_passes_on_every_placement_and_naming(pool2, pool4, ranks):
    pool = pool2 if ranks == 2 else pool4
    failed = []
    for name, per_rank in PLACEMENTS:
        for shared in (True, False):
            for how in ("step", "stages"):
                ok, failure, complete = _run(pool, name, per_rank, shared, how)
                if not (ok and complete):
                    failed.append(f"{name} x{per_rank} {'shared' if shared else 'distinct'} names, check_{how}: "
                                  f"{failure}")
    assert not failed, "\n".join(failed)


@pytest.mark.launches
@pytest.mark.parametrize("name", LOOPED[:1] + V)
def test_a_bug_on_a_rank_with_two_stages_is_placed_on_its_stage(pool4, name):
    bug = 5  # on rank 1 (looped: stages 1, 5) or rank 2 (V: stages 2, 5)
    for shared in (True, False):
        for how in ("step", "stages"):
            ok, failure, _ = _run(pool4, name, 2, shared, how, bug)
            assert not ok
            assert failure.startswith(f"stage {bug} departs at blocks.{bug}") or \
                failure.startswith(f"stage {bug}'s output is"), failure


@pytest.mark.launches
def test_shared_names_the_unsplit_model_cannot_map_raise_the_fix(pool2):
    code = """
try:
    torch.manual_seed(0)
    net = Net(4)
    held = placement(P.ScheduleInterleaved1F1B, 4)
    stages = [PipelineStage(copy.deepcopy(net.blocks[str(k)]), k, 4, device) for k in held]
    sched = P.ScheduleInterleaved1F1B(stages, M, loss_fn=mse)
    losses = run_step(sched, stages, X, Y)
    labkit.check_step(net, stages, X, Y, losses, M, mse)
    said = "no error"
except labkit.CheckStepError as e:
    said = str(e)
said
"""
    out = pool2.exec(code)
    assert out[0] == out[1]
    assert "renamed=" in out[0] and "names that the unsplit model does not have" in out[0], out[0]


MASKED = """
class MaskedBlock(Block):
    def forward(self, x, mask):
        return x + torch.tanh(self.lin(self.norm(x))) * mask[:, None]

MASK = torch.rand(16, generator=g)

def masked(how, roll_on=2):
    # 1F1B over every rank; the rank holding stage `roll_on` passes its masks rolled by one microbatch
    n = dist.get_world_size()
    torch.manual_seed(0)
    full = nn.Sequential(*[MaskedBlock() for _ in range(n)])
    stage = PipelineStage(copy.deepcopy(full[rank]), rank, n, device)
    sched = P.Schedule1F1B(stage, M, loss_fn=mse)
    parts = list(MASK.chunk(M))
    mask = torch.cat(parts[-1:] + parts[:-1]) if rank == roll_on else MASK
    losses = run_step(sched, [stage], X, Y, mask=mask)
    if how == "step":
        class Whole(nn.Sequential):
            def forward(self, x, mask):
                for b in self:
                    x = b(x, mask)
                return x
        c = labkit.check_step(Whole(*full), [stage], X, Y, losses, M, mse, kwargs={"mask": MASK})
    else:
        c = labkit.check_stages({rank: copy.deepcopy(full[rank])}, [stage], X, Y, losses, M, mse,
                                       kwargs={"mask": MASK})
    return c.ok, c.failure or "", c.where
"""


@pytest.mark.launches
@pytest.mark.parametrize("how", ["step", "stages"])
def test_a_stage_fed_another_microbatchs_kwarg_is_named_first(pool4, how):
    """The learner's case: the padding masks rolled by one microbatch on stage 2 only. The check names
    the stage and the kwarg, which microbatch got whose cut, and that the stage's module computes right."""
    pool4.exec(MASKED)
    out = pool4.exec(f"masked({how!r})")
    ok, failure, where = out[0]
    assert all(o == out[0] for o in out.values())
    assert not ok
    assert failure.startswith("stage 2 received another microbatch's `mask`: microbatch 0 got microbatch 7's, "
                              "1 got 0's"), failure
    assert "its module computes as" in failure, failure
    assert where in failure, "one first place in failure and where"


NO_GRAD = """
class Skipped(Block):   # lin never runs
    def forward(self, x):
        return x + torch.tanh(self.norm(x)) * self.scale

class Detached(Block):  # lin runs and uses its weight and bias, its output cut off from the loss
    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)).detach())

class NoBias(nn.Linear):  # runs, and never uses its bias
    def forward(self, x):
        return nn.functional.linear(x, self.weight)

def no_grad_step(bug, how):
    torch.manual_seed(0)
    full = nn.Sequential(*[Block() for _ in range(dist.get_world_size())])
    mod = copy.deepcopy(full[rank])
    if rank == 1 and bug == "ignored":
        mod.lin.__class__ = NoBias
    elif rank == 1:
        mod.__class__ = {"skipped": Skipped, "detached": Detached}[bug]
    stage = PipelineStage(mod, rank, dist.get_world_size(), device)
    losses = run_step(P.Schedule1F1B(stage, M, loss_fn=mse), [stage], X, Y)
    c = labkit.check_step(full, [stage], X, Y, losses, M, mse) if how == "step" else \\
        labkit.check_stages({rank: copy.deepcopy(full[rank])}, [stage], X, Y, losses, M, mse)
    return c.ok, c.failure or "", c.where, c.no_grad
"""

NEVER_RAN = "its module never ran in the stage's forward"
CUT_OFF = "its module ran in the stage's forward and used it, but its output was cut off from the loss"
UNUSED = "its module ran in the stage's forward but never used it"
WHY = {"skipped": ({"lin.weight", "lin.bias"}, NEVER_RAN),  # the parameters with no gradient, and why
       "detached": ({"norm.weight", "norm.bias", "lin.weight", "lin.bias"}, CUT_OFF),
       "ignored": ({"lin.bias"}, UNUSED)}


@pytest.mark.launches
@pytest.mark.parametrize("how", ["step", "stages"])
@pytest.mark.parametrize("bug", sorted(WHY))
def test_a_missing_gradient_says_which_of_three_reasons(pool2, bug, how):
    """A parameter of stage 1 gets no gradient three ways, each told apart from one forward of the stage:
    its module skipped, its module's output detached, a Linear whose forward drops its bias."""
    pool2.exec(NO_GRAD)
    ok, failure, where, no_grad = pool2.exec(f"no_grad_step({bug!r}, {how!r})")[0]
    names, why = WHY[bug]
    assert not ok and {".".join(n.rsplit("'", 2)[1].split(".")[-2:]) for n in no_grad} == names, (no_grad, failure)
    assert all(n.startswith("stage 1's ") for n in no_grad), no_grad
    assert why in failure and all(w not in failure for w in {NEVER_RAN, CUT_OFF, UNUSED} - {why}), failure
    assert failure.count("(") == failure.count(")"), failure
    assert where == failure


def test_why_no_grad_is_measured_on_one_forward_of_the_stage():
    """Without ranks: `what_ran` on a stage whose module skips a layer, detaches one, runs one under
    torch.no_grad(), drops a bias or reads only a weight's dtype; and a parameter frozen on the stage."""
    from types import SimpleNamespace

    import torch
    import torch.nn as nn

    from labkit.check.located import what_ran, why_no_grad
    from labkit.spans import received

    class NoBias(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(x.to(self.bias.dtype), self.weight)  # the bias's dtype only

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.skipped, self.detached, self.quiet, self.nobias = (nn.Linear(4, 4) for _ in range(4))
            self.nobias.__class__ = NoBias

        def forward(self, x):
            with torch.no_grad():
                q = self.quiet(x)
            return self.nobias(x) + self.detached(x).detach() + q

    mod = Stage()
    stage = SimpleNamespace(submod=mod, stage_index=0, device="cpu")
    setattr(stage, received.ATTR, {0: {"args": [], "kwargs": {}}})
    ran = what_ran(stage, torch.randn(8, 4), None, 2)
    why = {n: why_no_grad(n, p, ran) for n, p in mod.named_parameters()}
    assert why["skipped.weight"].startswith(NEVER_RAN), why
    assert why["detached.bias"].startswith(CUT_OFF) and why["quiet.weight"].startswith(CUT_OFF), why
    assert why["nobias.bias"].startswith(UNUSED) and why["nobias.weight"].startswith(CUT_OFF), why
    mod.nobias.bias.requires_grad_(False)
    assert "requires_grad=False" in why_no_grad("nobias.bias", mod.nobias.bias, ran)
    assert "could not tell" in why_no_grad("nobias.bias", mod.nobias.weight, None)


@pytest.mark.launches
def test_check_step_too_large_for_a_rank_says_so_before_it_starts(pool2):
    """A model whose references do not fit where the step ran: the estimate and check_stages, on every
    rank, before any of the check's collectives (the rank's free memory is what fits.free_bytes reads)."""
    code = """
import labkit.check.fits as fits
_free, fits.free_bytes = fits.free_bytes, lambda device: 1_000   # a rank with 1 kB free
try:
    case("Schedule1F1B", 1, True, "step")
    said = "no error"
except labkit.CheckStepError as e:
    said = str(e)
finally:
    fits.free_bytes = _free
ok_after = case("Schedule1F1B", 1, True, "step")[0]
said, ok_after, fits.need_bytes(nn.Sequential(Block(), Block()))
"""
    out = pool2.exec(code)
    said, ok_after, need = out[0]
    assert out[0] == out[1]
    assert "check_step needs at least" in said and "labkit.check_stages" in said, said
    assert ok_after
    assert need == 2 * (2 * 8 + 8 * 8 + 8) * (3 * 4 + 16)  # 2 blocks of LayerNorm(8) and Linear(8, 8), float32


@pytest.mark.launches
def test_a_replay_too_large_for_a_rank_is_said_not_killed(pool2):
    """A failed check_stages places the bug by replaying each stage in float64 beside its slice; where that
    replay cannot fit on a rank (fits.replay_too_large), the check still fails, and says what the replay
    needs and how to place the bug, instead of an out-of-memory kill."""
    code = """
import labkit.check.fits as fits
# a rank with 3 kB free: room for check_stages' own need (1.8 kB here, refused up front below it), not for a
# stage's float64 replay beside its slice (5.5 kB and activations)
_free, fits.free_bytes = fits.free_bytes, lambda device: 3_000
try:
    said = case("Schedule1F1B", 1, True, "stages", bug=1)
finally:
    fits.free_bytes = _free
said, case("Schedule1F1B", 1, True, "stages", bug=1)
"""
    out = pool2.exec(code)
    assert out[0] == out[1], "every rank gets the same verdict"
    (ok, failure, compared), (ok_after, placed, _) = out[0]
    assert not ok and compared and failure.startswith("stages 0, 1 could not be replayed on the reference's input "
                                                      "(its replay needs about ") and "the verdict stands" in failure
    assert "computes as" not in failure, failure  # a stage not replayed is not said to compute right
    assert not ok_after and (placed.startswith("stage 1 departs at 1.") or placed.startswith("stage 1's output")), placed
