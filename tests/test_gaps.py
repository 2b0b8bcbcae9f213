"""labkit.logs.gaps on real +pp logs: every idle moment gets exactly one cause."""

from pathlib import Path

import pytest

from labkit.logs import CAUSES, explain_idle, parse_run_dir, to_timeline

FIXTURES = Path(__file__).parent / "fixtures" / "pplogs"
ONE_STEP = sorted(d for d in FIXTURES.glob("*/*") if (d / "logs").is_dir() and "-" in d.name
                  and not d.name.startswith(("steps2_", "default_")))


@pytest.mark.parametrize("run", ONE_STEP, ids=[f"{d.parent.name}/{d.name}" for d in ONE_STEP])
def test_the_causes_partition_the_bubble(run):
    events = parse_run_dir(run)
    tl = to_timeline(events, waits="split")
    report = explain_idle(events)
    assert report.total() == pytest.approx(tl.metrics()["bubble_fraction"], abs=1e-9)
    m = tl.metrics()
    for rank, causes in report.idle.items():
        assert set(causes) == set(CAUSES) and all(v >= -1e-12 for v in causes.values()), causes
        assert sum(causes.values()) == pytest.approx(m["idle"][str(rank)], abs=1e-9)


def test_gpipe_waits_are_fill_drain_and_neighbours():
    run = FIXTURES / "2.13.0" / "GPipe-p2-m4"
    report = explain_idle(parse_run_dir(run), cores=2, ranks_per_machine=4)
    # GPipe on 2 ranks: rank 1 starts after rank 0's first forward and ends before its last backward
    # (fill / drain); rank 0 waits between its forwards and backwards for rank 1's gradients
    assert report.share(0, "fill / drain") == 0 and report.share(1, "fill / drain") > 0.2
    assert report.share(0, "waiting for a neighbour") > 0.05 and report.share(1, "waiting for a neighbour") == 0
    text = report.text()
    assert "waiting for a neighbour" in text and "4 ranks shared 2 cores" in text and "ms per gap" in text


def test_the_tutorials_own_run_as_notebook_06_reads_it():
    """tests/fixtures/tutorial_run: the official tutorial's program, one step on 2 CPU ranks."""
    from labkit.logs import parse_files
    from labkit.theory import closed_form_bubble

    events = parse_files(sorted((FIXTURES.parent / "tutorial_run").glob("rank*.log")))
    tl = to_timeline(events, waits="split")
    assert tl.counts() == {(s, k): 4 for s in (0, 1) for k in ("F", "B")}
    report = explain_idle(events)
    assert report.total() == pytest.approx(tl.metrics()["bubble_fraction"]) and report.total() > closed_form_bubble(2, 4) + 0.05
    assert report.share(1, "fill / drain") > 0.25 and report.share(0, "waiting for a neighbour") > 0.2
    forwards = [a.duration for a in sorted(tl.compute(), key=lambda a: a.start) if a.rank == 0 and a.kind == "F"]
    assert forwards[0] > 2 * max(forwards[1:])


def test_idle_gaps_is_the_one_walk_both_readings_share():
    """The gaps between a rank's actions: an action inside another leaves none, the latest-ending one
    opens the next gap, and its idle time is the makespan less the busy union (`union_length`)."""
    from labkit.core.actions import Action, union_length
    from labkit.logs.gaps import idle_gaps
    from labkit.spans import idle

    acts = [Action(0, 0, 0, "F", 0.0, 4.0), Action(0, 0, 1, "F", 1.0, 2.0), Action(0, 0, 0, "B", 5.0, 6.0),
            Action(0, 0, 1, "B", 8.0, 9.0)]
    gaps = list(idle_gaps(reversed(acts)))
    assert [(g0, g1, a.kind + str(a.microbatch), b.kind + str(b.microbatch)) for g0, g1, a, b in gaps] == [
        (4.0, 5.0, "F0", "B0"), (6.0, 8.0, "B0", "B1")]
    assert sum(g1 - g0 for g0, g1, _, _ in gaps) == 9.0 - union_length([(a.start, a.end) for a in acts])
    assert list(idle_gaps([])) == [] and idle.idle_gaps is idle_gaps
