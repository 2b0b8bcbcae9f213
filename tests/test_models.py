"""transformers' own models pipelined (labkit.models): each checked against ONE whole-batch step of
the unsplit model, every loss and every gradient, tied ones included. Real torchrun jobs for a
representative set of model x split x schedule; in-process checks of the cut, the tied-weight sum,
the masks and the refusals. Skips only when transformers is absent (CI has it)."""

import importlib.util

import pytest
import torch

from labkit.config.presets import PRESETS
from labkit.core.errors import ConfigError
from labkit.config.run import RunConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[models]')")

TINY = PRESETS["tiny"]


def _hf():
    from labkit.models import hf
    return hf


def _tied():
    from labkit.models import tied
    return tied


def _stages_in_sequence(hf, model_type, bounds, kwargs_for_stages=True):
    full = hf.build_hf(model_type, TINY, seed=0)
    x, y, kw = hf.make_batch(model_type, TINY, 8, 0)
    stages = [hf.manual_stage(model_type, TINY, full, s, bounds, "cpu") for s in range(len(bounds) - 1)]
    h = x
    for s, st in enumerate(stages):
        h = st(h, **(kw if kwargs_for_stages or s == 0 else {}))
    return full, stages, x, y, kw, h


@pytest.mark.parametrize("model_type,family", [("llama", "causal"), ("mistral", "causal"), ("gpt2", "gpt2"),
                                               ("bert", "bert")])
def test_manual_stages_in_sequence_equal_the_unsplit_model(model_type, family):
    hf = _hf()
    full, stages, x, y, kw, h = _stages_in_sequence(hf, model_type, [0, 3, 5, 8])
    assert hf.family(full) == family  # found by layout: mistral is never named in the kit
    assert float((h - full(x, **kw).logits).detach().abs().max()) < 1e-5
    # every parameter of the unsplit model is on exactly one stage, under its own name (tied: twice)
    names = [n for st in stages for n, _ in st.named_parameters()]
    tied = {n for g in _tied().tied_groups(full) for n in g[1:]}
    assert sorted(n for n in names if n not in tied) == sorted(n for n, _ in full.named_parameters())


def test_bert_padding_mask_reaches_every_stage():
    # Later stages that never see the padding mask attend to the padding: the output changes.
    hf = _hf()
    full, _, x, _, kw, h_without = _stages_in_sequence(hf, "bert", [0, 4, 8], kwargs_for_stages=False)
    assert (kw["attention_mask"] == 0).any()
    ref = full(x, **kw).logits
    real = kw["attention_mask"].bool()
    assert float((h_without - ref)[real].abs().max()) > 1e-3


def test_tied_gradient_needs_the_sum_of_both_stages():
    # GPT-2's lm_head.weight IS transformer.wte.weight: cut on two stages, each copy gets only its part.
    hf = _hf()
    full, stages, x, y, kw, h = _stages_in_sequence(hf, "gpt2", [0, 4, 8])
    hf.loss_fn(h, y).backward()
    ref = full(x, **kw).logits
    full.zero_grad()
    hf.loss_fn(ref, y).backward()
    want = full.transformer.wte.weight.grad
    emb, head = stages[0].transformer.wte.weight.grad, stages[1].lm_head.weight.grad
    assert float((emb - want).abs().max()) > 1e-4 and float((head - want).abs().max()) > 1e-4
    assert float((emb + head - want).abs().max()) < 1e-5


def test_untied_gpt2_needs_no_sum():
    # The other way out: two independent matrices (a different model, more parameters, no communication).
    hf = _hf()
    full = hf.build_hf("gpt2", TINY, untie=True)
    assert _tied().tied_groups(full) == [] and full.lm_head.weight is not full.transformer.wte.weight
    x, y, kw = hf.make_batch("gpt2", TINY, 8, 0)
    stages = [hf.manual_stage("gpt2", TINY, full, s, [0, 4, 8], "cpu", untie=True) for s in range(2)]
    hf.loss_fn(stages[1](stages[0](x, **kw), **kw), y).backward()
    hf.loss_fn(full(x, **kw).logits, y).backward()
    for name, want in [("transformer.wte.weight", full.transformer.wte.weight.grad),
                       ("lm_head.weight", full.lm_head.weight.grad)]:
        got = next(st.get_parameter(name).grad for st in stages if name in dict(st.named_parameters()))
        assert float((got - want).abs().max()) < 1e-6


def test_unknown_layout_and_type_are_explained():
    hf = _hf()
    with pytest.raises(ValueError, match="none of the layouts"):
        hf.family(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="knows no model type 'nosuchmodel'"):
        hf.small_config("nosuchmodel", TINY)


def test_missing_transformers_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a))
    with pytest.raises(ConfigError, match=r"pip install 'labkit\[models\]'"):
        RunConfig(model_name="llama")
    RunConfig()  # the tutorial needs nothing more


def test_split_points_by_module_name():
    cfg = RunConfig(model_name="gpt2", preset="tiny", split_points=["transformer.h.3"])
    assert cfg.layer_bounds() == [0, 3, 8]
    with pytest.raises(ConfigError, match="stands alone"):
        RunConfig(model_name="gpt2", preset="tiny", split_points=["auto", "layers.3"])
    # the tracer takes any number of stages (labkit.models.skips carries the mask past the middle ones)
    assert RunConfig(model_name="gpt2", split="tracer", schedule="Interleaved1F1B").n_stages == 4


# ---- real jobs: model x split x schedule against the whole-batch step ----

CASES = [
    ("llama", "manual", "1F1B", 1),
    ("qwen2", "manual", "ZBVZeroBubble", 2),        # another Llama-layout type; V placement
    ("gpt2", "manual", "Interleaved1F1B", 2),       # tied weight on ranks 0 and 1 (stages 0 and 3)
    ("gpt2", "tracer", "ZBVZeroBubble", 2),         # the tracer unties; the sum repairs it (one rank, V); mask carried
    ("llama", "tracer", "Interleaved1F1B", 2),      # traced under no_grad (rotary); mask, cos, sin carried
    ("bert", "manual", "DualPipeV", 2),             # tied weight: first and last stage on rank 0
    ("bert", "tracer", "1F1B", 1),                  # padding mask; a tied bias held under its other name
    ("llama", "manual", "LoopedBFS", 2),            # no kwargs chunk spec on this schedule (its own branch)
    ("mistral", "manual", "InterleavedZeroBubble", 2),  # a third Llama-layout type; I and W split
]


def _case_config(model_type, split, schedule, spr):
    return RunConfig(model_name=model_type, split=split, schedule=schedule, stages_per_rank=spr, preset="tiny",
                     n_microbatches=4)


@pytest.fixture(scope="module")
def model_runs(tmp_path_factory):
    """The CASES as real runs, one after the other in one job of the reference job (conftest.run_suite)."""
    from conftest import run_suite

    root = tmp_path_factory.mktemp("models")
    configs = {c: _case_config(*c) for c in CASES}
    # --split-points auto on a heavy last stage (a 32k vocabulary): measured on the job's ranks, then run
    configs["auto"] = RunConfig(model_name="llama", preset="wide_vocab", schedule="1F1B", split_points=["auto"],
                                n_microbatches=2)
    # clipping over a pipeline whose tied weight lives on two ranks: the norm counts it once
    configs["gpt2 clip"] = RunConfig(model_name="gpt2", schedule="Interleaved1F1B", stages_per_rank=2, preset="tiny",
                                     n_microbatches=4, clip_grad_norm=0.05)
    yield run_suite(root, "models", configs, 2)


@pytest.mark.launches
@pytest.mark.parametrize("model_type,split,schedule,spr", CASES)
def test_pipelined_step_matches_the_unsplit_model(model_type, split, schedule, spr, model_runs):
    res = model_runs[(model_type, split, schedule, spr)]
    assert res is not None and res["reference_match"] is True, (model_runs["__codes__"], res and res.get("failure"))
    assert res["model"] == model_type and len(res["losses"]) == 4
    assert res["max_abs_diff"] <= 1e-5
    assert res["compared_param_elements"] == res["model_param_elements"] > 0
    if model_type in ("gpt2", "bert"):
        assert "tied weights" in res["stage_builder"]


ONE_RANK = [("bert", "InterleavedZeroBubble"), ("llama", "Interleaved1F1B")]


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    """Traced models with two stages on ONE rank (pipe.build_stage): on torch 2.11 to 2.14 the traced
    stage posts a warm-up send to its own rank, which gloo cannot do (labkit.versions drops it)."""
    from conftest import run_suite

    root = tmp_path_factory.mktemp("one_rank")
    configs = {c: RunConfig(model_name=c[0], split="tracer", schedule=c[1], pp_size=1, stages_per_rank=2,
                            preset="tiny", n_microbatches=4) for c in ONE_RANK}
    yield run_suite(root, "one_rank", configs, 1)


@pytest.mark.launches
@pytest.mark.parametrize("model_type,schedule", ONE_RANK)
def test_traced_stages_sharing_one_rank_match(model_type, schedule, one_rank_runs):
    res = one_rank_runs[(model_type, schedule)]
    assert res is not None and res["reference_match"] is True, (one_rank_runs["__codes__"],
                                                                 res and res.get("failure"))
    assert "build_stage" in res["stage_builder"] and res["max_abs_diff"] <= 1e-5


@pytest.mark.launches
def test_clipping_counts_a_tied_weight_once(model_runs):
    """GPT-2's tied embedding / lm_head on stages 0 and 3 (ranks 0 and 1): after the tied gradients are
    summed both copies hold the same gradient; the unsplit model has one parameter, and the pipeline's
    norm (before clipping) must be its norm. Clipping acted (norm > 0.05), and the clipped gradients
    match the unsplit model clipped by torch.nn.utils.clip_grad_norm_."""
    res = model_runs["gpt2 clip"]
    assert res is not None and res["reference_match"] is True, (model_runs["__codes__"], res and res.get("failure"))
    assert "tied weights" in res["stage_builder"]
    (norm,) = res["grad_norm_before_clip"]
    assert norm > 0.05


# ---- balancing (labkit.models.balance) ----

@pytest.mark.launches
def test_split_points_auto_balances_a_real_run_and_still_matches(model_runs):
    res = model_runs["auto"]
    assert res is not None and res["reference_match"] is True, (model_runs["__codes__"], res and res.get("failure"))
    bounds, plan = res["layer_bounds"], res["balance"]
    assert bounds == plan["bounds"] and bounds[0] == 0 and len(bounds) == 3
    assert bounds[1] > bounds[2] // 2  # the heavy head's stage gets fewer blocks than an even cut
    assert max(plan["stage_time_s"]) <= max(plan["even_stage_time_s"])


def test_best_bounds_relieves_a_heavy_last_stage():
    from labkit.models.balance import balance, best_bounds

    assert best_bounds([1] * 8, 4) == [0, 2, 4, 6, 8]
    plan = balance([1, 1, 1, 1, 1, 1, 1, 5], 2)  # last unit: a block plus a large vocabulary's head
    assert plan.bounds == [0, 6, 8] and plan.split_points == ["layers.6"]
    assert plan.stage_time_s == [6, 6] and plan.even_stage_time_s == [4, 8]
    with pytest.raises(ValueError, match="one at least per stage"):
        best_bounds([1, 1], 3)


def test_measured_units_see_the_heavy_head():
    # wide_vocab: a 32k vocabulary; the last unit (block + output layer + loss) outweighs a block.
    from labkit.models.balance import balance, measure_units

    cfg = RunConfig(model_name="llama", preset="wide_vocab", schedule="1F1B")
    times, sizes = measure_units(cfg, repeats=3)
    assert len(times) == len(sizes) == 8 and min(sizes) > 0
    assert times[-1] > 2 * sorted(times[1:-1])[len(times) // 2]
    plan = balance(times, 2, sizes)
    assert plan.bounds[1] > 4 and max(plan.stage_time_s) <= max(plan.even_stage_time_s)
    assert RunConfig(split_points=["auto"]).auto_split
