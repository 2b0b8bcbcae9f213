"""Spans (labkit.spans): both ends of every action measured in every rank the kit starts.

Stated tolerances: spans vs the profiler's view (the kit's stage annotations) on the same profiled
run, its last (warm) step: +-0.03 bubble fraction, identical action counts. A user's plain script run with `labkit launch`
gets spans with no change to it; time outside any action (a loss function that sleeps) is found as
runtime overhead. On CUDA the ends are device events, read after the step (stand-ins here).
"""

import json
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from labkit.timeline.compare import load_timeline, one_step
from labkit.spans import explain_idle_spans, read_spans, timeline_from_spans
from labkit.spans.quiet import quiet_baseline
from labkit.spans import record as rec_mod
from labkit.spans import numbers as numbers_mod
from labkit.spans import recorder as recorder_mod
from labkit.spans.read import Span

from conftest import labkit_cli


# ---- the recorder, with stand-ins for CUDA ---------------------------------------------------------

class FakeEvent:
    """A CUDA event on a fake device clock: `record()` stamps the device time, `elapsed_time` in ms."""
    device_now = 0.0
    recorded: list["FakeEvent"] = []

    def __init__(self, enable_timing=False):
        assert enable_timing, "span events must be timing events"
        self.t = None

    def record(self, stream=None):
        self.t = FakeEvent.device_now
        FakeEvent.recorded.append(self)

    def elapsed_time(self, other):
        assert FakeEvent.synchronized, "events are read only after a synchronize"
        return (other.t - self.t) * 1e3


def test_on_cuda_the_ends_are_device_events_read_after_the_step(monkeypatch, tmp_path):
    FakeEvent.device_now, FakeEvent.recorded, FakeEvent.synchronized = 0.0, [], False

    def synchronize(device=None):
        FakeEvent.synchronized = True

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    host = iter([1000.0, 5000.0, 9000.0])  # host clock reads: only the step's base may use it
    monkeypatch.setattr(recorder_mod, "_clock", lambda: next(host))  # the clock the Recorder reads
    r = rec_mod.Recorder(tmp_path / "rank0.jsonl", rank=0)
    r.device = types.SimpleNamespace(type="cuda")
    r.begin_step("Schedule1F1B")          # synchronize, host time 1000.0, base event at device 0.0
    FakeEvent.synchronized = False
    FakeEvent.device_now = 0.25
    start = r.now()
    FakeEvent.device_now = 0.75          # the kernels ran on the device until 0.75 s after the base
    end = r.now()
    assert not isinstance(start, float) and not isinstance(end, float), "CUDA spans must not be host times"
    r.add("F", 0, 0, start, end)
    r.end_step()
    rows = [json.loads(x) for x in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert rows[0]["meta"]["clock"].startswith("cuda events")
    span = rows[-1]
    assert (span["kind"], span["start"], span["end"]) == ("F", 1000.25, 1000.75)


def test_the_cpu_clock_is_the_host_clock(tmp_path):
    r = rec_mod.Recorder(tmp_path / "rank3.jsonl", rank=3)
    r.begin_step("ScheduleGPipe")
    a = r.now()
    b = r.now()
    r.add("B", 1, 2, a, b)
    r.end_step()
    spans, meta = read_spans(tmp_path)
    assert spans == [Span(3, 0, "B", 1, 2, pytest.approx(a, abs=1e-6), pytest.approx(b, abs=1e-6), "")]
    assert meta[3]["clock"] == "host (time.time)" and meta[3]["schedules"] == {0: "ScheduleGPipe"}


def test_a_schedules_first_step_in_the_process_is_marked_a_warm_up(monkeypatch, tmp_path):
    """Issue 63: the first step a schedule object runs in a process warms up (its stages infer their shapes
    and set up their transfers): the step wrapper marks it (`"first": true` on its `begin_step` line), once
    per schedule object, a nested step counting once; read back as meta["first"]."""
    class Sched:
        def __init__(self, inner=None):
            self.inner = inner

        def eval(self):  # an action of one span, and a nested schedule's step inside it
            if self.inner is not None:
                self.inner.eval()
            r.add("F", 0, 0, r.now(), r.now())

    Sched.eval = rec_mod._step_wrapper(Sched.eval, grads=False)
    r = rec_mod.Recorder(tmp_path / "rank0.jsonl", rank=0)
    monkeypatch.setattr(rec_mod, "RECORDER", r)
    a, b = Sched(), Sched()
    a.eval(), a.eval(), b.eval(), Sched(inner=a).eval(), b.eval()
    r.flush()  # the last step's lines are written where the rank next idles (here: at once)
    begins = [json.loads(x) for x in (tmp_path / "rank0.jsonl").read_text().splitlines() if "begin_step" in x]
    assert [x.get("first", False) for x in begins] == [True, False, True, True, False]
    _, meta = read_spans(tmp_path)
    assert meta[0]["first"] == [0, 2, 3]


# ---- idle time by cause ------------------------------------------------------------------------------

def test_idle_causes_are_measured_per_gap_and_add_up_to_the_bubble():
    s = [Span(0, 0, "F", 0, 0, 0.0, 1.0), Span(0, 0, "SEND", -1, -1, 1.0, 1.1, "send"),
         Span(0, 0, "WAIT", -1, -1, 1.1, 1.6, "recv"),     # waiting for a neighbour 0.5
         # 1.6 .. 1.8: nothing recorded: runtime overhead 0.2
         Span(0, 0, "B", 0, 0, 1.8, 3.0),
         Span(1, 0, "WAIT", -1, -1, 0.0, 1.2, "recv"), Span(1, 0, "F", 1, 0, 1.2, 2.0),
         Span(1, 0, "B", 1, 0, 2.0, 2.7)]
    rep = explain_idle_spans(s)
    assert rep.source == "spans" and rep.makespan == pytest.approx(3.0)
    c0, c1 = rep.idle[0], rep.idle[1]
    assert c0["waiting for a neighbour"] == pytest.approx(0.5)
    assert c0["sends and receives"] == pytest.approx(0.1)
    assert c0["runtime overhead"] == pytest.approx(0.2)
    assert c0["fill / drain"] == pytest.approx(0.0)
    assert c1["fill / drain"] == pytest.approx(1.2 + 0.3)  # before its first action, after its last
    assert rep.gap_list[0] == [pytest.approx({"start": 1.0, "end": 1.8, "before": "0B0", "waiting for a neighbour": 0.5,
                                              "sends and receives": 0.1, "instrument overhead": 0.0,
                                              "runtime overhead": 0.2})]
    tl_idle = {0: 3.0 - 2.2, 1: 3.0 - 1.5}
    for r in (0, 1):
        assert sum(rep.idle[r].values()) == pytest.approx(tl_idle[r])  # the causes add up to the idle time


def test_time_by_kind_counts_nested_spans_once_per_rank_and_step():
    """What FSDP costs (notebook 12): each kind's covered time in the rank's step; torch 2.15's
    perform_reduce_grad is a REDUCE_GRAD around its own start and wait, which must count once."""
    from labkit.spans.read import time_by_kind

    s = [Span(0, 0, "F", 0, 0, 0.0, 9.0),                                  # an earlier step: not read
         Span(0, 1, "UNSHARD", -1, -1, 10.0, 10.5), Span(0, 1, "F", 0, 0, 10.5, 11.5),
         Span(0, 1, "B", 0, 0, 11.7, 12.7),                                 # 11.5 .. 11.7: between spans
         Span(0, 1, "REDUCE_GRAD", 0, -1, 12.7, 14.0),
         Span(0, 1, "REDUCE_GRAD", 0, -1, 12.8, 13.0), Span(0, 1, "REDUCE_GRAD", 0, -1, 13.1, 13.9),
         Span(1, 1, "F", 1, 0, 10.0, 11.0), Span(1, 1, "WAIT", -1, -1, 11.0, 12.0, "recv")]
    t = time_by_kind(s)  # the last step
    assert set(t) == {0, 1}
    assert t[0].step == pytest.approx(4.0) and t[0].busy == pytest.approx(3.8)
    assert t[0].kinds == pytest.approx({"UNSHARD": 0.5, "F": 1.0, "B": 1.0, "REDUCE_GRAD": 1.3})
    assert t[0].shares()["REDUCE_GRAD"] == pytest.approx(1.3 / 4.0)
    assert sum(t[0].shares().values()) == pytest.approx(t[0].busy / t[0].step)  # no kind inside another here
    assert t[1].kinds == pytest.approx({"F": 1.0, "WAIT": 1.0}) and t[1].step == pytest.approx(2.0)
    assert time_by_kind(s, 0)[0].kinds == {"F": 9.0}


# ---- real jobs ---------------------------------------------------------------------------------------

@pytest.mark.launches
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_spans_and_the_profiler_agree_on_the_same_run(schedule, runs):
    out = runs / schedule
    r = subprocess.run(labkit_cli("run", "--schedule", schedule, "--preset", "tiny", "--microbatches", "4",
                                  "--steps", "3", "--device", "cpu", "--profile", "--out", str(out), "--quiet"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    spans_all, prof_all = load_timeline(out, "spans"), load_timeline(out, "profiler")
    prof_all.meta["steps"] = spans_all.meta["steps"]  # the trace holds the same 3 steps: compare the last (warm) one
    spans, prof = one_step(spans_all), one_step(prof_all)
    assert spans.source == "spans" and load_timeline(out).source == "spans"  # the default where spans exist
    run = types.SimpleNamespace(run_dir=out)
    from labkit.launching.rundir import Run
    assert Run.timeline(run).source == "spans" and Run.idle(run).source == "spans"  # labkit.run(...)'s Run
    assert spans.counts() == prof.counts()
    assert all(a.end > a.start for a in spans.compute())
    b_spans, b_prof = spans.metrics()["bubble_fraction"], prof.metrics()["bubble_fraction"]
    print(f"{schedule}: bubble from spans {b_spans:.3f}, from the profiler {b_prof:.3f}")
    quiet = quiet_baseline([spans_all])  # a bound on two timings of one run: held where the machine was quiet
    assert abs(b_spans - b_prof) <= 0.03 or not quiet.ok, quiet.text()
    j = json.loads(subprocess.run(labkit_cli("timeline", str(out), "--json"), capture_output=True, text=True).stdout)
    assert j["source"] == "spans"
    own = j["meta"]["instrument_overhead"]  # the kit's wrappers, measured in each rank: more than nothing, less than the step
    assert set(own) == {"0", "1"}
    for o in own.values():
        assert o["steps"] == 3 and o["calls"] > 0 and 0 < o["seconds"] < o["step_s"] and 0 < o["share"] < 1, own
    j = json.loads(subprocess.run(labkit_cli("timeline", str(out), "--json", "--source", "logs"),
                                  capture_output=True, text=True).stdout)
    assert j["source"] == "logs" and "inferred" in j["meta"]["starts"]


USER_SCRIPT = """
import os, time
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
stage_mod = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))

def slow_loss(out, target):          # runs on the last rank between its F and its B, outside both
    time.sleep(0.02)
    return nn.functional.mse_loss(out, target)

sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=slow_loss)
x, y = torch.randn(16, 32), torch.randn(16, 32)
for _ in range(2):
    if rank == 0:
        sched.step(x)
    elif rank == world - 1:
        sched.step(target=y)
    else:
        sched.step()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.launches
def test_a_plain_script_gets_spans_and_its_overhead_is_found(runs, tmp_path):
    script = tmp_path / "my_pipeline.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    out = runs / "user"
    r = subprocess.run(labkit_cli("launch", "--nproc", "2", "--out", str(out), "--quiet", str(script)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    tl = timeline_from_spans(out)
    assert tl.meta["schedule"] == "Schedule1F1B" and tl.meta["steps"] == 2
    _, meta = read_spans(out)  # the schedule's first step in each rank is marked a warm-up, its second not
    assert {r: m.get("first") for r, m in meta.items()} == {0: [0], 1: [0]}
    assert tl.counts() == {(s, k): 8 for s in (0, 1) for k in ("F", "B")}  # every action, both steps
    rep = explain_idle_spans(out)  # the last step
    print(rep.text())
    # rank 1 sleeps 20 ms in the loss after each of its 4 forwards: outside every action, not a wait
    assert rep.idle[1]["runtime overhead"] >= 4 * 0.02 * 0.9, rep.idle[1]
    assert rep.idle[0]["waiting for a neighbour"] >= 3 * 0.02 * 0.9       # rank 0 waits for rank 1's gradients
    assert rep.idle[1]["instrument overhead"] > 0, rep.idle[1]  # the kit's wrappers, measured apart
    quiet = quiet_baseline([tl])
    if quiet.ok:  # upper bounds on a timing: only where the machine left the ranks their cores (labkit.spans.quiet)
        assert rep.idle[0]["runtime overhead"] < 0.02, (rep.idle[0], quiet.text())  # rank 0 has no such pause
        # the sleep is the runtime's, not the kit's: the kit's own time is far less
        assert rep.idle[1]["instrument overhead"] < rep.idle[1]["runtime overhead"] / 10, (rep.idle[1], quiet.text())
    for rank, causes in rep.idle.items():
        assert sum(causes.values()) == pytest.approx(rep.makespan - tl_busy(out, rank), abs=1e-6)
    own = tl.meta["instrument_overhead"]
    assert all(0 < own[r]["seconds"] < own[r]["step_s"] and own[r]["steps"] == 2 for r in ("0", "1")), own
    idle = subprocess.run(labkit_cli("timeline", str(out), "--idle"), capture_output=True, text=True)
    assert idle.returncode == 0 and "instrument overhead" in idle.stdout, idle.stdout + idle.stderr


def tl_busy(out, rank):
    tl = one_step(timeline_from_spans(out))
    return tl.metrics()["busy"][str(rank)]


def test_a_span_line_is_what_json_writes_for_it():
    """The recorder writes each span's line by hand (a few microseconds a span fewer): byte for byte what
    json.dumps of its fields gives, for every optional field and odd floats."""
    import random

    rnd = random.Random(0)
    for _ in range(500):
        host = rnd.random() < 0.8
        t = rnd.uniform(0, 2e9)
        pieces = [[rnd.uniform(0, 2e9), rnd.uniform(0, 2e9)] for _ in range(rnd.choice([0, 0, 1, 3]))]
        cpu = rnd.choice([(), ((rnd.random(), None), (rnd.random(), None)),
                          ((rnd.random(), rnd.random() * 1e-3), (rnd.random(), rnd.random()))])
        row = [rnd.choice(["F", "B", "W", "SEND", "WAIT"]), rnd.randint(-1, 7), rnd.choice([-1, 0, 3, 12]), t,
               t + rnd.expovariate(100), rnd.choice(["", "recv", "send", "both", "?"]),
               rnd.choice([0.0, rnd.random() * 1e-5]), rnd.choice([0.0, 1e-9 * rnd.random()]), pieces, cpu]
        kind, stage, mb, s, e, what, pre, post, pieces, cpu = row
        want = {"rank": 3, "step": 11, "kind": kind, "stage": stage, "mb": mb, "start": round(s, 7), "end": round(e, 7)}
        if what:
            want["what"] = what
        if host and (pre or post):
            want["pre"], want["post"] = round(pre, 9), round(post, 9)
        if host and pieces:
            want["kit"] = [[round(a, 7), round(b, 7)] for a, b in pieces]
        if host and cpu:
            want["cpu"] = [round(cpu[0][0], 7), round(cpu[1][0], 7)]
            if cpu[0][1] is not None:
                want["rq"] = [round(cpu[0][1], 7), round(cpu[1][1], 7)]
        assert recorder_mod._line(3, 11, host, *row) == json.dumps(want) + "\n"


def test_spans_written_ahead_where_the_rank_idles_give_the_same_file(tmp_path, monkeypatch):
    """Recorder.ahead (called where a wait blocks) writes out a step's finished spans early: the step's file is
    byte for byte the one written all at its end, loose pieces of the kit's time on the last span included."""
    monkeypatch.setattr(recorder_mod.Recorder, "meta", lambda self: {"rank": self.rank})
    files = []
    for early in (False, True):
        r = recorder_mod.Recorder(tmp_path / f"{early}.jsonl", 0)
        for step in range(2):
            r.begin_step("Schedule1F1B")
            for i in range(7):
                t = 1000.0 + step + i * 0.01
                row = r.add(["F", "SEND", "WAIT", "B"][i % 4], i % 2, i // 2, t, t + 0.004, "send" if i % 4 else "",
                            cpu=((0.5 + i, 0.001), (0.503 + i, 0.002)))
                r.own(row if i != 4 else None, t - 1e-5, t, t + 0.004, t + 0.0041)
                if early and i in (2, 3, 5):
                    r.ahead()
            if early:
                assert 0 < len(r.lines) < len(r.buf)
            r.own(None, 1000.2, 1000.2001, 1000.2002, 1000.2003)  # after the last span: joins its line
            r.end_step()
        files.append((tmp_path / f"{early}.jsonl").read_text())
    assert files[0] == files[1] and files[0].count('"kind"') == 14 and files[0].count('"kit"') == 4


def test_the_gradient_norm_is_the_norm_of_each_parameters_float64_norm():
    """step_numbers' norm (labkit.spans.numbers.norm64: one foreach call) is bit for bit the float64 norm of each gradient's float64 norm,
    mixed dtypes included."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) for n in (5, 300, 1, 4096, 77)] + [torch.randn(9, 9, generator=g).bfloat16()]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x, dtype=torch.float64) for x in grads]))
    got = numbers_mod.norm64(grads)
    assert got.dtype == torch.float64 and float(got) == float(want)
    assert float(numbers_mod.norm64([grads[1]])) == float(torch.linalg.vector_norm(grads[1], dtype=torch.float64))

