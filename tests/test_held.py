"""labkit.spans.held: torch's pipelining records, made where torch makes them, written a moment later (after
the post of a send or receive, before a wait or a compute, at a step's end): the same text, the same order,
none lost; outside a step (and on CUDA) written at once."""

from __future__ import annotations

import io
import logging

import pytest

from labkit.spans import held, record


@pytest.fixture
def probe():
    lg = logging.getLogger(held.PP_LOGGER + ".labkit_probe")
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(logging.Formatter("%(created).6f %(name)s %(filename)s:%(lineno)d] %(message)s"))
    lg.addHandler(h)
    held.watch_loggers()
    yield lg, out
    held.HOLD.on = False
    held.release()
    lg.removeHandler(h)


def test_a_held_record_is_written_later_with_its_own_time_and_text(probe):
    lg, out = probe
    lg.debug("before the step")  # outside a step: at once
    assert out.getvalue().endswith("before the step\n")
    held.HOLD.on = True
    lg.debug("[Stage 0] Forwarded chunk %s", 0)
    lg.debug("[Stage 0] Sending tensor to Stage %s", 1)
    assert out.getvalue().count("\n") == 1  # held
    made = [r.created for _, r in held.HOLD.records]
    held.release()
    lines = out.getvalue().splitlines()
    assert [l.split("] ", 1)[1] for l in lines] == ["before the step", "[Stage 0] Forwarded chunk 0",
                                                     "[Stage 0] Sending tensor to Stage 1"]
    assert [float(l.split()[0]) for l in lines[1:]] == [float(f"{t:.6f}") for t in made]  # torch's moment
    assert all("test_held.py:" in l for l in lines)  # where torch made it, not where it was written


def test_never_more_than_the_cap_is_held(probe):
    lg, out = probe
    held.HOLD.on = True
    for i in range(held.CAP * 2 + 3):
        lg.debug("record %s", i)
        assert len(held.HOLD.records) < held.CAP
    held.release()
    assert [l.split("] ")[1] for l in out.getvalue().splitlines()] == [f"record {i}" for i in range(held.CAP * 2 + 3)]


def test_the_records_are_written_after_a_post_and_before_a_wait_or_a_compute(probe):
    """A hand-off: the send is posted first, its records right after; a rank that then waits (or computes, or
    hangs in either) has written every record made before."""
    lg, out = probe
    seen = []
    post = record._post_wrapper(lambda ops: seen.append(("post", out.getvalue().count("\n"))) or [])
    wait = record._wait_wrapper(lambda works: seen.append(("wait", out.getvalue().count("\n"))))

    class Stage:
        stage_index = 0

    compute = record._compute_wrapper(lambda self, mb: seen.append(("compute", out.getvalue().count("\n"))),
                                      lambda a, k: "F")
    compute.__name__ = "forward_one_chunk"
    held.HOLD.on = True
    lg.debug("Forwarded chunk 0")
    post([])
    assert seen[-1] == ("post", 0) and out.getvalue().count("\n") == 1  # posted, then written
    lg.debug("batch_p2p bwd_recv")
    wait(["a work"])
    assert seen[-1] == ("wait", 2)
    lg.debug("Backwarded chunk 0")
    record._compute_wrapper(lambda self, mb: seen.append(("compute", out.getvalue().count("\n"))),
                            lambda a, k: "B")(Stage(), 1)
    assert seen[-1] == ("compute", 3)


def test_a_step_writes_what_it_held_when_it_ends_or_raises(probe, monkeypatch):
    from labkit.spans.recorder import Recorder

    lg, out = probe
    monkeypatch.setattr(record, "RECORDER", Recorder(None, 0))  # kept in memory; torch's classes left alone

    class Sched:
        pass

    def inner(self, fail=False):
        held.HOLD.on = True  # as the step wrapper sets it on CPU
        lg.debug("inside the step")
        if fail:
            raise RuntimeError("a failed step")

    step = record._step_wrapper(inner)
    step(Sched())
    assert out.getvalue().endswith("inside the step\n") and not held.HOLD.on
    with pytest.raises(RuntimeError):
        step(Sched(), fail=True)
    assert out.getvalue().count("inside the step") == 2 and not held.HOLD.on and not held.HOLD.records
