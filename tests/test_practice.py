"""labkit.practice (notebook 14): token-normalised losses, the fit of accumulated gradients, bytes
sent, a fresh tracker per step; on live ranks (2 ranks, Schedule1F1B, 4 microbatches of different
valid-token counts): the per-microbatch mean fails the token-mean check and the global-count loss
with scale_grads=False passes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import module_pool
from labkit.practice import fit_weights, fresh_tracker, rank_peak, token_loss, token_sum_loss, valid_tokens
from labkit.practice.measure import SentBytes


def _batch():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(4, 3, 5, generator=g)
    tgt = torch.randint(0, 5, (4, 3), generator=g)
    tgt[2:, 1:] = -100
    return out, tgt


def test_token_losses_of_the_microbatches_add_up_to_the_token_mean():
    out, tgt = _batch()
    n = valid_tokens(tgt)
    assert n == 8
    whole = F.cross_entropy(out.flatten(0, 1), tgt.flatten(), ignore_index=-100)
    loss = token_sum_loss(n)
    parts = sum(loss(o, t) for o, t in zip(out.chunk(2), tgt.chunk(2)))
    assert torch.allclose(parts, whole, atol=1e-6)
    assert torch.allclose(token_loss(out, tgt, n), whole, atol=1e-6)
    means = sum(F.cross_entropy(o.flatten(0, 1), t.flatten(), ignore_index=-100) for o, t in zip(out.chunk(2), tgt.chunk(2))) / 2
    assert not torch.allclose(means, whole, atol=1e-3)  # the per-microbatch mean is another number


def test_a_batch_without_valid_tokens_is_refused():
    with pytest.raises(ValueError, match="n_valid must be >= 1"):
        token_sum_loss(0)


def test_fit_weights_recovers_the_combination():
    a = {"w": torch.tensor([1.0, 0.0, 2.0]), "b": torch.tensor([1.0])}
    b = {"w": torch.tensor([0.0, 1.0, 1.0]), "b": torch.tensor([-1.0])}
    g = {n: 0.125 * a[n] + 0.5 * b[n] for n in a}
    assert [round(w, 6) for w in fit_weights(g, [a, b])] == [0.125, 0.5]
    with pytest.raises(ValueError):
        fit_weights({"x": torch.ones(1)}, [a])


def test_sent_bytes_counts_sends_only_and_restores_p2pop():
    import torch.distributed as dist

    before = dist.P2POp.__init__
    t = torch.zeros(4, 8)
    with SentBytes() as sent:
        for op in (dist.isend, dist.irecv, dist.isend):
            try:
                dist.P2POp(op, t, 1)
            except (RuntimeError, ValueError):  # no process group here: the count happens before any check
                pass
    assert dist.P2POp.__init__ is before
    assert sent.sends in (0, 2) and sent.bytes == sent.sends * 128


def test_a_fresh_tracker_counts_from_zero_and_a_second_wrap_would_see_nothing():
    class S:  # a stage as the tracker reads it
        def __init__(self, mod):
            self.submod, self.stage_index = mod, 0

    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    stage = S(mod)
    x = torch.randn(3, 4)
    first = fresh_tracker([stage])
    mod(x).sum().backward()
    second = fresh_tracker([stage])  # unwraps the first tracker, then wraps
    out = mod(x)
    assert rank_peak(second) > 0 and first.peak()[0] == rank_peak(second)
    out.sum().backward()
    assert second.events[-1][2] == 0  # everything released after the backward


SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from labkit.practice import check_token_step, token_sum_loss, valid_tokens

V, D, B, L, M = 16, 8, 8, 4, 4
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.ReLU()), nn.Sequential(nn.Linear(D, V)))
g = torch.Generator().manual_seed(0)
x, y = torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)
y[torch.arange(L) >= torch.tensor([4, 4, 4, 3, 2, 2, 1, 1])[:, None]] = -100

def step(fixed):
    full = model()
    stage = PipelineStage(full[rank], rank, 2, device)
    if fixed:
        sched = Schedule1F1B(stage, M, loss_fn=token_sum_loss(valid_tokens(y)), scale_grads=False)
    else:
        sched = Schedule1F1B(stage, M, loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(), ignore_index=-100))
    losses = []
    sched.step(x) if rank == 0 else sched.step(target=y, losses=losses)
    return check_token_step(full, [stage], x, y, losses, M, prefix_stage_index=True)
"""

pool = module_pool(2, SETUP)


@pytest.mark.launches
def test_per_microbatch_means_fail_the_token_mean_check_and_the_global_count_passes(pool):
    bad = pool.exec("c = step(False); (c.ok, c.compared == c.expected, c.failure)")
    good = pool.exec("c = step(True); (c.ok, c.compared == c.expected, c.failure)")
    assert bad[0][:2] == bad[1][:2] == (False, True), bad
    # every stage computes as the unsplit model: the failure names loss normalisation first, with the fix
    assert bad[0][2].startswith("the loss is normalised differently") and "token_sum_loss" in bad[0][2], bad[0][2]
    assert good[0][:2] == good[1][:2] == (True, True), good


def test_weight_copies_counts_autocasts_casts_of_parameters_not_of_inputs():
    from labkit.practice import WeightCopies

    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 8, requires_grad=True)  # a stage's received activation: a leaf that is no parameter
    with torch.autocast("cpu", dtype=torch.bfloat16), WeightCopies() as copies:
        mod(x)
        mod(x)  # a second microbatch: autocast's cache hands it the same copies
    assert copies.bytes == 2 * (8 * 32 + 32 * 8)  # both weights in bf16, once each; x's cast is an activation
    with WeightCopies() as none:
        mod(x)
    assert none.bytes == 0
    with torch.autocast("cpu", dtype=torch.bfloat16), WeightCopies() as data:
        mod(torch.randn(4, 8))  # the data needs no gradient: the first layer's weight is not kept for the backward
    assert data.bytes == 2 * 32 * 8
