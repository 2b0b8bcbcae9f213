"""The kit's own share (labkit.spans): the time its wrappers spend around torch's calls, measured in
every rank, reported per rank (`instrument_overhead`) and as its own idle cause, apart from the
runtime's.

Each wrapper reads the host clock on entry and exit; a slow piece of the kit (a sleep injected
into `Recorder.add`, which runs inside every wrapper after the span's end) must show up there and
nowhere else. Real job: tests/test_spans.py's plain script (the same assertions on a 2-rank run).
"""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from labkit.spans import explain_idle_spans, read_spans, timeline_from_spans
from labkit.spans import record as rec_mod
from labkit.spans.idle import SPAN_CAUSES
from labkit.spans.read import Span, instrument_overhead, select_step


def test_the_kits_pieces_are_their_own_cause_and_the_causes_still_add_up():
    s = [Span(0, 0, "F", 0, 0, 0.0, 1.0, post=0.05),                       # kit 1.00 .. 1.05
         Span(0, 0, "SEND", -1, -1, 1.05, 1.08, "send"),                    # sends 0.03
         Span(0, 0, "WAIT", -1, -1, 1.1, 1.5, "recv", pre=0.02),            # kit 1.08 .. 1.10, waiting 0.4
         # a call without a span (kit 1.45 .. 1.55, half of it inside the wait: counted once, as the wait)
         Span(0, 0, "B", 0, 0, 1.8, 3.0, pre=0.1, post=0.2, kit=((1.45, 1.55),)),  # kit 1.70 .. 1.80
         # 1.55 .. 1.70: nothing recorded: runtime overhead 0.15; after 3.0: drain, whoever runs then
         Span(1, 0, "WAIT", -1, -1, 0.0, 1.2, "recv"), Span(1, 0, "F", 1, 0, 1.2, 2.0),
         Span(1, 0, "B", 1, 0, 2.0, 3.3)]
    rep = explain_idle_spans(s)
    c0 = rep.idle[0]
    assert list(c0) == list(SPAN_CAUSES) and rep.causes == SPAN_CAUSES
    assert c0 == pytest.approx({"fill / drain": 0.3, "waiting for a neighbour": 0.4, "sends and receives": 0.03,
                                "instrument overhead": 0.05 + 0.02 + 0.05 + 0.1, "runtime overhead": 0.15})
    assert rep.gap_list[0][0]["instrument overhead"] == pytest.approx(0.22)
    busy = {0: 1.0 + 1.2, 1: 0.8 + 1.3}
    for r in (0, 1):
        assert sum(rep.idle[r].values()) == pytest.approx(3.3 - busy[r], abs=1e-12)  # the idle time, exactly
    assert rep.idle[1]["instrument overhead"] == 0.0
    assert "instrument overhead" in rep.text() and "runtime overhead" in rep.text()


def test_each_wrapper_measures_its_own_time_and_a_slow_one_shows(monkeypatch, tmp_path):
    """Two waits with a span and one without, inside a step: a 30 ms sleep injected in the kit's code
    after each span's end is each span's `post`; the call without a span gives its pieces to the next
    span's line; the step's line adds it all up against the step's wall time."""
    r = rec_mod.Recorder(tmp_path / "rank0.jsonl", rank=0)
    monkeypatch.setattr(rec_mod, "RECORDER", r)
    add = rec_mod.Recorder.add

    def slow_add(self, *a, **k):
        time.sleep(0.03)
        return add(self, *a, **k)

    monkeypatch.setattr(rec_mod.Recorder, "add", slow_add)
    wait = rec_mod._wait_wrapper(lambda works: time.sleep(0.02))  # torch's wait: 20 ms

    class Schedule:
        def step(self):
            wait(["a"]), wait([]), wait(["b"])

    rec_mod._step_wrapper(Schedule.step)(Schedule())
    rec_mod.write_all()  # the step's lines are written where the rank next idles (here: at once)
    rows = [json.loads(x) for x in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    spans, end = [x for x in rows if x.get("kind") == "WAIT"], rows[-1]
    assert len(spans) == 2 and "end_step" in end
    for x in spans:
        assert x["end"] - x["start"] >= 0.02 - 1e-6            # torch's call is the span ...
        assert x["post"] >= 0.03 and x["pre"] < x["post"]       # ... the sleep in the kit's code is not
    assert "kit" not in spans[0] and len(spans[1]["kit"]) == 2  # the call without a span: before the next span
    for a, b in spans[1]["kit"]:
        assert spans[0]["end"] <= a <= b <= spans[1]["start"]
    loose = sum(b - a for a, b in spans[1]["kit"])
    assert end["calls"] == 3
    assert end["wrappers"] == pytest.approx(sum(x["pre"] + x["post"] for x in spans) + loose, abs=1e-6)
    assert end["kit"] >= end["wrappers"] >= 2 * 0.03
    assert end["wall"] >= 3 * 0.02 + 2 * 0.03 and end["kit"] < end["wall"]
    got, meta = read_spans(tmp_path)
    assert [(s.pre, s.post) for s in got] == [(x["pre"], x["post"]) for x in spans]
    own = instrument_overhead(got, meta)["0"]
    assert own["seconds"] == pytest.approx(end["kit"]) and own["step_s"] == pytest.approx(end["wall"])
    assert own["share"] == pytest.approx(end["kit"] / end["wall"], rel=1e-5) and own["calls"] == 3


PIPELINE = """
import sys, time
import torch, torch.distributed as dist
from torch import nn
from labkit.spans import record

record.install(sys.argv[1], rank=0)
slow = float(sys.argv[2])
if slow:  # the kit's own code made slow: a sleep inside every wrapper, after the span's end
    add = record.Recorder.add
    def slow_add(self, *a, **k):
        time.sleep(slow)
        return add(self, *a, **k)
    record.Recorder.add = slow_add
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
stage = PipelineStage(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), 0, 1, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
x = torch.randn(8, 16)
for _ in range(2):
    schedule.step(x, target=x)
dist.destroy_process_group()
"""


@pytest.mark.launches
def test_a_sleep_in_the_kits_wrapper_is_instrument_overhead_not_runtime_overhead(tmp_path):
    """A real GPipe step (one rank, 4 microbatches: 8 actions, 7 gaps between them) whose wrappers
    sleep 20 ms after each span's end: each gap holds one sleep, found as the kit's, not the runtime's."""
    script = tmp_path / "pipeline.py"
    script.write_text(textwrap.dedent(PIPELINE))
    slow = 0.02
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "spans"), str(slow)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = explain_idle_spans(tmp_path / "spans")  # the last step
    assert rep.gaps[0] == 7, rep.gap_list
    causes = rep.idle[0]
    assert causes["instrument overhead"] >= 7 * slow, causes
    assert causes["runtime overhead"] < 7 * slow / 2, causes  # the sleeps are not the runtime's
    spans, _ = read_spans(tmp_path / "spans")
    busy = sum(s.end - s.start for s in select_step(spans, "last") if s.kind in ("F", "B"))
    assert sum(causes.values()) == pytest.approx(rep.makespan - busy, abs=1e-9)  # the idle time, exactly
    tl = timeline_from_spans(tmp_path / "spans")
    own = tl.meta["instrument_overhead"]["0"]
    assert own["steps"] == 2 and own["seconds"] >= 2 * 8 * slow  # every one of the 16 actions' wrappers slept
    assert 0 < own["share"] < 1 and own["seconds"] < own["step_s"]
