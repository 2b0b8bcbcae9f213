"""labkit.models.skips.carry_skips: a traced Pipe's skip connections carried stage by stage. In process:
the rewritten split graph talks only to neighbours, and its stages chained with autograd compute the
unsplit model's output and every gradient. Real runs of traced transformers models through multi-stage
schedules are in tests/test_models.py."""

import copy
import importlib.util
import operator

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import pipe_split, pipeline

from labkit.models.hf import first_stage_inputs
from labkit.models.skips import carry_skips


class Skips(nn.Module):
    """Three stages; stage 0's `g` and the model's input `y` are read by stage 2 only."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.a(x)
        g = h * 2
        pipe_split()
        h = self.b(h)
        pipe_split()
        return self.c(h) + y + g


def _sources(pipe) -> list[set[int]]:
    """For each stage, the stages its inputs come from (-1: the model's inputs)."""
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    index = {c: i for i, c in enumerate(calls)}
    out = []
    for c in calls:
        src = set()
        for a in c.args:
            while a.op == "call_function" and a.target is operator.getitem:
                a = a.args[0]
            src.add(-1 if a.op == "placeholder" else index[a])
        out.append(src)
    return out


def _chain(pipe, inputs):
    outs = tuple(inputs)
    for s in range(pipe.num_stages):
        outs = pipe.get_stage_module(s)(*outs)
        outs = outs if isinstance(outs, tuple) else (outs,)
    (out,) = outs
    return out


def test_skips_are_carried_through_the_middle_stage_and_the_step_is_unchanged():
    torch.manual_seed(0)
    model = Skips()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    pipe = pipeline(copy.deepcopy(model), mb_args=(x, y))
    assert _sources(pipe) == [{-1}, {0}, {1, -1, 0}]  # y from the input, g from stage 0: skips
    carried = carry_skips(pipe)
    assert _sources(pipe) == [{-1}, {0}, {1}]
    assert carried == {0: ["y"], 1: ["y", "getitem_1"]}  # y enters at stage 0 now; g rides through stage 1
    assert first_stage_inputs(pipe) == ["x", "y"]

    out = _chain(pipe, (x, y))
    want = model(x, y)
    assert torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    got = {n.split(".", 1)[1]: p.grad for n, p in pipe.split_gm.named_parameters()}
    for name, p in model.named_parameters():  # g's gradient reaches `a` through stage 1's copy
        assert torch.allclose(got[name], p.grad, atol=1e-6), name


def test_a_pipe_without_skips_is_left_as_it_was():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    from torch.distributed.pipelining import SplitPoint
    pipe = pipeline(model, mb_args=(x,), split_spec={"2": SplitPoint.BEGINNING})
    before = str(pipe.split_gm.graph)
    assert carry_skips(pipe) == {}
    assert _sources(pipe) == [{-1}, {0}]
    assert torch.equal(_chain(pipe, (x,)), model(x))
    assert str(pipe.split_gm.graph) == before


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("model_type", ["gpt2", "qwen2"])
def test_traced_transformers_model_on_four_stages(model_type):
    """GPT-2's 4-D mask, and a Llama-layout model's mask and rotary cos/sin, are built on stage 0 and
    read by every block: after the kit's trace (hf.trace_pipe: export under no_grad, then carry_skips)
    each stage reads only its predecessor, and the four stages chained give the unsplit model's logits
    and gradients."""
    from labkit.config.presets import PRESETS
    from labkit.models import hf, tied

    tiny = PRESETS["tiny"]
    full = hf.build_hf(model_type, tiny, seed=0)
    x, y, kw = hf.make_batch(model_type, tiny, 2, 0)
    pipe = hf.trace_pipe(full, [0, 2, 4, 6, 8], x, kw)
    assert _sources(pipe) == [{-1}, {0}, {1}, {2}]
    named = {"input_ids": x, **kw}
    logits = _chain(pipe, [named[n] for n in first_stage_inputs(pipe)])
    want = full(x, **kw).logits
    assert float((logits - want).detach().abs().max()) < 1e-5
    hf.loss_fn(logits, y).backward()
    hf.loss_fn(want, y).backward()
    canonical = {n: g[0] for g in tied.tied_groups(full) for n in g}  # GPT-2: lm_head.weight is wte's
    got = {}
    for s in range(pipe.num_stages):
        for n, p in pipe.get_stage_module(s).named_parameters():
            n = canonical.get(n, n)
            if p.grad is not None:  # the tracer unties: each copy holds its stage's part of the gradient
                got[n] = got[n] + p.grad if n in got else p.grad
    for name, p in full.named_parameters():
        assert float((got[name] - p.grad).abs().max()) < 1e-5, name
