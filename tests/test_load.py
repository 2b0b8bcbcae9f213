"""A busy machine on the timeline (labkit.spans: scheduler clocks on every span, the load at each
step's end; labkit.spans.idle: the cause "descheduled: the machine was busy").

Stated bound: with one busy loop per core beside a 2-rank 1F1B step, the ranks' descheduled share
(run-queue time between and inside actions, over ten steps; medians of five alternating rounds)
exceeds the same steps' without them by at least 2 points. Measured here (2 cores, torch 2.15, nothing
else running), per round of ten steps: 5-14% without, 25-30% with; the last step of three alone, as
this test read it before, varied 1-23% without (it failed once: medians 18% against 19%). Without a
quiet baseline (the steps descheduled for over 25% without the loops, more runnable threads at the
steps' ends than cores + 1, or a load average over 2 per core + 2: other work on the machine) the
comparison means nothing and the test says so and skips."""

import os
import subprocess
import sys
import time

import pytest

from conftest import module_pool
from labkit.spans.idle import CPU_CAUSES, DESCHEDULED, SPAN_CAUSES, explain_idle_spans
from labkit.spans.quiet import Quiet, quiet_baseline
from labkit.spans.read import Span, machine_load, makespan_without_load, read_spans, without_descheduling
from labkit.core.actions import Action, Timeline


def test_run_queue_time_between_actions_is_its_own_cause():
    """Rank 0: F 0-1 (0.2 s of it queued), a gap 1.0-1.8 with a recv wait 1.1-1.5 and 0.25 s queued,
    B 1.8-3.0. Rank 1 never queued. The causes still add up to the idle time exactly."""
    s = [Span(0, 0, "F", 0, 0, 0.0, 1.0, cpu=(0.0, 0.8), rq=(0.0, 0.2)),
         Span(0, 0, "WAIT", -1, -1, 1.1, 1.5, "recv", cpu=(0.85, 0.85), rq=(0.3, 0.3)),
         Span(0, 0, "B", 0, 0, 1.8, 3.0, cpu=(0.9, 2.1), rq=(0.45, 0.45)),
         Span(1, 0, "F", 1, 0, 1.2, 2.0, cpu=(0.0, 0.8), rq=(0.0, 0.0)),
         Span(1, 0, "B", 1, 0, 2.0, 3.3, cpu=(0.8, 2.1), rq=(0.0, 0.0))]
    rep = explain_idle_spans(s, "all")
    assert rep.causes == CPU_CAUSES
    c0 = rep.idle[0]
    assert c0["waiting for a neighbour"] == pytest.approx(0.4)
    assert c0[DESCHEDULED] == pytest.approx(0.25) and c0["runtime overhead"] == pytest.approx(0.8 - 0.4 - 0.25)
    assert sum(c0.values()) == pytest.approx(3.3 - 2.2)
    assert rep.descheduled_in_actions == {0: pytest.approx(0.2), 1: 0.0}
    assert rep.descheduled(0) == pytest.approx((0.25 + 0.2) / 3.3)
    assert "descheduled inside actions" in rep.text() and DESCHEDULED in rep.text()
    # spans recorded without scheduler clocks keep the causes they always had
    plain = [sp._replace(cpu=(), rq=()) for sp in s]
    assert explain_idle_spans(plain, "all").causes == SPAN_CAUSES
    # the queued time is capped by the runtime's share: never more than the gap leaves
    greedy = [sp._replace(rq=(0.0, 0.0)) if sp.kind == "F" else sp._replace(rq=(5.0, 5.0)) for sp in s if sp.rank == 0]
    g = explain_idle_spans(greedy, "all").idle[0]
    assert g[DESCHEDULED] == pytest.approx(0.8 - 0.4) and g["runtime overhead"] == pytest.approx(0.0)


def test_the_fit_can_leave_descheduling_out():
    tl = Timeline([Action(0, 0, 0, "F", 0.0, 1.0), Action(0, 0, 0, "SEND", 1.0, 1.1)], source="spans",
                  meta={"queued_s": {"0:0:F:0:0.0": 0.25}})
    out = without_descheduling(tl)
    assert [a.duration for a in out.actions] == [pytest.approx(0.75), pytest.approx(0.1)]
    assert machine_load([], {}) == {}


def test_a_steps_makespan_can_leave_the_machines_load_out():
    """The makespan less the longest wait for a CPU of one rank in the step; without clocks, the makespan."""
    acts = [Action(0, 0, 0, "F", 0.0, 1.0), Action(1, 1, 0, "F", 1.2, 2.5)]
    load = {"0": {"descheduled_in_steps_s": 0.1}, "1": {"descheduled_in_steps_s": 0.3}}
    assert makespan_without_load(Timeline(acts, source="spans", meta={"machine_load": load})) == pytest.approx(2.2)
    assert makespan_without_load(Timeline(acts, source="spans")) == pytest.approx(2.5)


SETUP = """
import torch, torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
torch.manual_seed(0)
_full = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)])
_stage = PipelineStage(_full[rank * 4:(rank + 1) * 4], rank, world_size, torch.device("cpu"))
_sched = Schedule1F1B(_stage, n_microbatches=8, loss_fn=lambda o, t: ((o - t) ** 2).mean())
_x, _y = torch.randn(64, 256), torch.randn(64, 256)
def _step():
    if rank == 0:
        _sched.step(_x)
    else:
        _sched.step(target=_y, losses=[])
"""

pool = module_pool(2, SETUP)
LOOPS_PER_CORE = 1  # issue 42's "one busy loop per core"
STEPS, ROUNDS = 10, 5  # one step is ~20 ms: a timer tick or a kernel thread moves its share by points


def until_quiet(measured, attempts: int = 3, settle_s: float = 10.0):
    """`measured()` -> (readings, Quiet), measured again after `settle_s` while its baseline is not quiet, up
    to `attempts` times; the last. A serial test runs right after the parallel pass of every leg, and there
    the machine was still busy (CI: the quiet rounds descheduled 29-30% on both legs, 6-20% alone here)."""
    for attempt in range(attempts):
        readings, baseline = measured()
        if baseline.ok or attempt + 1 == attempts:
            return readings, baseline
        print(f"not quiet yet ({baseline.figures()}): measured again in {settle_s:g} s")
        time.sleep(settle_s)


def _measure(pool, loops: int):
    # each loop in its own session, as another program is: Linux's autogroup shares the CPU between
    # sessions first, and loops started in pytest's one session weighed as one program (every rank is in
    # its own, torchrun's): beside them a rank lost 0.23 of its step, as without them (CI, 3 rounds of 5)
    busy = [subprocess.Popen([sys.executable, "-c", "print(flush=True)\nwhile True: pass"], stdout=subprocess.PIPE,
                             start_new_session=True)
            for _ in range(loops)]
    try:
        for p in busy:  # each loop runs before the steps start (a busy machine starts a Python slowly)
            p.stdout.readline()
        pool.exec(f"for _ in range({STEPS}): _step()")
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return pool.idle(which="all"), pool.timeline()


# A rank's rival for its core: a busy loop the rank starts (so it shares the rank's session, Linux's scheduling
# group) at nice 0, stopped until a busy round, then the rank and its threads lowered to nice 5, both pinned to
# the rank's core. Equal-priority loops, left to the scheduler, descheduled the ranks in some rounds and not
# in others: the kernel hands a waking rank the CPU ahead of a loop that never sleeps, and its balancer can
# keep the loops on a core of their own (CI: medians of 5 rounds 0.14 beside one loop a core, 0.20 without;
# here, 2 runs in 14 failed with two loops a core, and pinned at one a core the share did not move).
RIVAL = """
import os, signal, subprocess, sys
_core = sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]
_rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])
os.kill(_rival.pid, signal.SIGSTOP)
for _t in [_rival.pid] + [int(t) for t in os.listdir("/proc/self/task")]:
    os.sched_setaffinity(_t, {_core})
for _t in os.listdir("/proc/self/task"):
    os.setpriority(os.PRIO_PROCESS, int(_t), 5)
def _rivalled(on):
    os.kill(_rival.pid, signal.SIGCONT if on else signal.SIGSTOP)
"""


@pytest.fixture(scope="module")
def rivalled():
    """A pool of its own (its ranks are reniced and pinned: never the suite's shared pool), each rank with
    a stopped rival on its core (RIVAL); the rivals killed and the pool closed after."""
    import tempfile

    from labkit.ranks import Ranks

    with tempfile.TemporaryDirectory() as tmp, Ranks(nproc=2, device="cpu", runs_root=tmp, live=None) as p:
        p.exec(SETUP + RIVAL)
        try:
            yield p
        finally:
            p.exec("_rival.kill(); _rival.wait()")


@pytest.mark.launches
@pytest.mark.serial  # its quiet rounds need a quiet machine: alone, after the parallel pass
def test_a_busy_machine_shows_as_descheduled_time(rivalled):
    """Five rounds, each ten steps alone and ten with each rank's rival running on its core (alternating,
    so that what else the machine runs weighs on both alike); the medians compared."""
    import statistics

    def measure(on: bool):
        rivalled.exec(f"_rivalled({on})\ntry:\n    for _ in range({STEPS}): _step()\nfinally:\n    _rivalled(False)")
        return rivalled.idle(which="all"), rivalled.timeline()

    cores = os.cpu_count() or 1

    def measured():
        rounds = [(measure(False), measure(True)) for _ in range(ROUNDS)]
        q = statistics.median(r[0][0].descheduled() for r in rounds)
        others = statistics.median(max(v["load1"] for v in r[0][0].load.values()) for r in rounds)
        runnable = statistics.median(n for r in rounds for v in r[0][1].meta["machine_load"].values()
                                     for n in v["runnable"] if n is not None)
        return rounds, Quiet(runnable, others, q, cores)

    rounds, baseline = until_quiet(measured)
    (quiet, tl), (busy, _) = rounds[-1]
    print("alone:\n" + quiet.text() + "\nbeside the rivals:\n" + busy.text())
    assert quiet.causes == busy.causes == CPU_CAUSES
    q, others, runnable = baseline.descheduled, baseline.load1, baseline.runnable
    b = statistics.median(r[1][0].descheduled() for r in rounds)
    print(f"quiet steps: descheduled {q:.1%}, load average {others}, {runnable:g} runnable at their ends; "
          f"beside the rivals: descheduled {b:.1%}")
    if not baseline.ok:  # labkit.spans.quiet: the kit's one quiet-baseline rule
        pytest.skip(f"no quiet baseline: without the rivals the ranks were descheduled for {q:.0%} of the "
                    f"step (load average {others}, {runnable:g} runnable at the steps' ends, on {cores} cores): "
                    "something else is keeping the machine busy")
    assert b > q + 0.02, ([r[0][0].descheduled() for r in rounds], [r[1][0].descheduled() for r in rounds])
    assert all(v["runnable"] >= 1 and v["cores"] == os.cpu_count() and 0 < v["share"] <= 1.05
               for v in busy.load.values()), busy.load
    # the timeline carries it per rank (labkit timeline --json), and a fit can leave it out
    load = tl.meta["machine_load"]
    assert sorted(load) == ["0", "1"] and all(v["descheduled_in_actions_s"] >= 0 for v in load.values())
    assert sum(a.duration for a in without_descheduling(tl).compute()) <= sum(a.duration for a in tl.compute())


def test_the_causes_plot_draws_each_report():
    from matplotlib.figure import Figure

    from labkit.timeline.plot import plot_idle_causes

    s = [Span(0, 0, "F", 0, 0, 0.0, 1.0, cpu=(0.0, 0.8), rq=(0.0, 0.2)),
         Span(0, 0, "B", 0, 0, 1.8, 3.0, cpu=(0.9, 2.1), rq=(0.45, 0.45))]
    rep = explain_idle_spans(s, "all")
    ax = Figure().subplots()
    artists = plot_idle_causes(ax, {"busy": rep, "again": rep}, title="where the step went")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["busy", "again"]
    assert any(getattr(c, "get_label", lambda: "")() == DESCHEDULED for c in ax.containers) and artists


def test_the_quiet_rule_reads_the_spans_load():
    """labkit.spans.quiet: medians of the runnable count, the load average and the descheduled share."""
    def tl(runnable, load1, queued):
        return Timeline([], meta={"machine_load": {"0": {"runnable": runnable, "load1": load1, "step_s": 1.0,
                                                         "descheduled_in_steps_s": queued}}})

    assert quiet_baseline([tl([2, 3], [1.0, 1.5], 0.1)], cores=2).ok
    assert not quiet_baseline([tl([5, 5], [1.0], 0.1)], cores=2).ok        # more runnable than cores + 1
    assert not quiet_baseline([tl([2], [7.0], 0.1)], cores=2).ok           # load average over 2 per core + 2
    assert not quiet_baseline([tl([2], [1.0], 0.3)], cores=2).ok           # a third of the step descheduled
    blind = quiet_baseline([Timeline([], meta={})], cores=2)                 # no scheduler clocks: no reading
    assert not blind.ok and "not compared" in blind.text()


@pytest.mark.launches
def test_compare_names_a_heavier_stage_as_the_code(pool):
    """pool.compare (labkit.timeline.explain_slowdown) on two live cells of the same schedule: stage 1
    made heavier (a 512 x 512 matmul after its first layer, as notebook 06b's; a 256 one added +6-7 ms, which
    the ranks' own descheduling of the quiet steps, 20-26% of ~20 ms, outweighed in 3 of 8 runs alone: the step
    got faster) is named, compute its main cause."""
    pool.exec("_heavy = lambda m, a, o: o + 0 * (torch.randn(512, 512) @ torch.randn(512, 512)).sum()")
    steps = f"for _ in range({STEPS}): _step()"
    heavier = f"_extra = _stage.submod[0].register_forward_hook(_heavy) if rank == 1 else None\n{steps}\n" \
              "_extra.remove() if _extra is not None else None"
    before, after = pool.rounds(steps, heavier, n=2)  # A B, B A: labkit.ranks.readings.rounds
    assert len(before) == len(after) == 2 and before[0] < after[0] and after[1] < before[1]
    why = pool.compare(before, after)
    quiet = quiet_baseline([pool.timeline(c) for c in before])
    print(why.text(), quiet.text(), sep="\n")
    # compute is each action less the time its rank waited for a CPU: what load cannot move, checked always
    (stage, kind), (b, a) = max(why.by_stage.items(), key=lambda kv: kv[1][1] - kv[1][0])
    assert (stage, kind) == (1, "F") and a > 1.5 * b, why.table()
    # the step's own time and .main move with the machine: judged over a quiet baseline (labkit.spans.quiet)
    assert (why.main == "compute" and "stage 1" in why.text()) or not quiet.ok, why.table()


@pytest.mark.launches
@pytest.mark.serial  # its quiet rounds need a quiet machine: alone, after the parallel pass
def test_compare_names_busy_loops_as_the_machine(pool):
    """Three rounds alternating a quiet cell and a cell beside one busy loop per core: explain_slowdown
    over the rounds names the machine, when the quiet cells had a quiet baseline."""
    cores = os.cpu_count() or 1

    def measured():
        cells = []
        for _ in range(3):
            _measure(pool, 0)
            quiet = pool.last_cell
            _measure(pool, LOOPS_PER_CORE * cores)
            cells.append((quiet, pool.last_cell))
        return cells, quiet_baseline([pool.timeline(q) for q, _ in cells])

    cells, baseline = until_quiet(measured)
    if not baseline.ok:
        pytest.skip(baseline.text())
    why = pool.compare([q for q, _ in cells], [b for _, b in cells])
    print(why.text())
    assert why.main == "machine", why.table()


@pytest.mark.launches
def test_one_text_from_cells_their_timelines_and_the_command_line_beside_busy_loops(pool, capsys):
    """Issue 63: beside busy loops, pool.compare(a, b) and explain_slowdown on pool.timeline(a) and
    pool.timeline(b) gave different texts in 3 of 3 round sets (the Timeline dropped the run queue between
    actions and the kit's own time: the machine read +29 ms and the transfers +24 ms, against +54 ms alone).
    Now one text, word for word, from the cells, their Timelines, their directories and `labkit timeline
    --compare`, for two cells and for rounds of them. What the machine did is not asserted: the texts' equality
    holds whatever it did."""
    from labkit.cli import main
    from labkit.timeline import explain_slowdown

    cores = os.cpu_count() or 1
    quiet, busy = [], []
    for _ in range(2):
        _measure(pool, 0)
        quiet.append(pool.last_cell)
        _measure(pool, LOOPS_PER_CORE * cores)
        busy.append(pool.last_cell)

    def each(x, read):
        return [read(c) for c in x] if isinstance(x, list) else read(x)

    for before, after in ((quiet[0], busy[0]), (quiet, busy)):
        why = pool.compare(before, after)
        print(why.text())
        assert explain_slowdown(each(before, pool.timeline), each(after, pool.timeline)).text() == why.text()
        assert explain_slowdown(each(before, pool.cell_dir), each(after, pool.cell_dir)).text() == why.text()
        assert why.causes["machine"][0] is not None and why.causes["kit"][0] is not None  # every clock read
    capsys.readouterr()
    assert main(["timeline", "--compare", str(pool.cell_dir(quiet[0])), str(pool.cell_dir(busy[0]))]) == 0
    assert capsys.readouterr().out.splitlines()[0] == pool.compare(quiet[0], busy[0]).text()


COMPILED_STAGE = """
torch._dynamo.reset()
_cstage = PipelineStage(torch.compile(_full[rank * 4:(rank + 1) * 4], backend="eager"), rank, world_size,
                        torch.device("cpu"))
_csched = Schedule1F1B(_cstage, n_microbatches=8, loss_fn=lambda o, t: ((o - t) ** 2).mean())
def _cstep():
    if rank == 0:
        _csched.step(_x)
    else:
        _csched.step(target=_y, losses=[])
"""


@pytest.mark.launches
def test_an_eager_cell_against_a_compiled_one_leaves_the_step_that_compiled_out(pool, capsys):
    """Issue 63: `labkit timeline --compare EAGER COMPILED` read 12x and 'stage 1's backwards take 1.8x as long'
    where the compiled run's first step compiled and its warm steps were as fast. The same stages compiled
    (dynamo, backend="eager") in a cell of 4 steps against an eager cell: its first step, which compiled on
    both ranks, is left out and named apart; the 3 warm steps are compared; one text from the cells, their
    Timelines and the command line. No timing is asserted."""
    from labkit.cli import main
    from labkit.timeline import explain_slowdown

    pool.exec(COMPILED_STAGE)
    try:
        pool.exec("_step()")  # _sched's first step in these ranks (a warm-up) is not the eager cell's, in any order
        pool.exec("for _ in range(4): _step()")
        eager = pool.last_cell
        pool.exec("for _ in range(4): _cstep()")
        compiled = pool.last_cell
    finally:
        pool.exec("torch._dynamo.reset()")
    why = pool.compare(eager, compiled)
    print(why.report())
    assert [(x.side, x.round, x.step) for x in why.left_out] == [("after", None, 1)]
    assert sorted(why.left_out[0].counts) == [0, 1] and all(c["frames"] > 0 for c in why.left_out[0].counts.values())
    assert why.units == 3 and why.unwarm == []
    # _csched's first step was its first in the ranks too (a warm-up): a step that compiled is named so
    spans, meta = read_spans(pool.cell_dir(compiled))
    assert all(m["first"] == [min(s.step for s in spans if s.rank == r)] for r, m in meta.items()), meta
    assert "first" not in read_spans(pool.cell_dir(eager))[1][0] and why.left_out[0].why == "compiled"
    assert " after's step 1 compiled for " in why.text() and "torch.compile on ranks 0 and 1: " in why.text()
    assert explain_slowdown(pool.timeline(eager), pool.timeline(compiled)).text() == why.text()
    capsys.readouterr()
    assert main(["timeline", "--compare", str(pool.cell_dir(eager)), str(pool.cell_dir(compiled))]) == 0
    assert capsys.readouterr().out.splitlines()[0] == why.text()
