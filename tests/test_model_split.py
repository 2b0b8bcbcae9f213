"""In-process checks of the model, the manual split and the reference (no torchrun needed)."""

import pytest
import torch

from labkit.config.run import RunConfig
from labkit.models.tutorial import build_model, make_batch, tokenwise_loss_fn
from labkit.check.reference import Reference, grad_diff, whole_batch_reference
from labkit.worker.stages import manual_stage_module


def test_manual_split_partitions_every_parameter_once():
    cfg = RunConfig(schedule="Interleaved1F1B", preset="tiny")  # 4 stages
    full = build_model(cfg)
    names = [set(n for n, _ in manual_stage_module(full, s, cfg.n_stages).named_parameters()) for s in range(cfg.n_stages)]
    assert set().union(*names) == {n for n, _ in full.named_parameters()}
    assert sum(len(n) for n in names) == len(list(full.parameters()))


def test_stages_in_sequence_equal_the_full_model():
    cfg = RunConfig(schedule="Interleaved1F1B", preset="tiny")
    full = build_model(cfg)
    x, _ = make_batch(cfg)
    h = x
    for s in range(cfg.n_stages):
        h = manual_stage_module(full, s, cfg.n_stages)(h)
    assert torch.allclose(h, full(x), atol=1e-6)


def _chunked_vs_whole(layout: str) -> float:
    cfg = RunConfig(preset="tiny", layout=layout, n_microbatches=4)
    model = build_model(cfg)
    x, _ = make_batch(cfg)
    with torch.no_grad():
        whole = model(x)
        chunked = torch.cat([model(c) for c in x.chunk(4, dim=0)], dim=0)  # what the schedules do: dim 0
    return float((whole - chunked).abs().max())


def test_batch_layout_microbatches_split_the_batch():
    assert _chunked_vs_whole("batch") < 1e-5


def test_tutorial_layout_microbatches_split_the_sequence():
    # The official tutorial's layout: dim 0 is read as the sequence, so chunks change attention.
    assert _chunked_vs_whole("tutorial") > 1e-3


def test_reference_grads_are_the_whole_batch_mean_loss():
    cfg = RunConfig(preset="tiny", n_microbatches=4)
    model = build_model(cfg)
    x, y = make_batch(cfg)
    ref = whole_batch_reference(model, x, y, 4, tokenwise_loss_fn)
    model.zero_grad()
    tokenwise_loss_fn(model(x), y).backward()  # equal microbatches: mean of means == whole mean
    worst = max(float((p.grad - ref.grads[n]).abs().max()) for n, p in model.named_parameters())
    assert worst < 1e-6
    assert len(ref.losses) == 4


def test_grad_diff_never_skips_a_missing_parameter():
    cfg = RunConfig(preset="tiny")
    model = build_model(cfg)
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    ref = Reference(grads={n: torch.zeros_like(p) for n, p in model.named_parameters()})
    assert grad_diff([model], grads, ref)[0] == 0.0
    grads.pop("output.weight")
    assert grad_diff([model], grads, ref)[0] == float("inf")


def test_check_step_says_to_prefix_stage_index_when_names_do_not_match():
    """Stages cut as `full[s]` from an nn.Sequential call their weight `weight`, the unsplit model `0.weight`:
    without prefix_stage_index no gradient could be found, so check_step refuses (before its collectives)
    and says which setting fixes it; stages renumbered 0..k collide with stage 0's names and are named so."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.nn as nn

    from labkit.check.reference import CheckStepError, check_step

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    stages = [SimpleNamespace(submod=full[i], stage_index=i, is_last=(i == 2), device=torch.device("cpu"))
              for i in range(3)]
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    mse = nn.functional.mse_loss
    losses = [mse(o, t) for o, t in zip(full(x).chunk(2), y.chunk(2))]   # the step, run whole (1 rank, 3 stages)
    torch.stack(losses).mean().backward()
    # Stage 1 holds full[2] renumbered as child 0 (stage 0 keeps the unsplit names): it collides with stage 0.
    renumbered = [SimpleNamespace(submod=full[0:2], stage_index=0, is_last=False, device=torch.device("cpu")),
                  SimpleNamespace(submod=nn.Sequential(full[2]), stage_index=1, is_last=True, device=torch.device("cpu"))]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(CheckStepError) as wrong:
            check_step(full, stages, x, y, losses, 2, mse, prefix_stage_index=False)
        with pytest.raises(CheckStepError) as collide:
            check_step(full, renumbered, x, y, losses, 2, mse)
        right = check_step(full, stages, x, y, losses, 2, mse, prefix_stage_index=True)
        inferred = check_step(full, stages, x, y, losses, 2, mse)  # None: the names decide, the notes say which
    finally:
        dist.destroy_process_group()
    msg = str(wrong.value)
    assert "4 stage parameters have names that the unsplit model does not have" in msg
    assert "pass prefix_stage_index=True" in msg
    assert "e.g. 'weight', which the unsplit model calls '0.weight'." in msg
    assert "collide" not in msg  # names the unsplit model lacks are not also reported as collisions
    msg = str(collide.value)
    assert "parameter names collide across stages: 2 names are claimed by more than one stage (stages 0 and 1)" in msg
    assert "'0.bias', '0.weight'" in msg and "renumbered 0..k" in msg and "tolerance" not in msg
    assert right.ok and right.failure is None
    assert inferred.ok and any("prefix_stage_index=True, inferred from the names" in n for n in inferred.notes)


def test_configs_run_in_turn_share_a_trace_and_each_gets_its_own_copy(monkeypatch):
    """`shared_work` (a suite job, live ranks): one torch.export trace per model, weights, microbatch,
    cut and autocast; every caller gets a whole copy; nothing is kept outside the block."""
    import torch.distributed.pipelining as pp

    from labkit.worker import shared, stages
    from labkit.check.noise import autocast_ctx

    traced = []
    real = pp.pipeline

    def counting(*a, **k):
        traced.append(1)
        return real(*a, **k)

    monkeypatch.setattr(pp, "pipeline", counting)
    gpipe, ofob = RunConfig(schedule="GPipe", split="tracer", preset="tiny"), RunConfig(schedule="1F1B", split="tracer", preset="tiny")
    full = build_model(gpipe)
    x, _ = make_batch(gpipe)
    mb = x.chunk(gpipe.n_microbatches)[0]

    def params(pipe):
        return dict(pipe.split_gm.named_parameters())

    with shared.shared_work():
        a, b = stages.trace_pipe(gpipe, full, "cpu"), stages.trace_pipe(ofob, full, "cpu")  # same cut: 2 stages
        assert len(traced) == 1 and a is not b
        pa, pb = params(a), params(b)
        assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) and pa[n].data_ptr() != pb[n].data_ptr() for n in pa)
        with torch.no_grad():
            next(iter(pa.values())).add_(1.0)  # a copy's training does not reach the next copy
        c = stages.trace_pipe(gpipe, full, "cpu")
        assert len(traced) == 1 and all(torch.equal(params(c)[n], pb[n]) for n in pb)
        assert torch.allclose(c.split_gm(mb)[0], full(mb), atol=1e-6)  # the copy computes the model
        stages.trace_pipe(RunConfig(schedule="Interleaved1F1B", split="tracer", preset="tiny"), full, "cpu")
        assert len(traced) == 2  # another cut: 4 stages
        with autocast_ctx("cpu", torch.bfloat16):  # an autocast trace records its casts: its own trace
            stages.trace_pipe(gpipe, full, "cpu")
        assert len(traced) == 3
        with torch.no_grad():
            full.output.weight.mul_(2.0)  # other weights: traced again
        stages.trace_pipe(gpipe, full, "cpu")
        assert len(traced) == 4
        handle = full.layers["0"].register_forward_hook(lambda *a: None)  # a hook is not in the key: never shared
        stages.trace_pipe(gpipe, full, "cpu")
        stages.trace_pipe(gpipe, full, "cpu")
        assert len(traced) == 6
        handle.remove()
    stages.trace_pipe(gpipe, full, "cpu")  # after the block: a trace of its own
    assert len(traced) == 7 and not shared.is_shared()


def test_configs_run_in_turn_share_the_references_and_each_gets_its_own_verdict(monkeypatch):
    """`shared_work`: check_step computes the unsplit model's three references (whole batch,
    microbatched, float64) once per model, weights, batch, microbatch count, loss and autocast; a
    step that differs still fails with its own figures; nothing is kept outside the block."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.nn as nn

    from labkit.check import reference
    from labkit.worker import shared
    from labkit.check.noise import autocast_ctx

    made = []
    real = reference._references
    monkeypatch.setattr(reference, "_references", lambda c: made.append(1) or real(c))
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    mse = nn.functional.mse_loss

    def step(model, n=2, scale=1.0, autocast=None):  # the step run whole on one rank (3 stages), grads kept
        model.zero_grad(set_to_none=True)
        with autocast_ctx("cpu", autocast):
            losses = [mse(o, t) for o, t in zip(model(x).chunk(n), y.chunk(n))]
        (scale * torch.stack(losses).mean()).backward()
        stages = [SimpleNamespace(submod=model[i], stage_index=i, is_last=(i == 2), device=torch.device("cpu"))
                  for i in range(3)]
        return reference.check_step(model, stages, x, y, losses, n, mse, prefix_stage_index=True, autocast=autocast)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with shared.shared_work():
            first, again = step(full), step(full)
            assert first.ok and again.ok and len(made) == 1
            assert [f.as_dict() for f in first.figures] == [f.as_dict() for f in again.figures]
            wrong = step(full, scale=1.5)  # a bug on the same model and batch: the shared references catch it
            assert not wrong.ok and len(made) == 1 and "grad" in wrong.failure
            assert step(full, n=4).ok and len(made) == 2  # another microbatch count: its own references
            assert step(full, autocast=torch.bfloat16).ok and len(made) == 3  # autocast: its own
            with torch.no_grad():
                full[0].weight.mul_(0.5)  # other weights: computed again, and the step still matches them
            assert step(full).ok and len(made) == 4
            handle = full[1].register_forward_hook(lambda *a: None)
            assert step(full).ok and step(full).ok and len(made) == 6  # a hook is not in the key: never shared
            handle.remove()
        assert step(full).ok and len(made) == 7 and not shared.is_shared()  # after the block: its own
    finally:
        dist.destroy_process_group()
