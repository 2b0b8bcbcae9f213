"""labkit.spans.held: torch's pipelining records, made where torch makes them, written later (before a wait
that blocks, at a step's end, by the watcher once overdue): the same text, the same order, none lost;
outside a step (and on CUDA) written at once. A schedule step's own last span lines likewise: made ready when
it ends, written at the rank's next blocking wait or by the watcher, woken for them, a moment later."""

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


class _Work:
    def __init__(self, done: bool):
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def test_the_records_are_written_where_the_rank_would_wait_and_not_on_the_way_to_a_send(probe):
    """A hand-off: torch's records stay held through the post of a send, a wait that does not block and the
    next compute; a wait that would block (a work not completed) writes every record made before it."""
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
    wait([_Work(True)])  # the transfer already complete: the rank does not idle here
    record._compute_wrapper(lambda self, mb: seen.append(("compute", out.getvalue().count("\n"))),
                            lambda a, k: "B")(Stage(), 1)
    assert seen == [("post", 0), ("wait", 0), ("compute", 0)] and len(held.HOLD.records) == 1
    lg.debug("batch_p2p bwd_recv")
    wait([_Work(True), _Work(False)])  # one not complete: the rank would idle, the records go first
    assert seen[-1] == ("wait", 2) and not held.HOLD.records
    assert [l.split("] ", 1)[1] for l in out.getvalue().splitlines()] == ["Forwarded chunk 0", "batch_p2p bwd_recv"]


class _Arrives:
    """A transfer that completes once it has been asked `after` times whether it has, and said no each time (the
    peer's data lands while the rank does the kit's deferred work)."""

    def __init__(self, after: int):
        self.left = after

    def is_completed(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_a_wait_stops_the_deferred_work_once_its_transfer_completes_and_the_next_one_goes_on(probe, monkeypatch):
    """At a wait that blocks, the kit's deferred work is done a piece at a time (a record, a fingerprint), and
    stops as soon as the transfer is in: the rank goes on at once; the next blocking wait does the rest, in the
    order it was made; a step's end does all of it."""
    from labkit.spans import received

    lg, out = probe
    wait = record._wait_wrapper(lambda works: None)
    monkeypatch.setattr(received, "PENDING", [])
    taken = []
    monkeypatch.setattr(received, "fingerprint", lambda t: taken.append(t) or ("fp", t))
    held.HOLD.on = True
    for i in range(5):
        lg.debug("record %s", i)
    slots = {"out": [received.DUE] * 3}
    received.PENDING.extend((slots, "out", i, f"act{i}") for i in range(3))
    wait([_Arrives(2)])  # not in at the wait's first look, nor after one record: in after the second
    assert out.getvalue().count("\n") == 2 and len(held.HOLD.records) == 3 and taken == []
    wait([_Arrives(6)])  # the wait's look, three records, the look before the fingerprints, one: in after two
    assert [l.split("] ")[1] for l in out.getvalue().splitlines()] == [f"record {i}" for i in range(5)]
    assert taken == ["act0", "act1"] and slots["out"] == [("fp", "act0"), ("fp", "act1"), received.DUE]
    wait([_Work(True)])  # complete at once: nothing of the kit's done there
    assert len(received.PENDING) == 1
    from labkit.spans.later import idle

    idle()  # a step's end: everything left
    assert slots["out"][2] == ("fp", "act2") and not received.PENDING


def test_the_watcher_writes_records_held_too_long(probe, monkeypatch):
    """A rank that stops inside a compute (no wait, no step end) still has its records written, by the
    watcher thread, once the oldest was held LATE seconds; the thread takes no signal."""
    import signal
    import threading
    import time

    lg, out = probe
    monkeypatch.setattr(held, "LATE", 0.2)
    held.HOLD.on = True
    lg.debug("Forwarded chunk 3")
    assert not held.overdue() and out.getvalue() == ""
    deadline = time.time() + 10
    while "Forwarded chunk 3" not in out.getvalue() and time.time() < deadline:
        time.sleep(0.05)
    assert out.getvalue().endswith("Forwarded chunk 3\n") and not held.HOLD.records
    watcher = next(t for t in threading.enumerate() if t.name == "labkit-held-pp-records")
    assert watcher.daemon and watcher is not threading.main_thread()
    assert signal.SIGABRT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the main thread still takes it


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


# ---- a step's span lines: ready when it ends, written where the rank next idles ----------------------

class _Work:
    """A transfer's work: `is_completed` as given (a wait for an incomplete one would block)."""

    def __init__(self, done: bool):
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def _steps_written(path) -> list[int]:
    import json

    if not path.exists():
        return []
    return [json.loads(x)["end_step"] for x in path.read_text().splitlines() if '"end_step"' in x]


def _one_action_step(rec):
    class Sched:
        pass

    def inner(self):
        rec.add("F", 0, 0, rec.now(), rec.now())

    return lambda: record._step_wrapper(inner)(Sched())


@pytest.mark.launches  # two subprocesses that import torch (the exits)
def test_a_steps_lines_are_made_ready_when_it_ends_and_written_off_its_path(monkeypatch, tmp_path):
    """The step wrapper leaves the step's lines due (not on the path from its last action to the next step's
    first) and wakes the watcher for them (here a stand-in, so nothing else writes them); a wait that would
    block writes them first, a wait that would not leaves them; the next step's end writes them before its own,
    in order; a change of file (a live cell's end), `write_all` (before an exit that skips atexit) and the
    process's exit write them too."""
    from labkit.spans.recorder import Recorder

    woken = []
    monkeypatch.setattr(held, "wake", lambda: woken.append(1))
    path = tmp_path / "rank0.jsonl"
    rec = Recorder(path, 0)
    monkeypatch.setattr(record, "RECORDER", rec)
    step = _one_action_step(rec)
    wait = record._wait_wrapper(lambda works: None)
    step()
    assert rec.due is not None and _steps_written(path) == [] and woken == [1]
    wait([_Work(True)])  # complete: the rank would not idle, nothing of the kit's is done there
    assert _steps_written(path) == []
    wait([_Work(False)])  # it would block: the rank idles, the step's lines are written first
    assert _steps_written(path) == [0] and rec.due is None
    step(), step()  # the second step's end writes the first's lines before it makes its own due
    assert _steps_written(path) == [0, 1]
    rec.use_file(tmp_path / "next.jsonl")  # a live cell's end: its file has every step
    assert _steps_written(path) == [0, 1, 2]
    step()
    record.write_all()
    assert _steps_written(tmp_path / "next.jsonl") == [3]
    code = ("import sys\nfrom labkit.spans import held, record\n"
            "held.wake = lambda: None\n"  # no watcher: only the exit writes the step's lines
            "rec = record.install(sys.argv[1], 0)\n"  # as in every rank the kit starts (its atexit hook too)
            "class S: pass\n"
            "record._step_wrapper(lambda self: rec.add('F', 0, 0, rec.now(), rec.now()))(S())\n"
            "assert rec.due is not None\n"
            "if sys.argv[2] == 'exit_now':\n"
            "    from labkit.worker.distributed import exit_now\n"
            "    exit_now(0)\n")
    import subprocess
    import sys

    for how in ("exit", "exit_now"):
        out = tmp_path / how
        p = subprocess.run([sys.executable, "-c", code, str(out), how], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert _steps_written(out / "rank0.jsonl") == [0], how


def _watched(monkeypatch, tmp_path, late: float, wake: bool):
    """A recorder whose step lines only the watcher can write (once `late` s old, or woken when `wake`); the
    time from the step's end to its lines in the file."""
    import time

    from labkit.spans import recorder as recorder_mod
    from labkit.spans.recorder import Recorder

    monkeypatch.setattr(recorder_mod, "LATE", late)
    if not wake:
        monkeypatch.setattr(held, "wake", held.watch)  # the watcher runs, but is never woken
        held._WAKE[0].clear()
    path = tmp_path / "rank0.jsonl"
    rec = Recorder(path, 0)
    monkeypatch.setattr(record, "RECORDER", rec)
    if record._overdue not in held.TICKS:
        monkeypatch.setattr(held, "TICKS", [*held.TICKS, record._overdue])
    t0 = time.time()
    _one_action_step(rec)()
    deadline = t0 + 10
    while not _steps_written(path) and time.time() < deadline:
        time.sleep(0.01)
    assert _steps_written(path) == [0] and rec.due is None
    return time.time() - t0


def test_the_watcher_woken_at_a_steps_end_writes_its_lines_while_the_rank_goes_on(monkeypatch, tmp_path):
    """The step wrapper wakes the watcher thread, which writes the step's lines at once (here well before they
    could be overdue): a rank killed soon after its step (SIGTERM from torchrun when a peer fails, a user's
    stop) has written it."""
    assert _watched(monkeypatch, tmp_path, late=100.0, wake=True) < 5


def test_a_steps_lines_left_due_are_written_by_the_watcher_once_overdue(monkeypatch, tmp_path):
    """Whatever woke it, the watcher writes a step's lines once they are LATE seconds old: a rank that stops in
    its own code after a step (a collective of its own, a loader, an evaluation) has written that step."""
    took = _watched(monkeypatch, tmp_path, late=0.5, wake=False)
    assert took >= 0.5


def test_steps_written_by_the_watcher_and_the_rank_at_once_are_each_written_once_in_order(monkeypatch, tmp_path):
    """The watcher (woken at every step's end, with no wait: `SOON` 0) and the rank's own blocking waits and step
    ends race to write the due lines: each step is written once, whole, in order."""
    import json
    import time

    from labkit.spans.recorder import Recorder

    monkeypatch.setattr(held, "SOON", 0.0)
    path = tmp_path / "rank0.jsonl"
    rec = Recorder(path, 0)
    monkeypatch.setattr(record, "RECORDER", rec)
    if record._overdue not in held.TICKS:
        monkeypatch.setattr(held, "TICKS", [*held.TICKS, record._overdue])
    step = _one_action_step(rec)
    wait = record._wait_wrapper(lambda works: None)
    for i in range(300):
        step()
        if i % 3 == 0:
            wait([_Work(False)])
        elif i % 3 == 1:
            time.sleep(0.001)  # the rank in its own code a moment: the watcher may write first
    record.write_all()
    rows = [json.loads(x) for x in path.read_text().splitlines()]  # every line whole
    assert [r["begin_step"] for r in rows if "begin_step" in r] == list(range(300))
    assert _steps_written(path) == list(range(300))
    assert [r["step"] for r in rows if r.get("kind") == "F"] == list(range(300))
