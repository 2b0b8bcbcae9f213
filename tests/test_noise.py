"""Bug or float noise (labkit.check.noise via check_step with no tolerance): on live ranks (2 ranks,
Schedule1F1B, 4 microbatches), a correct step with large activations passes in float32 and under bf16
autocast, a 1% bug in stage 1's last bias fails in both and is named, notebook 04's stages with a
SavedTensorTracker compare every parameter, and a bias held but unused is named as unused."""

from __future__ import annotations

import pytest
import torch

from conftest import module_pool
from labkit.check.noise import Figure, canonical, figure, where

SETUP = """
import torch, torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from labkit.check.reference import check_step
from labkit.worker.memory import SavedTensorTracker

def make(scale=16.0):
    torch.manual_seed(0)
    full = nn.Sequential(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64)),
                         nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)))
    with torch.no_grad():
        for p in full.parameters():
            p.mul_(scale)
    return full

class Buggy(nn.Module):  # stage 1 as written with a bug: its last bias enters at 99%, or not at all
    def __init__(self, inner, bias=0.99):
        super().__init__()
        self.inner, self.bias = inner, bias
    def forward(self, h):
        body, last = self.inner[:-1], self.inner[-1]
        return nn.functional.linear(body(h), last.weight, None if self.bias is None else last.bias * self.bias)

def step(scale=16.0, bug=False, autocast=None, tracker=False, unused=False, tolerance=None):
    full = make(scale)
    torch.manual_seed(1)
    x, y = torch.randn(16, 32) * 2, torch.randn(16, 32)
    import copy
    mod = full[rank] if tracker else copy.deepcopy(full[rank])  # the tracker patches full's own module
    if (bug or unused) and rank == 1:
        mod = Buggy(mod, None if unused else (0.99 if bug is True else bug))
    stage = PipelineStage(mod, rank, 2, device)
    if tracker:
        SavedTensorTracker([stage])
    mse = nn.MSELoss()
    sched = Schedule1F1B(stage, 4, loss_fn=mse)
    losses = []
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        sched.step(x) if rank == 0 else sched.step(target=y, losses=losses)
    wrapped = (bug or unused) and rank == 1
    renamed = {f"inner.{n}": f"1.{n}" for n, _ in full[1].named_parameters()} if wrapped else None
    return check_step(full, [stage], x, y, losses, 4, mse, prefix_stage_index=not wrapped,
                      autocast=autocast, renamed=renamed, tolerance=tolerance)
"""


pool = module_pool(2, SETUP)  # the suite's warm 2-rank pool (conftest.live_ranks), set up, cleaned after


def _check(pool, **kw) -> dict:
    args = ", ".join(f"{k}={v}" for k, v in kw.items())
    out = pool.exec(f"c = step({args}); (c.ok, c.failure, c.worst_ratio, c.compared, c.expected, c.tolerance, c.where)")
    assert out[0][:2] == out[1][:2], "every rank gets the same verdict"
    ok, failure, worst, compared, expected, tol, where = out[0]
    return {"ok": ok, "failure": failure, "worst": worst, "compared": compared, "expected": expected, "tol": tol,
            "where": where}


@pytest.mark.launches
def test_a_correct_step_with_large_activations_is_within_float_noise(pool):
    c = _check(pool, scale=16.0)
    assert c["ok"] and c["tol"] is None and c["compared"] == c["expected"], c
    assert c["worst"] <= 2.0  # a fixed 1e-4 fails it: its gradients are in the hundreds of thousands
    fixed = pool.exec("_c = step(scale=16.0, tolerance=1e-4)\n(_c.ok, _c.max_abs_diff)")[0]
    assert fixed[0] is False and fixed[1] > 1e-4


@pytest.mark.launches
def test_a_one_percent_bias_bug_fails_and_names_stage_1_and_the_bias(pool):
    c = _check(pool, bug=True)
    assert not c["ok"] and "stage 1's '1.3.bias'" in c["failure"], c["failure"]
    assert "outside float noise" in c["failure"] and "every microbatch's loss differs" in c["failure"]


@pytest.mark.launches
def test_bf16_autocast_correct_passes_and_the_bias_bug_fails(pool):
    ok = _check(pool, autocast="torch.bfloat16")
    assert ok["ok"], ok["failure"]
    bug = _check(pool, bug=True, autocast="torch.bfloat16")
    assert not bug["ok"] and "'1.3.bias'" in bug["failure"], bug["failure"]


@pytest.mark.launches
def test_a_tracked_stage_compares_every_parameter(pool):
    """SavedTensorTracker replaces the stage module's forward on the instance: the reference's copy
    must run on its own parameters (it used to route through the live module: 0 compared)."""
    c = _check(pool, tracker=True)
    assert c["ok"] and c["compared"] == c["expected"] > 0, c


@pytest.mark.launches
def test_a_held_but_unused_parameter_is_named_as_unused(pool):
    """Named by the unsplit model's name (the stage holds it as inner.3.bias, `renamed` maps it), as the figures are."""
    c = _check(pool, unused=True)
    assert not c["ok"] and "stage 1's '1.3.bias'" in c["failure"], c
    assert "its module never ran in the stage's forward" in c["failure"], c  # Buggy calls F.linear on its weight
    assert c["where"] == c["failure"], "one first place"


def test_where_tells_a_scaling_mistake_from_a_backward():
    g = lambda name, stage, ratio, fit: Figure("grad", name, stage, ratio, 1.0, 10.0, ratio, fit)  # noqa: E731
    losses = [Figure("loss", str(i), 1, 0.0, 1.0, 1.0, 0.0) for i in range(4)]
    scaled = where(losses + [g("a", 0, 50, 0.25), g("b", 1, 60, 0.25)])
    assert "times 0.25" in scaled and "loss-scaling" in scaled
    backward = where(losses + [g("a", 0, 0.5, 1.0), g("b", 1, 60, 0.9)])
    assert "the losses match; gradients of stage 1 differ" in backward and "'b'" in backward


def test_a_figure_has_a_floor_above_zero_and_wrappers_map_to_the_unsplit_names():
    r = torch.tensor([1.0, 2.0])
    f = figure("grad", "w", 0, r + 1e-3, r, r)  # the probe equals the reference bit for bit
    assert f.floor > 0 and f.ratio > 2.0
    assert canonical("_orig_mod.layers.0._checkpoint_wrapped_module.weight") == "layers.0.weight"


@pytest.mark.launches
def test_with_the_default_tolerance_a_failure_still_says_where(pool):
    """The absolute default (1e-4) keeps its verdict; its failure names the stage and the parameter."""
    out = pool.exec("_c = step(bug=True, tolerance=1e-4)\n(_c.ok, _c.tolerance, _c.failure)")[0]
    assert out[0] is False and out[1] == 1e-4 and out[2].startswith("reference mismatch: max abs diff"), out
    assert "stage 1's '1.3.bias'" in out[2], out[2]


@pytest.mark.launches
def test_a_bug_within_an_absolute_tolerance_is_still_named_as_outside_the_noise(pool):
    """A bias entering at 99.9% on unscaled weights moves the step by less than 1e-4: the absolute
    tolerance passes it; the Check's notes say it is far outside float noise, and where."""
    out = pool.exec("_c = step(scale=1.0, bug=0.999, tolerance=1e-4)\n(_c.ok, _c.notes, _c.worst_ratio)")[0]
    assert out[0] is True and out[2] > 100, out
    assert any("outside float noise" in n and "1.3.bias" in n for n in out[1]), out[1]
    strict = pool.exec("_c = step(scale=1.0, bug=0.999)\n(_c.ok, _c.failure)")[0]
    assert strict[0] is False and "1.3.bias" in strict[1], strict


def test_figures_compared_in_pieces_equal_the_whole_tensors(monkeypatch):
    """A figure reads a large tensor in float64 pieces (labkit.check.noise.CHUNK), never as whole float64
    copies: the same error, scale, floor and fit as the whole tensors give."""
    import labkit.check.noise as noise

    g = torch.Generator().manual_seed(0)
    r = torch.randn(1000, 7, generator=g)
    p, probe = r + 1e-6 * torch.randn(1000, 7, generator=g), r + 1e-7 * torch.randn(1000, 7, generator=g)
    whole = figure("grad", "w", 0, p, r, probe, 4)
    monkeypatch.setattr(noise, "CHUNK", 333)  # pieces that do not divide the tensor
    pieces = figure("grad", "w", 0, p, r, probe, 4)
    assert (pieces.err, pieces.scale, pieces.reorder) == (whole.err, whole.scale, whole.reorder)
    assert pieces.floor == whole.floor and abs(pieces.fit - whole.fit) < 1e-12
    assert pieces.err == float((p.double() - r.double()).abs().max())
    assert noise.max_abs_diff(torch.tensor(2.0), torch.tensor([1.0, 3.0])) == 1.0  # broadcast as before
    assert noise.max_abs_diff(torch.empty(0), torch.empty(0)) == 0.0


def test_check_stages_holds_one_references_gradients_at_a_time():
    """labkit.check.stagewise: R reads C's summed gradient against each of its own as the backward makes
    it, and frees C's: C's and R's together never hold more than one gradient a parameter."""
    from labkit.check.stagewise import _Chain, _keep_reading

    m, g = 4, torch.Generator().manual_seed(1)
    r = {(0, n): torch.randn(5, generator=g) for n in ("a", "b")}
    c = _Chain(grads={k: (v + 1e-3) * m for k, v in r.items()} | {(1, "unused"): torch.ones(3)})
    out = _Chain()
    on_grad = _keep_reading(out, c, m)
    held = []
    for k, v in r.items():
        on_grad(k, v.clone())
        held.append(len(c.grads) + len(out.grads))
    assert held == [3, 3] and set(out.grads) == set(r) and list(c.grads) == [(1, "unused")]
    assert all(abs(c.diffs[k] - 1e-3) < 1e-6 for k in r)


def test_check_stages_truth_is_float32_only_where_the_step_computes_in_16_bits():
    """labkit.check.stagewise: T in float32 where every rank's step computes in bfloat16 or float16 (its
    slices' parameters, or its autocast), float64 otherwise (a mixed slice too)."""
    import copy

    from labkit.check.stagewise import _Run, _sixteen

    lin = torch.nn.Linear(2, 2)
    run = lambda sl, ac: _Run({0: sl}, [], None, None, [], 1, None, ac, {}, torch.device("cpu"), 0, None)  # noqa: E731
    mixed = torch.nn.Sequential(copy.deepcopy(lin).bfloat16(), torch.nn.LayerNorm(2))
    assert not _sixteen(run(lin, None)) and not _sixteen(run(mixed, None))
    assert _sixteen(run(lin, torch.bfloat16)) and _sixteen(run(copy.deepcopy(lin).bfloat16(), None))
    assert _sixteen(run(copy.deepcopy(lin).half(), None))
