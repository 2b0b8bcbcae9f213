"""Why is this step slower (labkit.timeline.slowdown, issue 52): two measurements of one schedule, the
change in their mean step time split into causes that add up to it exactly.

The references are steps of known cause: the schedule's own simulation (`labkit.theory.simulate`,
per-stage costs) with one stage's forwards made 1.6x as long, or every action stretched by time its
rank spent without a CPU (spans with run-queue clocks, written to files as the ranks write them);
and a hand-made step whose every piece of critical path is counted by hand. Issue 57: every cause that
grew beyond its noise over the rounds (or two runs' steps), largest first, with the stage whose compute
grew; rounds that disagree on the cause; one verdict through explain_slowdown, pool.compare and the CLI;
a busy baseline said, never a bare verdict. Pure logic: no process.
"""

import json
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from labkit.cli import main
from labkit.core.actions import Action, Timeline
from labkit.ranks.readings import CellReadings
from labkit.spans.read import Span, timeline_from_spans
from labkit.theory import Cost, simulate
from labkit.theory.cost import StageCosts
from labkit.timeline import Slowdown, compute_steps, explain_slowdown
from labkit.timeline.slowdown import CAUSES

MS = 1e-3
FIXTURES = Path(__file__).parent / "fixtures" / "pplogs"


def steps(slow: float = 1.0, scale: float = 1.0, pp: int = 2, n_steps: int = 3, schedule: str = "1F1B",
          link: float = 0.1 * MS):
    """[(step, action)]: `n_steps` steps of `schedule` on `pp` ranks, 4 microbatches; stage 1's forwards
    `slow` times as long, every action `scale` times (ms; `link` s between ranks, 1 ms between steps)."""
    base = Cost(F=1 * MS * scale, B=2 * MS * scale)
    one = simulate(schedule, pp, 4, 1, StageCosts(((1, Cost(F=slow * MS * scale, B=2 * MS * scale)),), base,
                                                  p2p=link))
    period = one.metrics()["makespan"] + MS
    return [(k, a._replace(start=a.start + k * period, end=a.end + k * period))
            for k in range(n_steps) for a in one.actions]


def timeline(**kw) -> Timeline:
    acts = steps(**kw)
    return Timeline([a for _, a in acts], "theory", {"steps": 1 + max(k for k, _ in acts)})


def write_spans(folder, acts, queued_share: float = 0.0, clocks: bool = True, waits: bool = False):
    """Spans files of `acts` as the ranks write them (spans/rank<N>.jsonl): each compute span with its
    run-queue clock (`queued_share` of it without a CPU), or none (`clocks=False`: older files, CUDA);
    with `waits`, a wait for a receive in each gap before an action (where torch waits for its input)."""
    (folder / "spans").mkdir(parents=True)
    for rank in sorted({a.rank for _, a in acts}):
        level, lines, free = 0.0, [{"meta": {"rank": rank, "clock": "host (time.time)"}}], acts[0][1].start
        for k, a in sorted(((k, a) for k, a in acts if a.rank == rank), key=lambda x: x[1].start):
            if waits and a.start > free:
                lines.append({"rank": rank, "step": k, "kind": "WAIT", "stage": -1, "mb": -1, "what": "recv",
                              "start": free, "end": a.start, **({"rq": [level, level]} if clocks else {})})
            free = a.end
            row = {"rank": rank, "step": k, "kind": a.kind, "stage": a.stage, "mb": a.microbatch,
                   "start": a.start, "end": a.end}
            if clocks:
                row["rq"] = [level, level + queued_share * a.duration]
                level += queued_share * a.duration
            lines.append(row)
        (folder / "spans" / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


def adds_up(s: Slowdown) -> None:
    """Each side's causes are its step time, so the causes' changes are the step's change."""
    known = [c for c in CAUSES if s.causes[c][0] is not None]
    for side, total in ((0, s.before), (1, s.after)):
        assert sum(s.causes[c][side] for c in known) == pytest.approx(total, rel=1e-12, abs=1e-15)
        assert sum(v[side] for v in s.by_stage.values()) == pytest.approx(s.causes["compute"][side], abs=1e-15)
    assert sum(s.delta[c] for c in known) == pytest.approx(s.after - s.before, rel=1e-9, abs=1e-15)
    assert all(s.causes[c][i] >= -1e-15 for c in known for i in (0, 1))


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_a_slower_stage_is_its_own_compute_wherever_it_sits(pp, schedule):
    """Stage 1 is the last of 2 stages, a middle one of 4: its forwards show as ITS compute, not as the
    waiting of the rank that ends the step (rank 0's last backward)."""
    before, after = timeline(pp=pp, schedule=schedule), timeline(slow=1.6, pp=pp, schedule=schedule)
    s = explain_slowdown(before, after)
    adds_up(s)
    steps_b = [t.metrics()["makespan"] for t in compute_steps(before)]
    assert s.before == pytest.approx(sum(steps_b) / len(steps_b))
    assert s.main == "compute" and s.after > s.before
    assert max(s.by_stage, key=lambda k: s.by_stage[k][1] - s.by_stage[k][0]) == (1, "F")
    assert s.per_action[(1, "F")] == pytest.approx((1 * MS, 1.6 * MS))
    assert "stage 1's forwards take 1.6x as long" in s.text() and "the code" in s.text()
    assert s.causes["machine"] == (None, None) and any("no scheduler clocks" in n for n in s.notes)


def test_a_busy_machine_is_the_machine_not_the_code(tmp_path):
    """After: every action 1.5x as long, the extra all run-queue time (its rank waited for a CPU)."""
    before = write_spans(tmp_path / "quiet", steps(), queued_share=0.0)
    after = write_spans(tmp_path / "busy", steps(scale=1.5), queued_share=1 / 3)
    s = explain_slowdown(before, after)
    adds_up(s)
    assert s.main == "machine" and s.delta["machine"] > 0.9 * (s.after - s.before)
    assert s.delta["compute"] == pytest.approx(0.0, abs=1e-12)
    assert s.per_action[(0, "B")] == pytest.approx((2 * MS, 2 * MS))
    assert "for a CPU: the machine, not your code" in s.text()
    # the same spans read as timelines carry every clock: the same text (issue 63); made anew from their
    # actions they keep each action's descheduled time: the same verdict, and a note
    read = [timeline_from_spans(before), timeline_from_spans(after)]
    assert explain_slowdown(*read).text() == s.text()
    t = explain_slowdown(*[Timeline(tl.actions, tl.source, tl.meta) for tl in read])
    adds_up(t)
    assert t.main == "machine" and t.delta["machine"] == pytest.approx(s.delta["machine"])
    assert any("pass its run directory" in n for n in t.notes)


def test_a_slower_link_is_communication(tmp_path):
    """After: 0.5 ms between ranks instead of 0.1 ms; the receiving rank waits for the data in flight."""
    before = write_spans(tmp_path / "a", steps(), waits=True)
    after = write_spans(tmp_path / "b", steps(link=0.5 * MS), waits=True)
    s = explain_slowdown(before, after)
    adds_up(s)
    assert s.main == "communication" and s.delta["compute"] == pytest.approx(0.0, abs=1e-12)
    assert s.delta["communication"] == pytest.approx(s.after - s.before)
    assert "sends and receives on the critical path took" in s.text()
    # a timeline from the logs has no waits in it: the same time is in no span, waiting
    t = explain_slowdown(timeline(), timeline(link=0.5 * MS))
    assert t.main == "waiting" and t.delta["waiting"] == pytest.approx(s.delta["communication"])


@pytest.mark.parametrize("schedule", ["GPipe-p4-m8", "Interleaved1F1B-p2-m4", "ZBVZeroBubble-p4-m8"])
def test_two_real_runs_add_up(schedule):
    """The same schedule's PP logs from two torch releases (tests/fixtures/pplogs): every cause read,
    none left over."""
    s = explain_slowdown(FIXTURES / "2.13.0" / schedule, FIXTURES / "2.15.0" / schedule)
    adds_up(s)
    assert s.before > 0 and s.after > 0 and s.text().startswith("The step takes")


def test_without_scheduler_clocks_the_machine_is_unknown_not_zero(tmp_path):
    before = write_spans(tmp_path / "a", steps(), clocks=False)
    after = write_spans(tmp_path / "b", steps(scale=1.5), queued_share=1 / 3)  # one side with clocks is not enough
    s = explain_slowdown(before, after)
    adds_up(s)
    assert s.causes["machine"] == (None, None) and s.delta["machine"] is None
    assert s.main == "compute"  # what it can compare: the actions, descheduling and all
    assert any(n.startswith("before: no scheduler clocks in its spans") for n in s.notes)
    assert any(n.startswith("machine: unknown") for n in s.notes)
    assert "unknown" in s.table().splitlines()[2]


def test_each_moment_of_the_critical_path_has_one_cause(tmp_path):
    """Rank 0: F 0-1. Rank 1: waits for its input 0-1.3, posts its receive 1.0-1.1, the kit's own 0.05 s
    before its F (1.4-2.4); its run-queue clock gains 0.01 s in the wait, 0.03 s in 1.3-1.4, 0.1 s in F.
    The path: rank 0's F, then on rank 1 the hop 1.0-1.4 (rank 0's F is done: the wait's rest is the
    data in flight, communication), rank 1's F."""
    spans = [Span(0, 0, "F", 0, 0, 0.0, 1.0, rq=(0.0, 0.0)),
             Span(1, 0, "WAIT", -1, -1, 0.0, 1.3, "recv", rq=(0.0, 0.02)),
             Span(1, 0, "RECV", -1, -1, 1.0, 1.1, rq=(0.01, 0.01)),
             Span(1, 0, "F", 1, 0, 1.4, 2.4, pre=0.05, rq=(0.05, 0.15))]
    quiet = [x._replace(rq=(0.0, 0.0)) for x in spans]
    s = explain_slowdown(as_files(tmp_path / "quiet", quiet), as_files(tmp_path / "busy", spans))
    adds_up(s)
    machine = 0.1 + 0.01 + 0.03  # inside F; in the wait after the post; 1.3-1.4 (kit and the rest), linear
    assert s.causes["machine"] == pytest.approx((0.0, machine))
    assert s.causes["compute"] == pytest.approx((2.0, 1.9))
    assert s.causes["communication"] == pytest.approx((0.1 + 0.2, 0.1 + 0.2 - 0.01))
    assert s.causes["kit"] == pytest.approx((0.05, 0.05 - 0.015))
    assert s.causes["waiting"] == pytest.approx((0.05, 0.05 - 0.015))  # 1.3-1.35: in no span
    assert {k: pytest.approx(v) for k, v in s.by_stage.items()} == {(0, "F"): (1.0, 1.0), (1, "F"): (1.0, 0.9)}


def test_a_sender_without_a_cpu_is_the_machine_not_communication(tmp_path):
    """Rank 0: F 0-1, posts its send, its next F. Rank 1 waits (blocked, not runnable) for that input,
    then its F. Quiet: the send is posted at 1.0, rank 1's F starts at 1.2. Busy: rank 0 is runnable
    without a CPU for 0.25 s before it posts its send (1.3-1.4) and 0.05 s inside the post, so rank 1's F
    starts at 1.5: those 0.3 s are the machine's, though rank 1's own clock did not move; rank 0's time
    without a CPU in its next F (from 1.4) is not the hand-off's."""
    def step(busy: bool) -> list[Span]:
        late, q = (0.3, 1.0) if busy else (0.0, 0.0)
        return [Span(0, 0, "F", 0, 0, 0.0, 1.0, rq=(0.0, 0.0)),
                Span(0, 0, "SEND", -1, -1, 1.0 + late, 1.1 + late, "send", rq=(0.25 * q, 0.3 * q)),
                Span(0, 0, "F", 0, 1, 1.1 + late, 2.1 + late, rq=(0.3 * q, 0.5 * q)),
                Span(1, 0, "WAIT", -1, -1, 0.0, 1.2 + late, "recv", rq=(0.0, 0.0)),
                Span(1, 0, "F", 1, 0, 1.2 + late, 2.2 + late, rq=(0.0, 0.0))]
    s = explain_slowdown(as_files(tmp_path / "quiet", step(False)), as_files(tmp_path / "busy", step(True)))
    adds_up(s)
    assert (s.before, s.after) == pytest.approx((2.2, 2.5))
    assert s.causes["machine"] == pytest.approx((0.0, 0.3))  # read on rank 1 alone: 0, all communication
    assert s.causes["communication"] == pytest.approx((0.2, 0.2))  # the data in flight, as before
    assert s.causes["compute"] == pytest.approx((2.0, 2.0))
    assert s.main == "machine" and "for a CPU: the machine, not your code" in s.text()


def test_a_heavier_stage_on_a_loaded_machine_is_the_code(tmp_path):
    """Both sides on a machine as loaded (each action two thirds of its time without a CPU): stage 1's
    forwards 2.8x as long after. The machine's seconds grow twice as much as the compute's (a longer
    action waits longer for a CPU), but by no more than the load it had: the code. A heavier load
    (after: every action 1.5x as long, 7/9 of it without a CPU: the same work) is the machine; a
    Slowdown made by hand, without the machine's split, is judged by the step's share."""
    before = write_spans(tmp_path / "before", steps(), queued_share=2 / 3, waits=True)
    s = explain_slowdown(before, write_spans(tmp_path / "heavier", steps(slow=2.8), queued_share=2 / 3, waits=True))
    adds_up(s)
    assert s.delta["machine"] > 1.9 * s.delta["compute"] > 0  # what the machine's seconds alone would name
    assert s.machine_excess == pytest.approx(0.0, abs=1e-12)  # its actions were descheduled as much as before
    assert s.main == "compute" and s.per_action[(1, "F")] == pytest.approx((1 / 3 * MS, 2.8 / 3 * MS))
    text = s.text()
    assert "stage 1's forwards take 2.8x as long" in text and "the code; the machine was as busy as before" in text
    assert "(descheduled 67% of the actions' time both times)" in text and "for a CPU came with the longer step" in text
    busier = explain_slowdown(before, write_spans(tmp_path / "busier", steps(scale=1.5), queued_share=7 / 9,
                                                  waits=True))
    adds_up(busier)
    assert busier.main == "machine" and busier.delta["compute"] == pytest.approx(0.0, abs=1e-12)
    assert busier.machine_excess > 0.9 * (busier.after - busier.before)
    assert "the machine, not your code (other processes held the cores; descheduled" in busier.text()
    assert explain_slowdown(timeline(), timeline(slow=1.6)).machine_excess is None  # no clocks: unknown
    by_hand = Slowdown(10 * MS, 20 * MS, {"machine": (5 * MS, 10 * MS), "compute": (4 * MS, 9 * MS),
                                          "waiting": (1 * MS, 1 * MS), "communication": (0.0, 0.0), "kit": (0.0, 0.0)},
                       {(1, "F"): (4 * MS, 9 * MS)})  # no split of the machine: the step at one share
    assert by_hand.machine_excess == pytest.approx(0.0) and by_hand.main == "compute"
    assert "(descheduled 50% of the step both times)" in by_hand.text()


def as_files(folder, spans):
    """Hand-made spans written as spans files, read back by the same reader as a run's."""
    (folder / "spans").mkdir(parents=True)
    for rank in sorted({x.rank for x in spans}):
        rows = [{"rank": x.rank, "step": x.step, "kind": x.kind, "stage": x.stage, "mb": x.mb, "start": x.start,
                 "end": x.end, "what": x.what, "pre": x.pre, "post": x.post, "rq": list(x.rq)}
                for x in spans if x.rank == rank]
        (folder / "spans" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_rounds_give_the_spread_of_one_rounds_change():
    before = [timeline() for _ in range(3)]
    after = [timeline(slow=f) for f in (1.5, 1.6, 1.7)]
    s = explain_slowdown(before, after)
    adds_up(s)
    assert s.rounds == 3
    one = [explain_slowdown(b, a).after - explain_slowdown(b, a).before for b, a in zip(before, after)]
    assert s.spread["step"] == pytest.approx((min(one), max(one))) and min(one) > 0
    assert s.after - s.before == pytest.approx(sum(one) / 3)
    assert "every round agrees" in s.text()
    mixed = explain_slowdown([timeline(), timeline(slow=1.6)], [timeline(slow=1.6), timeline()])
    assert "disagree" in mixed.text()
    with pytest.raises(ValueError, match="as many rounds before as after"):
        explain_slowdown(before, after[:2])


def test_the_plot_stacks_both_sides_by_cause():
    s = explain_slowdown(timeline(), timeline(slow=1.6))
    fig = Figure()
    ax = fig.subplots()
    artists = s.plot(ax)
    bars = artists[:-1]  # one stack per known cause, then the legend
    assert [b.get_label() for b in bars] == ["compute", "waiting", "communication"]
    tops = [sum(b.patches[i].get_height() for b in bars) for i in (0, 1)]
    assert tops == pytest.approx([1e3 * s.before, 1e3 * s.after])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["before", "after"]


def test_labkit_timeline_compare_prints_the_verdict_and_draws_it(tmp_path, capsys):
    before = write_spans(tmp_path / "quiet", steps(), queued_share=0.0)
    after = write_spans(tmp_path / "busy", steps(scale=1.5), queued_share=1 / 3)
    png = tmp_path / "why.png"
    assert main(["timeline", "--compare", str(before), str(after), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "the machine, not your code" in out and out.count("\n") > len(CAUSES)
    assert [line.split()[0] for line in out.splitlines()[2:4]] == ["cause", "step"]
    assert png.stat().st_size > 0
    assert main(["timeline", "--compare", str(before)]) == 2
    assert "two runs, BEFORE then AFTER" in capsys.readouterr().err


def test_a_timeline_without_compute_is_refused():
    empty = Timeline([Action(0, 0, -1, "SEND", 0.0, 1.0)], "spans")
    with pytest.raises(ValueError, match="no compute actions"):
        explain_slowdown(empty, timeline())


# ---- issue 57: every cause that grew, by its size; one rule everywhere --------------------------------------

def varied(factors, pp: int = 2):
    """[(step, action)]: one 1F1B step per (slow, scale) of `factors`, one after the other: stage 1's
    forwards `slow` times as long, every action `scale` times (ms)."""
    out, t0 = [], 0.0
    for k, (slow, scale) in enumerate(factors):
        one = simulate("1F1B", pp, 4, 1, StageCosts(((1, Cost(F=slow * MS * scale, B=2 * MS * scale)),),
                                                    Cost(F=1 * MS * scale, B=2 * MS * scale), p2p=0.1 * MS))
        out += [(k, a._replace(start=a.start + t0, end=a.end + t0)) for a in one.actions]
        t0 += one.metrics()["makespan"] + MS
    return out


def write_steps(folder, factors, load=None, cpu: float = 1.0):
    """`varied(factors)` as spans files: in a step of `scale` s, each action's (s - cpu) / s without a CPU
    (the work less descheduling is the unscaled one's times `cpu`: 1, a busier machine, not heavier code;
    more, each action's CPU time longer too, as beside a loop on its core). `load`:
    (runnable, load average) at every step's end, with the step's wall and run-queue seconds, as the
    ranks write them (`labkit.spans.read.machine_load`: the quiet rule reads them)."""
    acts = varied(factors)
    (folder / "spans").mkdir(parents=True)
    for rank in sorted({a.rank for _, a in acts}):
        level, lines = 0.0, [{"meta": {"rank": rank, "clock": "host (time.time)"}}]
        for k, (_, scale) in enumerate(factors):
            share = 1 - cpu / scale
            mine = sorted((a for kk, a in acts if a.rank == rank and kk == k), key=lambda a: a.start)
            lines.append({"begin_step": k, "schedule": "Schedule1F1B"})
            for a in mine:
                lines.append({"rank": rank, "step": k, "kind": a.kind, "stage": a.stage, "mb": a.microbatch,
                              "start": a.start, "end": a.end, "rq": [level, level + share * a.duration]})
                level += share * a.duration
            if load:
                wall = mine[-1].end - mine[0].start
                lines.append({"end_step": k, "wall": wall, "kit": 0.0, "wrappers": 0.0, "bookkeeping": 0.0,
                              "calls": 0, "cpu": wall * (1 - share), "queued": share * wall, "cores": 2,
                              "runnable": load[0], "load1": load[1]})
        (folder / "spans" / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


QUIET, BUSY = (2, 1.0), (4, 3.1)  # (runnable, load average) at the steps' ends, on 2 cores


def test_a_heavier_stage_on_a_busier_machine_names_both_largest_first(tmp_path):
    """Two runs of 4 steps each (never interleaved: the steps are the units): after, stage 1's forwards
    2.6-2.8x as long AND every action 1.45-1.55x as long with the extra all without a CPU. The machine's
    excess (~+11 ms) and stage 1's forwards (~+8 ms) both grew beyond their noise: both are named,
    the larger first; the steps agree on it."""
    before = write_steps(tmp_path / "yesterday", [(1.0, 1.0)] * 4, load=QUIET)
    after = write_steps(tmp_path / "today", [(2.7, 1.5), (2.8, 1.45), (2.6, 1.55), (2.7, 1.5)])
    s = explain_slowdown(before, after)
    adds_up(s)
    assert (s.unit, s.units, s.rounds) == ("step", 4, 1)
    assert s.named == ["machine", "compute"] and s.main == "machine" and s.stages == [(1, "F")]
    assert s.machine_excess > s.by_stage[(1, "F")][1] - s.by_stage[(1, "F")][0] > 0
    assert s.baseline is not None and s.baseline.ok
    text = s.text()
    assert "both: the machine (+" in text
    assert "for a CPU beyond the load it had: descheduled 33% of the step against 0%" in text
    assert "and your code: stage 1's forwards take 2.7x as long (+7.8 ms)" in text
    assert text.index("the machine (+") < text.index("your code:")
    assert "Over 4 steps each way (paired in order)" in text and "every step agrees on its sign." in text
    assert "disagree" not in text and "The baseline was quiet (2 runnable" in text
    # the code grew more than the machine: the code first
    heavier = write_steps(tmp_path / "heavier", [(4.0, 1.1), (4.2, 1.12), (3.9, 1.1), (4.1, 1.08)])
    t = explain_slowdown(before, heavier)
    assert t.named == ["compute", "machine"] and t.main == "compute"
    assert t.text().index("your code: stage 1's forwards take") < t.text().index("the machine (+")


def test_every_stage_slower_alike_beside_a_busier_machine_is_not_called_only_your_code(tmp_path):
    """After: every action about 2.5x as long, 40% of it without a CPU, so each action's CPU time is
    1.5x (what a busy loop on the rank's own core does: notebook 06b, section 1, read stage 1's forwards
    1.6x, its backwards 1.5x, stage 0's forwards 1.4x); nothing in the code changed. The machine and the
    compute both grew beyond their noise, every stage's alike: the verdict says the compute may be the
    machine's too, never a bare "your code". A heavier stage 1 on that machine stays your code."""
    before = write_steps(tmp_path / "quiet", [(1.0, 1.0)] * 4, load=QUIET)
    shared = [(1.0, 2.5), (1.0, 2.45), (1.0, 2.55), (1.0, 2.5)]
    s = explain_slowdown(before, write_steps(tmp_path / "shared", shared, cpu=1.5))
    adds_up(s)
    assert s.named[0] == "machine" and "compute" in s.named and len(s.stages) >= 2 and s.alike
    text = s.text()
    assert "every stage's compute alike: stage " in text and "the machine's too, unless you changed every stage" in text
    assert "your code:" not in text
    heavier = [(2.7, 2.5), (2.8, 2.45), (2.6, 2.55), (2.7, 2.5)]
    t = explain_slowdown(before, write_steps(tmp_path / "heavier", heavier, cpu=1.5))
    assert not t.alike and "your code: stage 1's forwards take" in t.text()


def test_rounds_that_disagree_on_the_cause_say_so_and_how_many_would_settle_it(tmp_path):
    """Four rounds: in two the code grew most, in two the machine; over all four both grew, the
    machine's lead within its noise. The headline names both; the text says the rounds disagree on
    the cause (not only on the sign) and about how many rounds would settle it."""
    before = [write_steps(tmp_path / f"b{i}", [(1.0, 1.0)] * 3, load=QUIET) for i in range(4)]
    after = [write_steps(tmp_path / f"a{i}", [f] * 3)
             for i, f in enumerate([(3.0, 1.2), (1.6, 1.5), (2.9, 1.22), (1.7, 1.48)])]
    s = explain_slowdown(before, after)
    adds_up(s)
    assert (s.unit, s.units, s.rounds) == ("round", 4, 4)
    assert s.named == ["machine", "compute"]
    ag = s.agreement
    assert ag.tops == {"compute": 2, "machine": 2} and (ag.first, ag.second) == ("machine", "compute")
    assert not ag.settled and ag.needed > 4
    # the rounds needed: the lead would exceed NOISE_Z standard errors of its per-round spread
    from statistics import mean, stdev

    from labkit.timeline.slowdown import NOISE_Z

    diffs = [m - c for m, c in zip(s.changes["excess"], s.changes["compute"])]
    assert ag.needed == pytest.approx((NOISE_Z * stdev(diffs) / mean(diffs)) ** 2, abs=1)
    text = s.text()
    assert "every round agrees on its sign." in text
    assert (f"The rounds disagree on which cause grew most (your code in 2 of 4, the machine in 2): the machine "
            f"leads your code by only") in text
    assert f"about {ag.needed} rounds would settle it ({ag.needed - 4} more)." in text
    assert "both: the machine (+" in text and "and your code: stage 1's forwards take" in text
    # rounds that agree on the cause say so by saying nothing of it
    agree = explain_slowdown(before, [write_steps(tmp_path / f"c{i}", [(3.0, 1.05)] * 3) for i in range(4)])
    assert agree.agreement.second is None and "disagree" not in agree.text()


def test_a_change_within_its_noise_is_not_named(tmp_path):
    """The steps' changes scatter around zero: no cause is named, and the text says so with the noise."""
    before = write_steps(tmp_path / "a", [(1.0, 1.0)] * 4, load=QUIET)
    after = write_steps(tmp_path / "b", [(1.3, 1.0), (0.7, 1.0), (1.35, 1.0), (0.7, 1.0)])
    s = explain_slowdown(before, after)
    assert s.named == [] and s.stages == []
    assert "no cause changed beyond its noise (the most: " in s.text()
    assert "the steps disagree on its sign: measure more before acting on it." in s.text()


class _Cells(CellReadings):
    """pool.compare's readings without a pool: cells/<NNN>/spans of a run directory."""

    def __init__(self, run_dir):
        self.run_dir, self.last_cell = run_dir, None


def test_one_rule_everywhere_and_a_busy_baseline_is_no_bare_verdict(tmp_path, capsys):
    """explain_slowdown, pool.compare and `labkit timeline --compare` on the same two measurements give
    the same verdict, word for word; measured on a busy baseline, it says so, and what it rests on."""
    cells = tmp_path / "ranks" / "cells"
    write_steps(cells / "001", [(1.0, 1.0)] * 4, load=BUSY)
    write_steps(cells / "002", [(2.7, 1.5), (2.8, 1.45), (2.6, 1.55), (2.7, 1.5)], load=BUSY)
    direct = explain_slowdown(cells / "001", cells / "002")
    pooled = _Cells(tmp_path / "ranks").compare(1, 2)
    assert main(["timeline", "--compare", str(cells / "001"), str(cells / "002")]) == 0
    printed = capsys.readouterr().out
    assert direct.text() == pooled.text() == printed.splitlines()[0]
    assert direct.named == pooled.named == ["machine", "compute"]
    assert printed.startswith(direct.report())
    from labkit.spans import quiet_baseline, timeline_from_spans

    quiet = quiet_baseline([timeline_from_spans(cells / "001")], cores=2)
    assert not quiet.ok and direct.baseline == quiet  # the kit's one rule, read from the same steps
    text = direct.text()
    assert text.startswith("The step takes") and " on a busy baseline: both: the machine (+" in text
    assert (f"Not a quiet baseline ({quiet.figures()}): by the kit's rule (labkit.spans.quiet) something else kept "
            f"the machine busy, so the step's times are not compared as such; the verdict rests on what the ranks "
            f"measured") in text
    # rounds through pool.compare: the same function, the same words as explain_slowdown's
    write_steps(cells / "003", [(1.0, 1.0)] * 4, load=BUSY)
    write_steps(cells / "004", [(2.6, 1.5)] * 4, load=BUSY)
    assert _Cells(tmp_path / "ranks").compare([1, 3], [2, 4]).text() == \
        explain_slowdown([cells / "001", cells / "003"], [cells / "002", cells / "004"]).text()
    # without scheduler clocks, how busy the machine was is said to be unmeasured, never silently skipped;
    # with clocks but no load at the steps' ends, the quiet rule cannot be read: said too
    assert "How busy the machine was is not measured (no scheduler clocks)" in \
        explain_slowdown(timeline(), timeline(slow=1.6)).text()
    unread = explain_slowdown(write_steps(tmp_path / "a", [(1.0, 1.0)] * 2),
                              write_steps(tmp_path / "b", [(2.7, 1.5)] * 2))
    assert unread.baseline is None and "Whether the baseline was quiet cannot be told" in unread.text()


def test_a_stage_that_grew_is_named_when_the_step_got_faster(tmp_path):
    """Before beside busy loops (every action 1.8x, the extra without a CPU), after on a quieter machine
    with stage 1's forwards twice as long: the step got faster (the machine), and the stage that grew is
    named too, never hidden behind the faster step."""
    before = write_steps(tmp_path / "busy", [(1.0, 1.8), (1.0, 1.75), (1.0, 1.85)], load=BUSY)
    after = write_steps(tmp_path / "heavier", [(2.0, 1.0), (2.05, 1.0), (1.95, 1.0)])
    s = explain_slowdown(before, after)
    adds_up(s)
    assert s.after < s.before and s.named == ["machine"] and s.against == ["compute"]
    text = s.text()
    assert "the machine, not your code" in text
    assert "; but what grew: your code: stage 1's forwards take 2.0x as long (+" in text


def test_a_small_settled_cause_is_not_headlined_over_a_large_unsettled_one():
    """As a full run's serial pass read it (torch 2.11, 3 rounds beside busy loops): the machine grew most
    (+10.2 ms) but scattered over the rounds (+-14.3 ms), while 'waiting' (+0.43 ms) and communication
    (+0.5 ms) grew steadily. The steady small causes did not make the step slower: they are not headlined
    over the machine, and `main` is the machine, within its noise (the headline named 'waiting')."""
    from labkit.timeline.slowdown import Slowdown

    ms = 1e-3
    rounds = {"step": [2.0, 1.5, 31.6], "machine": [1.0, 0.6, 29.1], "excess": [0.9, 0.5, 28.9],
              "compute": [0.5, -0.2, 1.25], "waiting": [0.40, 0.45, 0.435], "communication": [0.2, 0.9, 0.42],
              "kit": [0.01, 0.01, 0.02]}
    s = Slowdown(before=15.1 * ms, after=26.8 * ms,
                 causes={"machine": (2.5 * ms, 12.75 * ms), "compute": (9.06 * ms, 9.57 * ms),
                         "waiting": (1.83 * ms, 2.26 * ms), "communication": (1.59 * ms, 2.09 * ms),
                         "kit": (0.15 * ms, 0.165 * ms)},
                 by_stage={}, machine_in_actions=(1.0 * ms, 5.0 * ms), rounds=3,
                 changes={c: [v * ms for v in vs] for c, vs in rounds.items()},
                 spread={c: (min(vs) * ms, max(vs) * ms) for c, vs in rounds.items()})
    assert s.machine_excess > 1 * ms and s.noise("machine") > s.machine_excess  # the largest, and unsettled
    assert s.main == "machine" and s.named == [], (s.named, s.main)
    assert "1.77x): no cause changed beyond its noise (the most: the machine, " in s.text(), s.text()


# ---- issue 63 item 6: one rule, really; the steps that compiled apart --------------------------------------

def write_clocked(folder, factors, between: float = 0.0, kit: float = 0.0, load=QUIET, compiled=None, first=()):
    """A cell's (or run's) spans with every clock the ranks record: one 1F1B step per (slow, scale, share) of
    `factors` (`varied`'s, each action's `share` without a CPU), a wait for a receive before each action but
    the step's first (`between` of it without a CPU), the kit's own `kit` seconds before and after each
    action, the load at each step's end, and dynamo's counts on the `begin_step` line of the steps in
    `compiled` ({step: counts}: torch.compile compiled in that step), and `"first": true` on those of the steps
    in `first` (its schedule's first step in the process: a warm-up)."""
    acts = varied([(slow, scale) for slow, scale, _ in factors])
    (folder / "spans").mkdir(parents=True)
    for rank in sorted({a.rank for _, a in acts}):
        level, lines = 0.0, [{"meta": {"rank": rank, "clock": "host (time.time)"}}]
        for k, (_, _, share) in enumerate(factors):
            mine = sorted((a for kk, a in acts if a.rank == rank and kk == k), key=lambda a: a.start)
            lines.append({"begin_step": k, "schedule": "Schedule1F1B",
                          **({"compile": compiled[k]} if compiled and k in compiled else {}),
                          **({"first": True} if k in first else {})})
            free, queued = mine[0].start, 0.0
            for a in mine:
                if a.start > free:
                    q = between * (a.start - free)
                    lines.append({"rank": rank, "step": k, "kind": "WAIT", "stage": -1, "mb": -1, "what": "recv",
                                  "start": free, "end": a.start, "rq": [level, level + q]})
                    level, queued = level + q, queued + q
                q = share * a.duration
                lines.append({"rank": rank, "step": k, "kind": a.kind, "stage": a.stage, "mb": a.microbatch,
                              "start": a.start, "end": a.end, "pre": kit, "post": kit, "rq": [level, level + q]})
                level, queued, free = level + q, queued + q, a.end
            wall = mine[-1].end - mine[0].start
            lines.append({"end_step": k, "wall": wall, "kit": 2 * kit * len(mine), "wrappers": 2 * kit * len(mine),
                          "bookkeeping": 0.0, "calls": len(mine), "cpu": wall - queued, "queued": queued,
                          "cores": 2, "runnable": load[0], "load1": load[1]})
        (folder / "spans" / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


def test_cells_timelines_run_directories_and_the_cli_give_one_text(tmp_path, capsys):
    """As a user read it beside busy loops: pool.compare(a, b) named the machine alone (+54 ms), while
    explain_slowdown on pool.timeline(a) and pool.timeline(b) read a smaller machine (+29 ms) and the transfers
    between ranks: the Timeline had dropped the run-queue time between actions and the kit's own time. A
    Timeline now carries every clock its cell had: the same steps give the same text, word for word, whether
    given as cells, cell or run directories, Timelines (one step of one, a pipeline of one) or on the command
    line, two measurements or rounds of them."""
    cells = tmp_path / "ranks" / "cells"
    quiet = [(1.0, 1.0, 0.05), (1.0, 1.02, 0.06), (1.0, 0.98, 0.05), (1.0, 1.0, 0.04)]
    busy = [(1.0, scale, 1 - 1 / scale) for scale in (1.6, 1.7, 1.55, 1.65)]  # the extra all without a CPU
    for n, (factors, between, load) in enumerate([(quiet, 0.05, QUIET), (busy, 0.6, BUSY)] * 2, start=1):
        write_clocked(cells / f"{n:03d}", factors, between=between, kit=0.02 * MS, load=load)
    pool = _Cells(tmp_path / "ranks")
    for before, after in ((1, 2), ([1, 3], [2, 4])):
        by_cells = pool.compare(before, after)
        dirs = [[cells / f"{c:03d}" for c in x] if isinstance(x, list) else cells / f"{x:03d}" for x in (before, after)]
        timelines = [[pool.timeline(c) for c in x] if isinstance(x, list) else pool.timeline(x)
                     for x in (before, after)]
        by_timelines = explain_slowdown(*timelines)
        assert by_timelines.text() == by_cells.text() == explain_slowdown(*dirs).text()
        assert by_timelines.report() == by_cells.report()
        assert "machine" in by_cells.named and not any("pass its run directory" in n for n in by_timelines.notes)
        assert by_timelines.causes["kit"] == by_cells.causes["kit"] and by_cells.causes["kit"][0] > 0
    assert main(["timeline", "--compare", str(cells / "001"), str(cells / "002")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == pool.compare(1, 2).text()
    # one step of a Timeline, and one pipeline of it, are read from that step's and those ranks' clocks
    from labkit.timeline.compare import one_step

    last = [one_step(pool.timeline(c)) for c in (1, 2)]
    alone = [write_clocked(tmp_path / f"last{c}", [f[-1]], between=b, kit=0.02 * MS, load=load)
             for c, f, b, load in ((1, quiet, 0.05, QUIET), (2, busy, 0.6, BUSY))]
    assert explain_slowdown(*last).text() == explain_slowdown(*alone).text()
    split = [pool.timeline(c).split_pipelines()[0] for c in (1, 2)]
    assert explain_slowdown(*split).text() == pool.compare(1, 2).text()
    # a Timeline that lost its recording (made anew from its actions) is read from its actions, and says so
    bare = [Timeline(tl.actions, tl.source, tl.meta) for tl in timelines[0]]
    assert any("pass its run directory" in n for n in explain_slowdown(*bare).notes)


COMPILED = {"frames": 1, "graphs": 1, "graph_breaks": 0, "recompiles": 0, "fell_back": 0, "at_limit": 0}


def test_steps_that_compiled_are_left_out_and_named_apart(tmp_path, capsys):
    """As a user compared an eager run and a compiled one: the compiled run's first step compiled (12x as
    long, stage 1's backwards longest), its warm steps as fast as the eager ones. The comparison leaves the
    step that compiled out, says so ("after's step 1 compiled for ..."), and compares the warm steps: no
    stage took longer. The same text from the run directories, their Timelines and the command line."""
    eager = write_clocked(tmp_path / "eager", [(1.0, 1.0, 0.0), (1.0, 1.01, 0.0), (1.0, 0.99, 0.0), (1.0, 1.0, 0.0)])
    comp = write_clocked(tmp_path / "compiled", [(1.0, 12.0, 0.0), (1.0, 1.0, 0.0), (1.0, 0.99, 0.0), (1.0, 1.01, 0.0)],
                         compiled={0: COMPILED})
    s = explain_slowdown(eager, comp)
    adds_up(s)
    assert [(x.side, x.step) for x in s.left_out] == [("after", 1)]
    assert s.left_out[0].seconds == pytest.approx(12 * s.before, rel=0.05)
    assert s.units == 3 and s.after == pytest.approx(s.before, rel=0.02) and s.stages == []
    text = s.text()
    assert " after's step 1 compiled for " in text and "the warm steps are compared" in text
    assert "take" not in text.split(":")[1]  # no stage named for what the compile took
    assert explain_slowdown(timeline_from_spans(eager), timeline_from_spans(comp)).text() == text
    assert main(["timeline", "--compare", str(eager), str(comp)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == text
    # both sides' first steps compiled: both named, in order; a step of rounds names its round
    both = explain_slowdown(write_clocked(tmp_path / "c2", [(1.0, 9.0, 0.0)] + [(1.0, 1.0, 0.0)] * 3,
                                          compiled={0: COMPILED}), comp)
    assert [(x.side, x.step) for x in both.left_out] == [("before", 1), ("after", 1)]
    assert "before's step 1 compiled for " in both.text() and "after's step 1 compiled for " in both.text()
    rounds = explain_slowdown([eager, eager], [comp, eager])
    assert [(x.side, x.round, x.step) for x in rounds.left_out] == [("after", 1, 1)]
    assert "after's round 1, step 1 compiled for " in rounds.text()
    # a measurement whose every step compiled has no warm step: compared as it is, and said
    once = explain_slowdown(eager, write_clocked(tmp_path / "once", [(1.0, 12.0, 0.0)], compiled={0: COMPILED}))
    assert once.left_out == [] and once.unwarm == ["after"] and "Every step of after compiled" in once.text()


def test_a_schedules_first_step_is_a_warm_up_left_out_and_named_apart(tmp_path, capsys):
    """Issue 63: an eager run's first step warms up (torch's stages infer their shapes and set up their
    transfers, the allocator warms up) and was compared as a step. Marked by the recorder (its schedule's
    first step in the process), it is left out where the measurement has other steps and named apart from a
    step that compiled; the same text from the run directories, their Timelines and the command line. A
    measurement of one step, a warm-up, is compared as it is, and says so."""
    eager = write_clocked(tmp_path / "eager", [(1.0, 9.0, 0.0), (1.0, 1.0, 0.0), (1.0, 1.01, 0.0), (1.0, 0.99, 0.0)],
                          first={0})
    warm = write_clocked(tmp_path / "warm", [(1.0, 1.0, 0.0), (1.0, 0.99, 0.0), (1.0, 1.01, 0.0)])
    s = explain_slowdown(eager, warm)
    adds_up(s)
    assert [(x.side, x.round, x.step, x.why, x.counts) for x in s.left_out] == [("before", None, 1, "warm-up", {})]
    assert s.left_out[0].seconds == pytest.approx(9 * s.after, rel=0.05)
    assert s.units == 3 and s.after == pytest.approx(s.before, rel=0.02) and s.stages == []
    assert s.unwarm == [] and s.cold == []
    text = s.text()
    assert (" Steps that warmed up are left out and the warm steps are compared: before's step 1 warmed up for "
            in text and "(its schedule's first step)." in text and "compiled" not in text)
    assert explain_slowdown(timeline_from_spans(eager), timeline_from_spans(warm)).text() == text
    assert main(["timeline", "--compare", str(eager), str(warm)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == text
    # a first step that also compiled is a step that compiled; the two are named apart, in order
    comp = write_clocked(tmp_path / "compiled", [(1.0, 12.0, 0.0), (1.0, 1.0, 0.0), (1.0, 0.99, 0.0)],
                         compiled={0: COMPILED}, first={0})
    both = explain_slowdown(eager, comp)
    assert [(x.side, x.step, x.why) for x in both.left_out] == [("before", 1, "warm-up"), ("after", 1, "compiled")]
    assert both.left_out[1].counts == {0: COMPILED, 1: COMPILED}
    assert (" Steps that compiled or warmed up are left out and the warm steps are compared: before's step 1 "
            "warmed up for " in both.text() and "; after's step 1 compiled for " in both.text())
    # a measurement of one step, its schedule's first: nothing warm to compare, so compared as it is
    once = explain_slowdown(warm, write_clocked(tmp_path / "once", [(1.0, 9.0, 0.0)], first={0}))
    assert once.left_out == [] and once.cold == ["after"] and once.unwarm == []
    assert "No step of after is warm" in once.text() and once.after == pytest.approx(9 * once.before, rel=0.05)
    assert any(n.startswith("after: its only step warmed up") for n in once.notes), once.notes
