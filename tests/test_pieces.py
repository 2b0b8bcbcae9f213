"""labkit.check.pieces: check_stages' float64 reference recomputes a block a piece of the batch at a time in
its backward, with the whole batch's gradients, only where the block treats samples apart (measured), and
in less memory than the whole block's graph. Single process, no ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import labkit.check.pieces as pieces_mod
from labkit.models import small_lm
from labkit.check.lean import checkpointed, read_as_made


def reference(model: nn.Module, a: torch.Tensor, pieces: int, dtype=torch.float64, **kw):
    """T's backward of one stage as labkit.check.stagewise runs it: {name: gradient}, the input's gradient."""
    grads = {}
    a = a.detach().clone().requires_grad_(a.is_floating_point())
    with checkpointed({0: model}, upcast=dtype, pieces=pieces):
        with torch.enable_grad():
            out = model(a, **kw)
            loss = (out.float() if dtype == torch.float32 else out.double()).square().mean()
        read_as_made(0, loss, None, [a] if a.requires_grad else [], list(model.named_parameters()),
                     lambda key, g: grads.__setitem__(key[1], g.clone()))
    return grads, (a.grad.clone() if a.requires_grad else None)


@pytest.fixture
def counted(monkeypatch):
    """How many pieced backwards ran, and how many of them fell back to the whole batch."""
    seen = {"pieced": 0, "whole": 0}
    real = pieces_mod._backward

    def spy(job, ins, grads, need, bounds):
        got = real(job, ins, grads, need, bounds)
        seen["pieced" if len(bounds) > 1 and got is not None else "whole"] += 1
        return got
    monkeypatch.setattr(pieces_mod, "_backward", spy)
    return seen


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_transformer_stage_in_pieces_has_the_whole_batchs_gradients(dtype, counted):
    """float32 and float64 slices against a float64 reference; bfloat16 slices against float32 (a 16-bit step's)."""
    model = small_lm(blocks=[2, 3], first=False, last=True, dim=128).to(dtype)
    truth = torch.float32 if dtype == torch.bfloat16 else torch.float64
    a = torch.randn(16, 64, 128, generator=torch.Generator().manual_seed(0), dtype=truth)
    whole, whole_in = reference(model, a, 1, truth)
    assert counted == {"pieced": 0, "whole": 0}  # pieces=1: torch's checkpoint, as before
    got, got_in = reference(model, a, 4, truth)
    assert counted == {"pieced": 2, "whole": 0}  # both blocks, in pieces
    assert set(got) == set(whole) and all(got[n].dtype == dtype for n in got)
    # sums of the pieces against one sum in the reference's dtype, rounded once to the parameter's dtype
    tol = {torch.float64: 1e-12, torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7}[dtype]
    assert max(rel(got[n], whole[n]) for n in whole) < tol
    assert rel(got_in, whole_in) < (1e-12 if truth == torch.float64 else 1e-5)


class Mixing(nn.Module):
    """A block whose samples see each other (`how`): a BatchNorm in training mode, the batch rolled by one,
    dropout; or one that returns something other than a batch of tensors."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.a, self.b, self.norm = how, nn.Linear(16, 16), nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x):
        h = self.b(self.a(x))
        if self.how == "batchnorm":
            h = self.norm(h)
        elif self.how == "roll":
            h = h + 0.5 * h.roll(1, dims=0)
        elif self.how == "dropout":
            h = nn.functional.dropout(h, 0.5, training=True)
        elif self.how == "scalar":
            return h, h.sum()
        return h


class Outer(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.block = Mixing(how)

    def forward(self, x):
        out = self.block(x)
        return out[0] + out[1] if isinstance(out, tuple) else out


@pytest.mark.parametrize("how", ["batchnorm", "roll", "dropout", "scalar"])
def test_a_block_whose_samples_meet_is_recomputed_whole_with_the_same_gradients(how, counted, monkeypatch):
    monkeypatch.setattr(pieces_mod, "_worth", lambda job: True)  # a small block: pieces taken on their merit
    model = Outer(how)
    a = torch.randn(12, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.manual_seed(5)
    whole, whole_in = reference(model, a, 1)
    torch.manual_seed(5)
    got, got_in = reference(model, a, 4)
    # the fingerprints depart in the backward (or the output is no batch, decided in the forward): recomputed whole
    assert counted == ({"pieced": 0, "whole": 0} if how == "scalar" else {"pieced": 0, "whole": 2})
    assert set(got) == set(whole) and max(rel(got[n], whole[n]) for n in whole) < 1e-12
    assert rel(got_in, whole_in) < 1e-12


def test_a_fingerprint_tells_a_moved_value_from_a_reordered_sum():
    g = torch.Generator().manual_seed(2)
    t = torch.randn(4, 8, 16, generator=g, dtype=torch.float64)
    noisy = t * (1 + 1e-15 * torch.randn(t.shape, generator=g, dtype=torch.float64))
    assert pieces_mod._same(pieces_mod._print(noisy), pieces_mod._print(t), torch.float64)
    swapped = t.clone()
    swapped[0, 0, :2] = t[0, 0, :2].flip(0)  # two values trade places: every plain sum is unchanged
    assert not pieces_mod._same(pieces_mod._print(swapped), pieces_mod._print(t), torch.float64)
    assert not pieces_mod._same(pieces_mod._print(t * (1 + 1e-8)), pieces_mod._print(t), torch.float64)
    assert pieces_mod._same(pieces_mod._print(t.float() * (1 + 1e-7)), pieces_mod._print(t.float()), torch.float32)


def test_pieces_are_taken_only_where_they_lower_the_peak(counted):
    """A wide block on a small batch: its parameters' stand-ins would outweigh its graph: recomputed whole."""
    model = small_lm(blocks=[0], first=False, last=False, dim=256)
    a = torch.randn(2, 4, 256, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    whole, _ = reference(model, a, 1)
    got, _ = reference(model, a, 2)
    assert counted == {"pieced": 0, "whole": 0}
    assert max(rel(got[n], whole[n]) for n in whole) < 1e-12


def allocated_peak(fn) -> int:
    """The most bytes torch's CPU allocator held at once while fn() ran, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        now += nbytes
        peak = max(peak, now)
    return peak


def test_pieces_lower_the_references_peak():
    """The last stage of notebook 09b's bench model (bench/RESULTS.md, the check's cost): its float64 backward
    with each block in 4 pieces allocates at most 0.8x the whole blocks' peak (measured 0.66x)."""
    model = small_lm(blocks=[6, 7], first=False, last=True, dim=256)
    a = torch.randn(16, 64, 256, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    reference(model, a, 4)  # warm
    whole, pieced = allocated_peak(lambda: reference(model, a, 1)), allocated_peak(lambda: reference(model, a, 4))
    assert pieced < 0.8 * whole, (pieced, whole)


def test_nested_arguments_flatten_and_come_back_whole():
    t = torch.ones(2)
    tree = ((t, 3, [t, None]), {"mask": t, "rope": (t, t), "cache": object})
    leaves, spec = pieces_mod.tree_flatten(tree)
    assert len(leaves) == 8 and pieces_mod.tree_unflatten(leaves, spec) == tree
    assert pieces_mod.tree_flatten(t) == ([t], None)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_transformers_layers_in_pieces_have_the_whole_batchs_gradients(model_type, counted):
    """transformers' own layers, their attention masks and rotary embeddings cut with the batch where they
    carry it (BERT's padding masks differ per sample: notebook 09b's placements run it through check_stages)."""
    import dataclasses

    from labkit import PRESETS
    from labkit.models import hf

    pre = dataclasses.replace(PRESETS["small"], dim=128, n_layers=2, batch_size=16, seq_len=64)
    stage = hf.meta_stage(model_type, pre, 1, [0, 1, 2], "cpu")
    _, _, kw = hf.make_batch(model_type, pre, 16, 0)
    a = torch.randn(16, 64, 128, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    whole, whole_in = reference(stage, a, 1, **kw)
    got, got_in = reference(stage, a, 4, **kw)
    assert counted["pieced"] >= 1 and counted["whole"] == 0, counted
    assert set(got) == set(whole) and max(rel(got[n], whole[n]) for n in whole) < 2 ** -23
    assert rel(got_in, whole_in) < 1e-12


def step_dtype_reference(model: nn.Module, a: torch.Tensor, offload: bool, autocast=None):
    """R's backward of one stage, its gradients read as made: {name: gradient}, the input's gradient."""
    from labkit.check.noise import autocast_ctx

    grads = {}
    a = a.detach().clone().requires_grad_()
    with checkpointed({0: model}, offload=offload), torch.enable_grad(), autocast_ctx("cpu", autocast):
        loss = model(a).float().square().mean()
    read_as_made(0, loss, None, [a], list(model.named_parameters()), lambda key, g: grads.__setitem__(key[1], g))
    return grads, a.grad


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_offloaded_blocks_give_the_step_dtypes_reference_the_same_numbers(autocast, counted, monkeypatch):
    """R on a GPU (here on the CPU, as a stand-in: no GPU in CI): each innermost block recomputed whole in its
    backward with the saved tensors handed to torch's save_on_cpu, under the forward's autocast: the same
    gradients, bit for bit, as torch's checkpoint."""
    packed = []

    def counting(pin_memory):
        assert pin_memory is False  # pageable: pinned blocks would stay cached in the user's process
        return torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t)
    monkeypatch.setattr(pieces_mod, "save_on_cpu", counting)
    model = small_lm(blocks=[2, 3], first=False, last=True, dim=64)
    a = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(7))
    plain, plain_in = step_dtype_reference(model, a, False, autocast)
    assert counted == {"pieced": 0, "whole": 0} and not packed
    got, got_in = step_dtype_reference(model, a, True, autocast)
    assert counted == {"pieced": 0, "whole": 2} and len(packed) > 10  # each block's recomputation, whole
    assert set(got) == set(plain) and all(torch.equal(got[n], plain[n]) for n in plain)
    assert torch.equal(got_in, plain_in)
