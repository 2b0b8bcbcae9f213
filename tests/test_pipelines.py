"""Ranks that form several pipelines (pp x dp, pp x dp x tp): grouped from what each rank recorded
(its stage's process group, `labkit.spans.record`), split into one Timeline per pipeline, each beside
its own fitted ideal, each with its own idle report. Pure tests here; the real composed run is
`tests/test_parallel.py::test_a_composed_runs_timeline_and_idle_are_per_pipeline`."""

import json

import pytest

from labkit.timeline.compare import compute_steps, one_step, pipelines_vs_ideal, run_shape
from labkit.spans.idle import IdleByPipeline, explain_idle_by_pipeline
from labkit.spans.read import timeline_from_spans
from labkit.theory import Cost, simulate
from labkit.core.actions import Action, Timeline, group_pipelines, split_timeline


def test_pipelines_are_the_groups_the_ranks_recorded():
    pp_dp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}  # init_device_mesh (2, 2, 1): mesh["pp"] groups
    assert group_pipelines(pp_dp) == [[0, 2], [1, 3]]
    pp_dp_tp = {r: [r % 4, r % 4 + 4] for r in range(8)}  # (2, 2, 2): ranks sharing (dp, tp)
    assert group_pipelines(pp_dp_tp) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_pipelines({0: [0, 1], 1: [0, 1]}) == [[0, 1]]  # a plain pipeline
    assert group_pipelines({0: [2, 0], 2: [2, 0]}) == [[2, 0]]  # group order kept: rank 2 holds stage 0
    assert group_pipelines({0: [0, 2]}) == [[0, 2]]  # rank 2 recorded nothing: still in rank 0's pipeline


@pytest.mark.parametrize("groups, message", [
    ({0: [1, 2]}, "does not hold it"),
    ({0: [0, 2], 2: [0, 1, 2]}, "disagree"),
    ({0: [0, 2], 1: [1, 2]}, "two pipelines"),
    ({0: [0, 0]}, "twice"),
])
def test_contradicting_records_are_refused(groups, message):
    with pytest.raises(ValueError, match=message):
        group_pipelines(groups)


def _pipeline(ranks, cost, fsdp=True):
    """A 1F1B step of 2 stages on `ranks` (the simulated order), with FSDP's UNSHARD / REDUCE_GRAD strips."""
    tl = simulate("1F1B", 2, 4, 1, cost)
    acts = [a._replace(rank=ranks[a.rank]) for a in tl.actions]
    if fsdp:
        end = max(a.end for a in acts)
        for i, r in enumerate(ranks):
            acts += [Action(r, i, -1, "UNSHARD", -0.1, 0.0), Action(r, i, -1, "REDUCE_GRAD", end, end + 0.2)]
    return acts


def _two_pipelines():
    acts = _pipeline([0, 2], Cost(F=1.0, B=2.0)) + _pipeline([1, 3], Cost(F=2.0, B=4.0))
    return Timeline(sorted(acts, key=lambda a: (a.start, a.rank)), "spans",
                    {"schedule": "Schedule1F1B", "pipelines": [[0, 2], [1, 3]], "steps_per_rank": {str(r): 1 for r in range(4)}})


def test_a_timeline_splits_into_its_pipelines_and_keeps_every_action():
    tl = _two_pipelines()
    assert tl.pipelines == [[0, 2], [1, 3]] and tl.pipeline_of() == {0: 0, 2: 0, 1: 1, 3: 1}
    parts = tl.split_pipelines()
    assert [p.ranks for p in parts] == [[0, 2], [1, 3]]
    assert sorted(a for p in parts for a in p.actions) == sorted(tl.actions)  # every action, exactly once
    for i, p in enumerate(parts):
        assert p.pipelines == [tl.pipelines[i]] and p.meta["pipeline"] == i and p.source == "spans"
        assert {"UNSHARD", "REDUCE_GRAD"} <= {a.kind for a in p.actions}
        assert p.counts() == {(0, "F"): 4, (0, "B"): 4, (1, "F"): 4, (1, "B"): 4}
        assert set(p.meta["steps_per_rank"]) == {str(r) for r in p.ranks}
    # a timeline without records is one pipeline; ranks no record names are kept together, not dropped
    assert Timeline(tl.actions).pipelines == [[0, 1, 2, 3]]
    assert Timeline(tl.actions, meta={"pipelines": [[0, 2]]}).pipelines == [[0, 2], [1, 3]]
    assert split_timeline(tl, [[1, 3]])[0].ranks == [1, 3]


def test_each_pipeline_gets_its_own_fitted_ideal():
    views = pipelines_vs_ideal(_two_pipelines())
    assert len(views) == 2
    for (measured, ideal, summary), ranks, f in zip(views, ([0, 2], [1, 3]), (1.0, 2.0)):
        assert summary["pipeline"] == views.index((measured, ideal, summary)) and summary["ranks"] == ranks
        assert (summary["schedule"], summary["pp_size"], summary["n_microbatches"], summary["stages_per_rank"]) == \
            ("1F1B", 2, 4, 1)
        assert ideal.ranks == ranks and ideal.counts() == measured.counts()  # the ideal drawn on the same ranks
        assert ideal.metrics()["mean_duration"]["0"]["F"] == pytest.approx(f)  # fitted to this pipeline alone
        # the measured step is the simulated one: its ideal's bubble is its own
        assert summary["measured_bubble_fraction"] == pytest.approx(summary["ideal_bubble_fraction"], abs=0.05)


def test_ranks_of_several_pipelines_without_records_are_not_read_as_one():
    tl = _two_pipelines()
    del tl.meta["pipelines"]
    with pytest.raises(ValueError, match="several pipelines") as e:
        run_shape(tl)
    assert "--stages-per-rank" not in str(e.value)


def test_one_step_keeps_the_steps_fsdp_actions_and_transfers():
    one = _pipeline([0, 1], Cost(F=1.0, B=2.0))
    shift = max(a.end for a in one) + 1.0
    two = one + [a._replace(start=a.start + shift, end=a.end + shift) for a in one]
    tl = Timeline(two, "spans", {"schedule": "Schedule1F1B", "steps": 2})
    last, first = one_step(tl), one_step(tl, "first")
    for step, base in ((last, shift), (first, 0.0)):
        assert sorted(a.kind for a in step.actions) == sorted(a.kind for a in one)
        assert min(a.start for a in step.actions) == pytest.approx(base - 0.1)


def test_compute_steps_cuts_a_run_into_its_steps_and_one_slow_step_stays_in_its_own():
    one = [a for a in simulate("1F1B", 2, 4, 1, Cost(F=1.0, B=2.0)).actions]
    shift = max(a.end for a in one) + 1.0
    slow = [a._replace(start=3 * a.start + 2 * shift, end=3 * a.end + 2 * shift) for a in one]  # step 3: 3x longer
    steps = [one, [a._replace(start=a.start + shift, end=a.end + shift) for a in one], slow]
    tl = Timeline([a for s in steps for a in s], "spans", {"schedule": "Schedule1F1B", "steps": 3})
    got = compute_steps(tl)
    assert [len(s.actions) for s in got] == [len(one)] * 3
    assert [s.metrics()["makespan"] for s in got] == pytest.approx([simulate("1F1B", 2, 4, 1, Cost(F=1.0, B=2.0))
                                                                    .metrics()["makespan"] * k for k in (1, 1, 3)])
    assert compute_steps(Timeline(one, "spans", {"steps": 1}))[0].counts() == Timeline(one, "spans", {}).counts()


def _write_spans(d, pipelines, schedule="Schedule1F1B"):
    """Spans files as `labkit.spans.record` writes them: two pipelines of a 1F1B step."""
    tl = _two_pipelines()
    (d / "spans").mkdir(parents=True)
    for r in tl.ranks:
        rows = [{"meta": {"rank": r, "torch": "x", "clock": "host (time.time)"}},
                {"begin_step": 0, "schedule": schedule, **({"pipeline": pipelines[r]} if pipelines else {})}]
        rows += [{"rank": r, "step": 0, "kind": a.kind, "stage": a.stage, "mb": a.microbatch,
                  "start": 100 + a.start, "end": 100 + a.end} for a in tl.actions if a.rank == r]
        (d / "spans" / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))


def test_spans_carry_the_pipelines_and_idle_is_reported_per_pipeline(tmp_path):
    _write_spans(tmp_path, {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]})
    tl = timeline_from_spans(tmp_path)
    assert tl.pipelines == [[0, 2], [1, 3]] and len(tl.ranks) == 4  # every rank's actions, split known
    rep = explain_idle_by_pipeline(tmp_path)
    assert isinstance(rep, IdleByPipeline) and rep.pipelines == [[0, 2], [1, 3]]
    for ranks, r, part in zip(rep.pipelines, rep, tl.split_pipelines()):
        assert sorted(r.idle) == ranks
        m = part.metrics()
        assert r.makespan == pytest.approx(m["makespan"])  # its own step, not the slower replica's
        for rank in ranks:
            assert sum(r.idle[rank].values()) == pytest.approx(m["idle"][str(rank)])
    text = rep.text()
    assert "pipeline 0 (ranks 0, 2)" in text and "pipeline 1 (ranks 1, 3)" in text
    # one pipeline recorded (a plain run): the one IdleReport, as before
    plain = tmp_path / "plain"
    _write_spans(plain, {r: [0, 1, 2, 3] for r in range(4)})
    assert not isinstance(explain_idle_by_pipeline(plain), IdleByPipeline)
    assert "pipelines" not in timeline_from_spans(plain).meta


def test_the_command_line_reports_each_pipeline(tmp_path, capsys):
    from labkit.cli import main

    _write_spans(tmp_path, {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]})
    assert main(["timeline", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted({a["rank"] for a in out["actions"]}) == [0, 1, 2, 3]  # every rank's actions
    assert [p["ranks"] for p in out["pipelines"]] == [[0, 2], [1, 3]]
    assert all(p["vs_ideal"]["ranks"] == p["ranks"] and p["vs_ideal"]["pp_size"] == 2 for p in out["pipelines"])
    assert main(["timeline", str(tmp_path), "--idle"]) == 0
    assert "pipeline 1 (ranks 1, 3)" in capsys.readouterr().out
    assert main(["timeline", str(tmp_path), "--plot", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 0
