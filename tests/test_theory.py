"""The ideal-schedule simulator: planned orders from torch, the cost model, deadlocks, fitting."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from labkit.schedules.table import SCHEDULES, stage_placement
from labkit.core.errors import ConfigError
from labkit.theory import (
    Cost,
    ScheduleDeadlock,
    ScheduleError,
    check_order,
    closed_form_bubble,
    fit_cost,
    planned_actions,
    simulate,
    simulate_order,
    theory_json,
)
from labkit.core.actions import Action, Timeline

SPLIT_BACKWARD = {"InterleavedZeroBubble", "ZBVZeroBubble"}  # I and W for every microbatch, never B
MIXED_BACKWARD = {"DualPipeV"}  # B for some microbatches, I + W for the others


def _cases():
    for name, info in SCHEDULES.items():
        spr = 2 if info.multi else 1
        for p in (2, 4):
            for m in (4, 8):
                if name == "DualPipeV" and m < 2 * p:  # torch: at least as many microbatches as stages
                    continue
                yield pytest.param(name, p, m, spr, id=f"{name}-p{p}-m{m}")


CASES = list(_cases())


# --- bubble ------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_bubble_matches_closed_form(schedule, p, m):
    metrics = simulate(schedule, p, m, cost=Cost(F=1, B=2, p2p=0)).metrics()
    assert abs(metrics["bubble_fraction"] - (p - 1) / (m + p - 1)) < 1e-9
    assert abs(metrics["bubble_fraction"] - closed_form_bubble(p, m)) < 1e-9
    assert abs(metrics["bubble_ratio"] - closed_form_bubble(p, m, "ratio")) < 1e-9
    assert metrics["makespan"] == pytest.approx((m + p - 1) * 3)


def test_closed_form_values_and_errors():
    assert closed_form_bubble(4, 8) == pytest.approx(3 / 11)
    assert closed_form_bubble(4, 8, definition="ratio") == pytest.approx(3 / 8)
    assert closed_form_bubble(1, 5) == 0.0
    with pytest.raises(ConfigError, match="fraction"):
        closed_form_bubble(2, 4, definition="percent")
    with pytest.raises(ConfigError, match="n_microbatches"):
        closed_form_bubble(2, 0)


def test_p2p_latency_grows_the_bubble():
    base = simulate("GPipe", 4, 4).metrics()
    slow = simulate("GPipe", 4, 4, cost="F=1,B=2,p2p=0.5").metrics()
    # 3 hops down and 3 hops back on the critical path
    assert slow["makespan"] == pytest.approx(base["makespan"] + 6 * 0.5)
    assert slow["bubble_fraction"] > base["bubble_fraction"]


# --- what torch plans ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,p,m,spr", CASES)
def test_planned_actions_cover_every_stage_and_microbatch(name, p, m, spr):
    info = SCHEDULES[name]
    order = planned_actions(name, p, m, spr)
    assert sorted(order) == list(range(p))
    placement = stage_placement(p, spr, info.v_shaped)
    for r, acts in order.items():
        assert {s for _, s, _ in acts} == set(placement[r]), f"rank {r} runs stages of another rank"
    counts = Counter((k, s, i) for acts in order.values() for (k, s, i) in acts)
    assert all(c == 1 for c in counts.values()), "an action is planned twice"
    n_stages = p * spr
    for s in range(n_stages):
        for i in range(m):
            assert counts[("F", s, i)] == 1
            b, inp, w = counts[("B", s, i)], counts[("I", s, i)], counts[("W", s, i)]
            if name in SPLIT_BACKWARD:
                assert (b, inp, w) == (0, 1, 1), (s, i)
            elif name in MIXED_BACKWARD:
                assert (b, inp, w) in ((1, 0, 0), (0, 1, 1)), (s, i)
            else:
                assert (b, inp, w) == (1, 0, 0), (s, i)
    kinds = Counter(k for acts in order.values() for (k, _, _) in acts)
    assert kinds["F"] == n_stages * m
    assert kinds["B"] + kinds["I"] == n_stages * m
    assert kinds["I"] == kinds["W"]
    if name in MIXED_BACKWARD:
        assert kinds["B"] > 0 and kinds["I"] > 0  # DualPipeV really mixes both in torch 2.13


def test_gpipe_order_equals_torch_pipeline_order():
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.num_stages, stage.group_size, stage.group_rank = 3, 3, 0
    torch_order = ScheduleGPipe(stage, 4).pipeline_order
    ours = planned_actions("GPipe", 3, 4)
    for r in range(3):
        theirs = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in torch_order[r]
                  if a is not None and a.computation_type.value in "FBIW"]
        assert ours[r] == theirs


def test_1f1b_order_follows_the_runtime_loop():
    order = planned_actions("1F1B", 4, 6)
    for r, acts in order.items():
        warmup = min(6, 4 - r)
        assert acts[:warmup] == [("F", r, i) for i in range(warmup)]
        assert acts[warmup] == ("B", r, 0)
    assert order[3][:4] == [("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1)]
    # fewer microbatches than ranks: torch refuses 1F1B; the loop still runs and is as slow as GPipe
    assert planned_actions("1F1B", 4, 2)[0] == planned_actions("GPipe", 4, 2)[0]
    assert simulate("1F1B", 4, 2).metrics()["makespan"] == simulate("GPipe", 4, 2).metrics()["makespan"]
    assert "refuses" in simulate("1F1B", 4, 2).meta["note"]


@pytest.mark.parametrize("kwargs,match", [
    ({"schedule": "Nope"}, "Unknown schedule"),
    ({"schedule": "GPipe", "stages_per_rank": 2}, "one stage per rank"),
    ({"schedule": "ZBVZeroBubble", "stages_per_rank": 3}, "V-shaped"),
    ({"schedule": "Interleaved1F1B", "stages_per_rank": 1}, "multi-stage schedule"),  # config's rule
    ({"schedule": "GPipe", "stages_per_rank": 0}, "stages_per_rank"),
    ({"schedule": "DualPipeV", "pp_size": 4, "n_microbatches": 4}, "torch refuses DualPipeV"),
    ({"schedule": "GPipe", "pp_size": 0}, "pp_size"),
    ({"schedule": "GPipe", "n_microbatches": 2.5}, "n_microbatches"),
])
def test_planned_actions_rejects_bad_configs(kwargs, match):
    args = {"pp_size": 2, "n_microbatches": 4, **kwargs}
    with pytest.raises(ConfigError, match=match):
        planned_actions(**args)
    with pytest.raises(ConfigError, match=match):
        simulate(**args)


def test_stages_per_rank_rules_are_the_configs():
    """theory asks labkit.config.run (the one owner): the same message as `labkit run` prints."""
    from labkit.config.run import RunConfig

    for schedule, spr in (("Interleaved1F1B", 1), ("GPipe", 2), ("DualPipeV", 3)):
        with pytest.raises(ConfigError) as ours:
            simulate(schedule, 2, 4, spr)
        with pytest.raises(ConfigError) as run:
            RunConfig(schedule=schedule, pp_size=2, n_microbatches=4, stages_per_rank=spr)
        assert str(ours.value) == str(run.value)
    assert simulate("Interleaved1F1B", 1, 4, 1).meta["stages_per_rank"] == 1  # one rank: allowed, as in config


# --- simulation invariants ---------------------------------------------------------------------

def _assert_valid(tl: Timeline, order: dict, cost: Cost, n_stages: int):
    stage_rank = {s: r for r, acts in order.items() for _, s, _ in acts}
    by_rank = defaultdict(list)
    for a in tl.actions:
        by_rank[a.rank].append(a)
    for r, acts in by_rank.items():
        acts.sort(key=lambda a: a.start)
        # the rank ran exactly its planned order, one action at a time
        assert [(a.kind, a.stage, a.microbatch) for a in acts] == order[r]
        for prev, nxt in zip(acts, acts[1:]):
            assert nxt.start >= prev.end - 1e-12, f"rank {r} overlaps {prev} and {nxt}"
        for a in acts:
            assert a.duration == pytest.approx(cost.duration(a.kind))
    end = {(a.kind, a.stage, a.microbatch): a.end for a in tl.actions}

    def arrives(dep, rank):
        return end[dep] + (cost.p2p if stage_rank[dep[1]] != rank else 0.0)

    for a in tl.actions:
        if a.kind == "F" and a.stage > 0:
            assert a.start >= arrives(("F", a.stage - 1, a.microbatch), a.rank) - 1e-12
        if a.kind in ("B", "I"):
            assert a.start >= end[("F", a.stage, a.microbatch)] - 1e-12
            if a.stage < n_stages - 1:
                grads = [d for d in (("B", a.stage + 1, a.microbatch), ("I", a.stage + 1, a.microbatch)) if d in end]
                assert len(grads) == 1
                assert a.start >= arrives(grads[0], a.rank) - 1e-12
        if a.kind == "W":
            assert a.start >= end[("I", a.stage, a.microbatch)] - 1e-12


@pytest.mark.parametrize("name,p,m,spr", CASES)
def test_simulation_respects_order_and_dependencies(name, p, m, spr):
    cost = Cost(F=1.0, B=2.0, p2p=0.25)
    tl = simulate(name, p, m, spr, cost=cost)
    order = planned_actions(name, p, m, spr)
    assert tl.source == "theory"
    assert len(tl.actions) == sum(len(v) for v in order.values())
    _assert_valid(tl, order, cost, p * spr)
    meta = tl.meta
    assert (meta["schedule"], meta["pp_size"], meta["n_microbatches"], meta["stages_per_rank"]) == (name, p, m, spr)
    assert meta["cost"]["p2p"] == 0.25
    metrics = tl.metrics()
    assert 0.0 <= metrics["bubble_fraction"] < 1.0


def test_interleaving_divides_the_bubble_time_at_equal_model_size():
    p, m, v = 4, 8, 2
    gpipe = simulate("GPipe", p, m, cost=Cost(F=1, B=2)).metrics()["makespan"]
    inter = simulate("Interleaved1F1B", p, m, v, cost=Cost(F=1 / v, B=2 / v)).metrics()["makespan"]
    assert gpipe == pytest.approx(m * 3 + (p - 1) * 3)
    assert inter == pytest.approx(m * 3 + (p - 1) * 3 / v)  # Megatron's interleaved schedule: bubble / v


def test_zero_bubble_schedules_beat_1f1b():
    one_f_one_b = simulate("1F1B", 4, 8, cost="F=1,B=2").metrics()["bubble_fraction"]
    for name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert simulate(name, 4, 8, cost="F=1,B=2").metrics()["bubble_fraction"] < one_f_one_b / 2


# --- hand-written orders (notebook 08) ---------------------------------------------------------

def test_custom_order_equals_gpipe():
    order = {0: ["0F0", "0F1", "0B0", "0B1"], 1: [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]}
    mine = simulate_order(order, n_stages=2, n_microbatches=2)
    ref = simulate("GPipe", 2, 2)
    assert [(a.rank, a.kind, a.stage, a.microbatch, a.start, a.end) for a in mine.actions] == \
           [(a.rank, a.kind, a.stage, a.microbatch, a.start, a.end) for a in ref.actions]
    assert mine.meta["schedule"] == "custom"


def test_deadlock_is_detected_and_explained():
    # rank 0 waits for B(stage 1, mb 0) before its second forward; rank 1 wants that forward first
    order = {0: [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
             1: [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]}
    with pytest.raises(ScheduleDeadlock) as err:
        simulate_order(order, n_stages=2, n_microbatches=2)
    assert set(err.value.stuck) == {0, 1}
    assert err.value.stuck[0][1] == ("B", 0, 0)
    assert err.value.stuck[1][1] == ("F", 1, 1)
    text = str(err.value)
    assert "rank 0 is stuck" in text and "rank 1 is stuck" in text
    assert "F(stage 0, mb 1)" in text
    assert isinstance(err.value, ScheduleError) and isinstance(err.value, ValueError)


def test_deadlock_on_a_missing_input():
    with pytest.raises(ScheduleDeadlock, match="no rank plans"):
        simulate_order({0: [("F", 0, 0)], 1: [("B", 1, 0)]}, n_stages=2)


@pytest.mark.parametrize("order,match", [
    ({0: [("F", 0, 0)], 1: [("F", 0, 1)]}, "appears on rank 0 and rank 1"),
    ({0: [("F", 0, 0), ("F", 0, 0)]}, "planned twice"),
    ({0: [("F", 0, 0), ("W", 0, 0)]}, "has no I"),
    ({0: [("F", 0, 0), ("I", 0, 0), ("B", 0, 0)]}, "both B and I"),
    ({0: [("F", 5, 0)]}, "only 1 stages"),
    ({0: [("X", 0, 0)]}, "kind 'X'"),
    ({0: ["zero F one"]}, "Cannot read action"),
    ({0: [("F", 0, -1)]}, "microbatch must be"),
])
def test_malformed_orders_are_rejected(order, match):
    with pytest.raises(ScheduleError, match=match):
        simulate_order(order, n_stages=1)


def test_incomplete_order_with_n_microbatches():
    problems = check_order({0: [("F", 0, 0), ("B", 0, 0)]}, n_stages=1, n_microbatches=2)
    assert any("F(stage 0, mb 1) is missing" in p for p in problems)
    assert any("backward of stage 0 mb 1 is missing" in p for p in problems)
    assert check_order({0: [("F", 0, 0), ("F", 0, 1)]}, n_stages=1, n_microbatches=2) == []  # forward-only is fine
    with pytest.raises(ScheduleError, match="cannot be simulated"):
        simulate_order({0: [("F", 0, 0), ("B", 0, 0)]}, n_stages=1, n_microbatches=2)


# --- cost model --------------------------------------------------------------------------------

def test_cost_defaults_and_parse():
    c = Cost()
    assert (c.F, c.B, c.p2p) == (1.0, 2.0, 0.0)
    assert c.duration("I") == c.duration("W") == 1.0
    c = Cost.parse("F=1.5, B=3, i=1, W=2, P2P=0.1")
    assert (c.F, c.B, c.I, c.W, c.p2p) == (1.5, 3.0, 1.0, 2.0, 0.1)
    assert Cost.parse("") == Cost()
    assert Cost.parse("B=4").duration("W") == 2.0


@pytest.mark.parametrize("text,match", [
    ("F=1,X=2", "Unknown cost key 'X'.*Known keys: F, B, I, W, p2p"),
    ("F=one", "not a number"),
    ("F1", "KEY=VALUE"),
    ("F=1,f=2", "given twice"),
    ("B=-2", ">= 0"),
    ("F=nan", "finite"),
])
def test_cost_parse_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        Cost.parse(text)


def test_cost_rejects_bad_fields():
    with pytest.raises(ConfigError, match="Cost F"):
        Cost(F="1")
    with pytest.raises(ConfigError, match="Cost p2p"):
        Cost(p2p=-0.1)


@pytest.mark.parametrize("name,cost,expect", [
    ("1F1B", Cost(F=0.7, B=1.9), {"F": 0.7, "B": 1.9, "I": None, "W": None}),
    ("ZBVZeroBubble", Cost(F=1.5, I=1.25, W=1.75), {"F": 1.5, "B": 3.0, "I": 1.25, "W": 1.75}),
    ("DualPipeV", Cost(F=1.1, B=2.6, I=1.2, W=1.4), {"F": 1.1, "B": 2.6, "I": 1.2, "W": 1.4}),
])
def test_fit_cost_recovers_simulated_costs(name, cost, expect):
    fitted = fit_cost(simulate(name, 2, 4, cost=cost))
    for k, v in expect.items():
        got = getattr(fitted, k)
        assert got == pytest.approx(v) if v is not None else got is None, k
    assert fitted.unit == "units"


def test_cost_i_and_w_imply_b():
    """I and W without B give B = I + W (not the default 2): a full backward is its two halves."""
    c = Cost(F=0.5, I=0.5, W=0.5)
    assert (c.B, c.duration("B"), c.to_dict()["B"]) == (1.0, 1.0, 1.0)
    assert Cost.parse("F=0.5,I=0.5,W=0.5") == c == Cost(F=0.5, B=1, I=0.5, W=0.5)
    assert Cost(I=0.25, W=1.5).B == 1.75 and Cost().B == 2.0 and Cost(B=3).duration("I") == 1.5
    assert Cost(B=2.6, I=1.2, W=1.4).B == 2.6  # 1.2 + 1.4 is 2.5999999999999996 in floats: agrees
    # one half given: the other is the rest of B
    assert (Cost(B=3, I=1).weight_grad, Cost(B=3, W=1).input_grad) == (2.0, 2.0)
    assert Cost(**Cost(F=1, I=0.3, W=0.9).to_dict()) == Cost(F=1, I=0.3, W=0.9)  # what `labkit search --comm` rebuilds


@pytest.mark.parametrize("kwargs,match", [
    ({"F": 0.5, "B": 2, "I": 0.5, "W": 0.5}, r"B=2 contradicts I \+ W = 0.5 \+ 0.5 = 1.*Give B=1, or leave B out"),
    ({"B": 1, "I": 1, "W": 1}, r"contradicts I \+ W.*Give B=2"),
    ({"I": 3}, r"I=3 is longer than the whole backward B=2.*give W too"),
    ({"B": 1, "W": 1.5}, r"W=1.5 is longer than the whole backward B=1"),
])
def test_cost_refuses_a_b_that_is_not_i_plus_w(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Cost(**kwargs)
    with pytest.raises(ConfigError, match=match):
        Cost.parse(",".join(f"{k}={v}" for k, v in kwargs.items()))


def test_cli_theory_cost_i_w_without_b(capsys):
    """Issue 30: `--cost F=0.5,I=0.5,W=0.5` kept B = 2 and gave DualPipeV pp 4 m 8 a makespan of 37.5."""
    from labkit.cli import main

    args = ["theory", "--schedule", "DualPipeV", "--pp-size", "4", "--microbatches", "8", "--json"]
    assert main(args + ["--cost", "F=0.5,I=0.5,W=0.5"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert main(args + ["--cost", "F=0.5,B=1"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert split["makespan"] == whole["makespan"] == 25.5
    assert main(args + ["--cost", "F=0.5,I=0.5,W=0.5,B=2"]) == 2
    err = capsys.readouterr().err
    assert "contradicts I + W" in err and "Give B=1" in err and "Traceback" not in err


def test_fit_cost_of_whole_and_split_backwards_keeps_b_equal_i_plus_w():
    """DualPipeV runs some backwards whole (B) and splits others (I, W); measured, B is not exactly
    I + W. The fit scales I and W by one factor: B = I + W, the I:W ratio and the run's total
    backward time are kept."""
    acts = [Action(0, 0, 0, "F", 0.0, 1.0), Action(0, 0, 0, "B", 1.0, 3.5),      # B = 2.5
            Action(0, 0, 1, "B", 3.5, 6.0),                                       # B = 2.5
            Action(0, 0, 2, "I", 6.0, 7.0), Action(0, 0, 2, "W", 7.0, 9.0)]       # I + W = 3
    c = fit_cost(Timeline(acts, source="measured"))
    assert c.B == pytest.approx(c.input_grad + c.weight_grad)
    assert c.weight_grad == pytest.approx(2 * c.input_grad)
    assert 2 * c.B + c.input_grad + c.weight_grad == pytest.approx(2.5 + 2.5 + 1 + 2)
    assert c.B == pytest.approx(8 / 3)


def test_fit_cost_of_measured_timeline_is_in_seconds():
    tl = Timeline([Action(0, 0, 0, "F", 100.0, 100.5), Action(0, 0, 0, "B", 100.5, 101.5),
                   Action(0, 0, 0, "SEND", 100.5, 100.6)], source="measured")
    c = fit_cost(tl)
    assert (c.F, c.B, c.unit) == (0.5, 1.0, "s")
    with pytest.raises(ScheduleError, match="no compute actions"):
        fit_cost(Timeline([]))


def test_theory_json():
    tl = simulate("Interleaved1F1B", 2, 4, cost="F=1,B=2")
    out = theory_json(tl)
    assert set(out) == {"actions", "makespan", "bubble_fraction", "bubble_ratio", "meta", "peak"}
    assert set(out["actions"][0]) == {"rank", "stage", "microbatch", "kind", "start", "end"}
    assert len(out["actions"]) == 2 * 2 * 4 * 2
    assert out["makespan"] == tl.metrics()["makespan"]
    assert out["meta"]["cost"] == {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "p2p": 0.0, "unit": "units"}
    json.dumps(out)  # serialisable as is
    # each built-in schedule's peak activation memory per rank, in 1F1B stage microbatches (issue 32):
    # 1F1B holds p - r on rank r; ZBVZeroBubble holds 1F1B's first-rank peak on every rank
    assert theory_json(simulate("1F1B", 4, 8))["peak"] == {"0": 4, "1": 3, "2": 2, "3": 1}
    assert theory_json(simulate("ZBVZeroBubble", 4, 8, 2))["peak"] == {str(r): 4 for r in range(4)}


# --- against real runs ---------------------------------------------------------------------------

def _fixture_runs():
    import pathlib

    root = pathlib.Path(__file__).parent / "fixtures" / "pplogs"
    for d in sorted(root.glob("*/*-p*-m*")):
        name, p, m = d.name.split("-")
        if name in SCHEDULES:
            yield pytest.param(d, name, int(p[1:]), int(m[1:]), id=f"{d.parent.name}-{d.name}")


@pytest.mark.parametrize("run_dir,name,p,m", list(_fixture_runs()))
def test_planned_order_is_what_torch_ran(run_dir, name, p, m):
    """Each rank of a captured real run (TORCH_LOGS=+pp) ran exactly the order planned here."""
    logs = pytest.importorskip("labkit.logs")
    measured = logs.timeline_from_path(run_dir)
    spr = 2 if SCHEDULES[name].multi else 1
    plan = planned_actions(name, p, m, spr)
    for r in plan:
        ran = sorted((a for a in measured.compute() if a.rank == r), key=lambda a: (a.start, a.end))
        assert [(a.kind, a.stage, a.microbatch) for a in ran] == plan[r], f"rank {r}"


def test_rank_peak_bytes_weighs_each_stage():
    from labkit.schedules.orders import rank_peak_bytes, rank_peak_in_flight

    order = {0: [("F", 0, 0), ("F", 3, 0), ("B", 3, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]}
    assert rank_peak_in_flight(order) == {0: 2}
    assert rank_peak_bytes(order, {0: 64, 3: 128}) == {0: 192}          # 0F0 + 3F0
    assert rank_peak_bytes(order, {0: 64, 3: 10}) == {0: 128}           # 0F0 + 0F1 outweigh 0F0 + 3F0
    plan = planned_actions("ZBVZeroBubble", 4, 8, 2)
    assert rank_peak_bytes(plan, {s: 1 for s in range(8)}) == rank_peak_in_flight(plan)
