"""Live ranks (labkit.ranks): a real torchrun pool of 2 gloo ranks, shared by the tests of this file.

Each fault test says what it costs: a restart is about 3-6 s on 2 cores. Order matters a little:
tests that restart the pool come after those that check that state is kept.
"""

from __future__ import annotations

import _thread
import json
import os
import re
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

import labkit
from labkit.ranks import RanksError, channel
from labkit.ranks.failure import hung_in_init

BUILD = """
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
torch.manual_seed(0)
full = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
part = full[0:2] if rank == 0 else full[2:4]
stage = PipelineStage(part, rank, world_size, device)
sched = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
x, y = torch.randn(4, 8), torch.randn(4, 8)
"""
STEP = """
losses = []
sched.step(x) if rank == 0 else sched.step(target=y, losses=losses)
len(losses)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = labkit.Ranks(nproc=2, device="cpu", runs_root=tmp_path_factory.mktemp("ranks"))
    yield p
    p.close()


def _gone(pids, timeout: float = 10.0) -> list[int]:
    """The pids among `pids` still running after up to `timeout` s (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


# ---- cells, namespaces, output -------------------------------------------------------------------

@pytest.mark.launches
def test_exec_returns_per_rank_values_and_keeps_namespaces(pool):
    assert pool.exec("x = rank * 10") == {0: None, 1: None}
    assert pool.exec("x + world_size") == {0: 2, 1: 12}
    assert pool.exec("x += 1", ranks=[1]) == {1: None}
    assert pool.exec("x") == {0: 0, 1: 11}
    assert pool.exec("(str(device), dist.get_rank(), dist.get_backend(), torch.__name__)") == \
        {r: ("cpu", r, "gloo", "torch") for r in (0, 1)}
    with pytest.raises(labkit.ConfigError, match="from 0 to 1"):
        pool.exec("pass", ranks=[2])


@pytest.mark.launches
def test_values_the_kernel_cannot_load_come_back_as_their_repr(pool):
    got = pool.exec("class Point:\n    def __repr__(self):\n        return f'Point({rank})'\nPoint()")
    assert [repr(v) for v in got.values()] == ["Point(0)", "Point(1)"]
    assert pool.exec("torch.arange(3) + rank")[1].tolist() == [1, 2, 3]


@pytest.mark.launches
def test_output_is_prefixed_by_rank_and_still_in_the_rank_logs(pool, capsys):
    pool.exec("import sys, logging\nprint('hello from', rank)\nprint('to stderr', rank, file=sys.stderr)\n"
              "log = logging.getLogger('mine')\nlog.addHandler(logging.StreamHandler())")
    out, err = capsys.readouterr()
    assert "[rank0] hello from 0" in out and "[rank1] hello from 1" in out
    assert "[rank0] to stderr 0" in err and "[rank1] to stderr 1" in err
    pool.exec("log.warning('a handler made in an earlier cell still reaches the cell')", ranks=[0])
    assert "[rank0] a handler made in an earlier cell" in capsys.readouterr().err
    logs = sorted(Path(pool.run_dir).glob("logs/*/attempt_0/1/stdout.log"))
    assert "hello from 1" in logs[-1].read_text()  # nothing lost: the rank's own log has it too
    assert (pool.cell_dir(pool.last_cell - 1) / "cell.py").read_text().startswith("import sys, logging")


def test_notebook_output_is_live_then_grouped_by_rank(monkeypatch, capsys):
    """In Jupyter: live lines in a display that ends blank, then the text grouped by rank (what nbval compares)."""
    import IPython.display

    from labkit.ranks.output import CellOutput

    shown = []

    class Handle:
        def update(self, obj):
            shown.append(obj._repr_mimebundle_()["text/plain"])

    def display(obj, display_id=False):
        shown.append(obj._repr_mimebundle_()["text/plain"])
        return Handle()

    monkeypatch.setattr(IPython.display, "display", display)
    out = CellOutput(live="notebook")
    for rank, stream, text in ((1, "stdout", "b1\nb"), (0, "stdout", "a1\n"), (1, "stdout", "2\n"),
                               (0, "stderr", "warn\n"), (0, "stdout", "a2")):
        out.write(rank, stream, text)
        out._refresh(force=True)
    out.finish()
    assert shown[0] == "" and shown[-1] == "" and "[rank1] b1" in shown[1]
    got = capsys.readouterr()
    assert got.out == "[rank0] a1\n[rank0] a2\n[rank1] b1\n[rank1] b2\n" and got.err == "[rank0] warn\n"


def test_a_pool_that_shows_nothing_keeps_the_cells_text_and_a_wrong_live_is_refused(capsys):
    from labkit.ranks.output import CellOutput

    out = CellOutput("none")
    out.write(1, "stdout", "b\n")
    out.write(0, "stdout", "a\n")
    out.finish()
    assert out.text() == "[rank0] a\n[rank1] b\n" and capsys.readouterr() == ("", "")
    with pytest.raises(labkit.ConfigError, match="live must be one of 'auto', 'print', 'notebook', 'none', got 'loud'"):
        labkit.Ranks(nproc=2, device="cpu", live="loud")


@pytest.mark.launches
def test_status_names_every_rank(pool):
    pool.exec("pass")  # a cell run on this pool, whatever ran before this test on its worker
    st = pool.status()
    assert st["running"] and st["nproc"] == 2 and st["backend"] == "gloo" and st["device"] == "cpu"
    assert [r["rank"] for r in st["ranks"]] == [0, 1]
    assert all(r["alive"] and not r["busy"] and r["pid"] for r in st["ranks"])
    assert st["run_dir"] == str(pool.run_dir) and st["cells_run"] == pool.cells_run > 0


@pytest.mark.launches
def test_an_empty_cell_round_trip_is_under_50_ms(pool):
    times = []
    for _ in range(20):
        t = time.perf_counter()
        pool.exec("pass")
        times.append(time.perf_counter() - t)
    median = statistics.median(times)
    print(f"empty cell round trip, median of 20: {median * 1000:.2f} ms")
    assert median < 0.05


@pytest.mark.launches
def test_a_pipelining_cell_has_its_own_timeline(pool):
    t = time.perf_counter()
    assert pool.exec(BUILD + STEP) == {0: 0, 1: 2}
    first = time.perf_counter() - t
    tl = pool.timeline()
    assert tl.counts() == {(0, "F"): 2, (0, "B"): 2, (1, "F"): 2, (1, "B"): 2}
    assert tl.ranks == [0, 1] and tl.meta["schedule"] == "ScheduleGPipe"
    assert tl.source == "spans"  # both ends of every action measured in the ranks (labkit.spans)
    assert all(a.end > a.start for a in tl.compute())
    # A cell that only steps the schedule built earlier: its own log, the schedule still named.
    t = time.perf_counter()
    pool.exec(STEP)
    step = time.perf_counter() - t
    tl2 = pool.timeline()
    assert tl2.counts() == tl.counts() and tl2.meta["schedule"] == "ScheduleGPipe"
    assert min(a.start for a in tl2.actions) > max(a.end for a in tl.actions)
    assert sorted(p.name for p in pool.cell_dir().iterdir()) == ["cell.py", "rank0.log", "rank1.log", "spans"]
    assert sorted(p.name for p in (pool.cell_dir() / "spans").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
    # each pipelining record of a cell is written once, to the cell's own log: not to the rank's stderr.log too
    for r in (0, 1):
        cell_log = (pool.cell_dir() / f"rank{r}.log").read_text()
        lines = [l for l in cell_log.splitlines() if "Forwarded chunk" in l or "Backwarded chunk" in l]
        assert len(lines) >= 2, cell_log
        stderr = pool._job.rank_log(r).read_text()
        assert not any(l in stderr for l in lines), "a cell's pipelining record also in the rank's stderr.log"
    report = pool.idle()  # where the step's idle time went, from the cell's spans
    assert report.source == "spans" and set(report.idle) == {0, 1}
    print(f"build+step cell {first:.3f} s, step-only cell {step:.4f} s")
    with pytest.raises(RanksError, match="no pipelining actions"):
        pool.exec("pass")
        pool.timeline()


# ---- faults that keep the pool --------------------------------------------------------------------

@pytest.mark.launches
def test_an_exception_on_one_rank_names_it_and_keeps_every_namespace(pool):
    pids = pool.pids()
    pool.exec("kept = 5")
    with pytest.raises(RanksError) as e:
        pool.exec("kept += 1\nif rank == 1:\n    1 / 0")
    msg = str(e.value)
    assert "failed on rank 1" in msg and "ZeroDivisionError" in msg
    assert re.search(r'File "<cell \d+>", line 3', msg) and "1 / 0" in msg  # the cell's own line
    assert "rank.py" not in msg and not e.value.restarted and list(e.value.failed) == [1]
    assert e.value.results == {0: None}
    assert pool.exec("kept") == {0: 6, 1: 6} and pool.pids() == pids


@pytest.mark.launches
def test_the_socket_refuses_clients_without_the_secret(pool):
    path = pool._job.listener.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    for greeting, wait in ((b"", channel.AUTH_TIMEOUT_S + 2), (b"labkit-ranks/1 " + b"0" * 64, 2)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(wait)
            s.connect(path)
            s.sendall(greeting)
            t = time.monotonic()
            assert s.recv(16) == b"", "the pool must close a connection without the right secret"
            assert time.monotonic() - t < wait
    with pytest.raises(channel.ChannelError):
        channel.connect(path, "f" * 64, timeout=5)
    assert "SECRET" not in " ".join(psutil.Process(pool.pids()[0]).cmdline()).upper()
    assert pool.exec("rank") == {0: 0, 1: 1}


@pytest.mark.skipif(not Path("/usr/bin/ss").exists() and not Path("/bin/ss").exists(), reason="needs ss (iproute2)")
@pytest.mark.launches
def test_the_pool_listens_on_loopback_only(pool):
    pids = {pool.agent_pid, *pool.pids()}
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    addrs = [m.group(1) for line in out.splitlines()
             if (m := re.search(r"\s(\S+):(\d+)\s+\S+\s+users:\((.*)\)", line))
             and {int(x) for x in re.findall(r"pid=(\d+)", m.group(3))} & pids]
    assert addrs, "found no listening sockets of the pool (ss output format changed?)"
    assert all(a in ("127.0.0.1", "[::1]") for a in addrs), addrs


def _interrupt_after(seconds: float):
    """Jupyter's Stop, simulated: SIGINT's handler (as ipykernel installs it) then interrupt_main."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background suite inherits SIG_IGN
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    return lambda: (timer.cancel(), signal.signal(signal.SIGINT, old))


@pytest.mark.launches
def test_an_interrupt_stops_every_rank_and_keeps_namespaces(pool, capsys):
    pids = pool.pids()
    pool.exec("kept2 = rank")
    undo = _interrupt_after(1.0)
    t = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.exec("import time\nfor i in range(600):\n    time.sleep(0.05)")
    finally:
        undo()
    assert time.monotonic() - t < 1.0 + 3.0
    assert "every rank keeps its namespace" in capsys.readouterr().err
    assert pool.pids() == pids and pool.exec("kept2") == {0: 0, 1: 1}


# ---- faults that restart the pool -----------------------------------------------------------------

@pytest.mark.launches
def test_a_rank_blocked_by_a_failed_peer_shows_its_stack_and_is_released(pool):
    """Rank 1 waits in a recv for rank 0, which failed: the pool shows where rank 1 was, then releases
    it (every rank ends its gloo connections, the recv fails, every rank joins a new process group):
    no restart, every namespace kept, and the new group works. tests/test_mistakes.py: the mistakes
    that end this way."""
    pids = pool.pids()
    pool.exec("kept_blocked = 1")
    with pytest.raises(RanksError) as e:
        pool.exec("if rank == 0:\n    raise ValueError('boom')\nt = torch.zeros(1)\ndist.recv(t, src=0)")
    msg = str(e.value)
    assert "failed on rank 0" in msg and "ValueError: boom" in msg
    assert "Rank 1 did not finish" in msg and "dist.recv(t, src=0)" in msg and list(e.value.blocked) == [1]
    assert not e.value.restarted and "The pool released rank 1" in msg and "keeps its namespace" in msg
    assert pool.pids() == pids and pool.exec("kept_blocked") == {0: 1, 1: 1}
    assert pool.exec("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()") == {0: 3.0, 1: 3.0}


@pytest.mark.launches
def test_a_hung_cell_shows_every_rank_stack_and_the_pool_restarts(pool):
    # Rank 1 holds the GIL in C (a regex that never ends), so its reader thread cannot answer: its
    # stack comes from faulthandler (SIGUSR1) instead. Rank 0 answers itself.
    t = time.monotonic()
    with pytest.raises(RanksError) as e:
        pool.exec("import re, time\nif rank == 0:\n    time.sleep(600)\nelse:\n    re.match(r'(a+)+$', 'a' * 64 + 'b')",
                  timeout=3)
    msg = str(e.value)
    assert "did not finish within its 3 s deadline on ranks 0, 1" in msg and sorted(e.value.blocked) == [0, 1]
    assert "time.sleep(600)" in e.value.blocked[0]
    assert "most recent call first" in e.value.blocked[1] and re.search(r'File "<cell \d+>", line 5', e.value.blocked[1])
    assert e.value.restarted and "--timeout" in msg
    print(f"hang: error after {time.monotonic() - t:.1f} s (deadline 3 s, stacks, restart)")
    assert pool.exec("rank") == {0: 0, 1: 1}


@pytest.mark.launches
def test_a_rank_whose_process_ends_is_named_and_the_pool_restarts(pool):
    with pytest.raises(RanksError) as e:
        pool.exec("import os, time\nif rank == 1:\n    os._exit(3)\ntime.sleep(600)")
    msg = str(e.value)
    assert "Rank 1's process ended during cell" in msg and "Then rank 0 ended too" in msg and e.value.restarted
    assert pool.exec("rank") == {0: 0, 1: 1}


@pytest.mark.launches
def test_an_interrupt_with_a_blocked_rank_restarts_the_pool(pool, capsys):
    old = pool.pids()
    undo = _interrupt_after(1.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.exec("import time\nif rank == 0:\n    time.sleep(600)\nt = torch.zeros(1)\ndist.recv(t, src=0)")
    finally:
        undo()
    err = capsys.readouterr().err
    assert "rank 1 did not stop" in err and "restarted" in err and "dist.recv" in err
    assert not _gone(old) and pool.exec("world_size") == {0: 2, 1: 2}


# ---- the magics, and nothing left behind -----------------------------------------------------------

@pytest.mark.launches
def test_magics_run_cells_show_status_stop_and_start_a_pool(pool, capsys, monkeypatch, tmp_path):
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path))
    # the magic's view as a notebook's: this pool alone (the suite's other warm pools, started by other
    # modules in this process, would otherwise become current once this one stops)
    monkeypatch.setattr(labkit.ranks.pool, "_POOLS", {pool: None})
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "labkit")
    ip.run_line_magic("ranks", "status")
    assert re.search(r"pool: running, 2 ranks.*\n.*\n  rank 0: pid \d+, alive, idle", capsys.readouterr().out)
    r = ip.run_cell("%%ranks --ranks 1\nprint('only', rank)\nrank * 3")
    out = capsys.readouterr().out
    assert r.success and "[rank1] only 1" in out and "[rank1] Out: 3" in out and "[rank0]" not in out
    r = ip.run_cell("%%ranks --timeline\n" + BUILD + STEP)
    out = capsys.readouterr().out
    assert r.success, r.error_in_exec
    assert "timeline: GPipe, pp_size 2, 2 microbatches, 4 F, 4 B" in out and "Figure" in out
    r = ip.run_cell("%%ranks --ranks 0,x\npass")
    assert not r.success and "--ranks takes rank numbers" in str(r.error_before_exec or r.error_in_exec)
    pids = {pool.agent_pid, *pool.pids()}
    ip.run_line_magic("ranks", "stop")
    assert not _gone(pids, 0.5), "close() must leave no process"
    assert pool.closed and "Stopped the pool" in capsys.readouterr().out
    with pytest.raises(RanksError, match="closed"):
        pool.exec("pass")
    r = ip.run_cell("%%ranks\nrank")
    out = capsys.readouterr().out
    assert r.success and "No pool was running: started one with 2 ranks" in out and "[rank1] Out: 1" in out
    new = labkit.ranks.pool.current()
    with labkit.Ranks(nproc=1, device="cpu", runs_root=tmp_path) as own:  # notebook 05's pool of its own
        assert own.exec("rank") == {0: 0}
    assert labkit.ranks.pool.current() is new  # the magic's pool again, not "No pool is running"
    pids = {new.agent_pid, *new.pids()}
    ip.run_line_magic("ranks", "stop")
    assert "Stopped the pool (2 ranks)" in capsys.readouterr().out
    assert not _gone(pids, 0.5)


class _FakeJob:
    """A Job that starts nothing: the pool's bookkeeping (which pool is current) without torchrun."""

    def __init__(self, *args):
        self.running = False

    def start(self, timeout):
        self.running = True

    def stop(self):
        self.running = False


def test_the_magic_finds_its_pool_after_a_pool_of_your_own_closes(monkeypatch, tmp_path, capsys):
    """Notebook 05: `%ranks start`, then `with labkit.Ranks(nproc=4) as four:` (issue 42): closing
    `four` once left the magic with no pool, and `%ranks stop` said "No pool is running" while the
    magic's ranks were alive. The pool started before is current again; `stop()` is `close()`."""
    from IPython.core.interactiveshell import InteractiveShell

    import labkit.launching.clean
    from labkit.ranks import pool as pool_mod

    monkeypatch.setattr(pool_mod, "_POOLS", {})  # not the module's live pool
    monkeypatch.setattr(pool_mod, "Job", _FakeJob)
    monkeypatch.setattr(pool_mod, "preflight_device", lambda device, nproc: None)
    monkeypatch.setattr(labkit.launching.clean, "clean", lambda all_jobs=False: [])
    monkeypatch.setattr(channel, "sweep_stale", lambda: [])
    monkeypatch.setenv("LABKIT_RUNS", str(tmp_path))
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "labkit")
    ip.run_line_magic("ranks", "start --nproc 2 --device cpu")
    mine = pool_mod.current()
    assert mine is not None and mine.nproc == 2
    with labkit.Ranks(nproc=4, device="cpu", runs_root=tmp_path) as four:
        assert pool_mod.current() is four  # the open pool started last
    assert four.closed and pool_mod.current() is mine
    other = labkit.Ranks(nproc=1, device="cpu", runs_root=tmp_path)
    mine.restart()  # a restart makes it the one started last again
    assert pool_mod.current() is mine
    other.stop()
    assert other.closed and not mine.closed and pool_mod.current() is mine
    capsys.readouterr()
    ip.run_line_magic("ranks", "stop")
    assert "Stopped the pool (2 ranks)" in capsys.readouterr().out
    assert mine.closed and pool_mod.current() is None
    ip.run_line_magic("ranks", "stop")
    assert "No pool is running: nothing to stop" in capsys.readouterr().out


KERNEL = """
import json, sys, time
import labkit
pool = labkit.Ranks(nproc=2, device="cpu", runs_root=sys.argv[1])
pool.exec("x = 1")
print(json.dumps([pool._job.listener.dir, pool.agent_pid, *pool.pids()]), flush=True)
if sys.argv[2] == "hang":
    time.sleep(120)
"""


@pytest.mark.launches
def test_an_exiting_or_killed_kernel_leaves_no_rank(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent(KERNEL))
    # The kernels' socket folders in a temp dir of their own: a pool another test starts meanwhile sweeps /tmp's.
    base = tempfile.mkdtemp(prefix="lk-", dir="/tmp")
    env = {**os.environ, "TMPDIR": base}
    procs = {how: subprocess.Popen([sys.executable, str(script), str(tmp_path / how), how], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
             for how in ("exit", "hang")}
    said = {how: json.loads(p.stdout.readline() or "[]") for how, p in procs.items()}
    assert all(len(v) == 4 for v in said.values()), procs["hang"].stderr.read()[-2000:] if not said["hang"] else said
    pids = {how: v[1:] for how, v in said.items()}
    procs["hang"].kill()  # a kernel killed hard: no atexit, no close()
    t = time.monotonic()
    for p in procs.values():
        p.wait(timeout=60)
    assert procs["exit"].returncode == 0
    assert not _gone(pids["exit"], 2.0), "atexit must close the pool"
    assert not _gone(pids["hang"], 10.0), "the ranks must exit when the kernel dies"
    print(f"killed kernel: every rank gone {time.monotonic() - t:.2f} s after SIGKILL")
    assert not os.path.exists(said["exit"][0]), "close() removes the socket's folder"
    assert os.path.dirname(said["hang"][0]) == base, said
    assert os.path.exists(said["hang"][0]) and said["hang"][0] in channel.sweep_stale(base)  # the next pool's sweep
    shutil.rmtree(base, ignore_errors=True)  # what else the kernels and their ranks put in their temp dir


def test_torch_log_handlers_that_follow_sys_stderr_are_pinned_to_the_real_stderr(monkeypatch):
    """torch 2.15 logs through a handler that looks sys.stderr up at each record: once a rank's
    sys.stderr is the cell's Tee, every TORCH_LOGS=+pp line would land in the notebook (seen on 2.15).
    The rank pins such handlers to the real stderr (its log file) before it swaps sys.stderr."""
    import io
    import logging

    from labkit.ranks import rank as rank_side

    class FollowsStderr(logging.Handler):  # what torch._logging._internal._StderrHandler does
        @property
        def stream(self):
            return sys.stderr

        def emit(self, record):
            self.stream.write(self.format(record) + "\n")

    probe = logging.getLogger("torch._labkit_probe")
    probe.propagate, probe.level = False, logging.DEBUG
    probe.handlers = [FollowsStderr()]
    real = io.StringIO()
    monkeypatch.setattr(sys, "__stderr__", real)
    monkeypatch.setattr(sys, "stderr", real)
    try:
        rank_side._pin_log_handlers()
        cell = io.StringIO()
        monkeypatch.setattr(sys, "stderr", cell)  # the rank's Tee while a cell runs
        probe.debug("Forwarded chunk 0")
        assert "Forwarded chunk 0" in real.getvalue() and cell.getvalue() == ""
    finally:
        probe.handlers = []


def test_a_pipelining_record_is_formatted_once_for_the_rank_stderr_and_the_cell_file():
    # a record two handlers write with one format (the rank's stderr and a cell's file, where both take it):
    # the text is made once and is the same as logging.Formatter's; a handler with another format makes its own
    import io
    import logging

    from labkit.logs.parse import PP_LOG_FORMAT
    from labkit.ranks.rank import _FormattedOnce

    lg = logging.getLogger("labkit-test.formatted-once")
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    streams = [io.StringIO() for _ in range(4)]
    formats = [_FormattedOnce(PP_LOG_FORMAT), _FormattedOnce(PP_LOG_FORMAT),
               _FormattedOnce("%(levelname)s %(message)s"), logging.Formatter(PP_LOG_FORMAT)]
    calls = []
    real = logging.Formatter.format
    try:
        logging.Formatter.format = lambda self, record: calls.append(1) or real(self, record)
        for stream, fmt in zip(streams, formats):
            h = logging.StreamHandler(stream)
            h.setFormatter(fmt)
            lg.addHandler(h)
        lg.debug("%s Forwarded chunk %s", "[Stage 0]", 3)
    finally:
        logging.Formatter.format = real
        lg.handlers.clear()
    texts = [s.getvalue() for s in streams]
    assert texts[0] == texts[1] == texts[3] and texts[0].endswith("[Stage 0] Forwarded chunk 3\n"), texts
    assert texts[2] == "DEBUG [Stage 0] Forwarded chunk 3\n", texts
    assert len(calls) == 3  # the two handlers of one format: once; the other format; the plain Formatter


def _is_rank(p) -> bool:
    """A rank: a fork of a torchrun agent (its cmdline) that has sent its stderr to its own log (a fork of the
    agent's that is about to exec a helper, e.g. torch's import running ldconfig, has not)."""
    return any(re.search(r"/attempt_0/\d+/stderr\.log$", f.path) for f in p.open_files())


def _new_ranks(me, before: set) -> dict:
    """{agent pid: its ranks} of the pools this test started (another pool's, a fixture's, left alone)."""
    found = {}
    for agent in (a for a in me.children() if a.pid not in before):
        try:
            found[agent.pid] = [w for w in agent.children() if w.cmdline() == agent.cmdline() and _is_rank(w)]
        except psutil.Error:
            pass
    return found


@pytest.mark.launches
def test_a_start_that_times_out_says_where_each_rank_that_never_joined_was(tmp_path):
    """A rank frozen (SIGSTOP) as soon as torchrun forks it: no rank can join (the other waits for it in the
    process group's rendezvous), the start times out, and the error shows each rank's stack from its
    faulthandler dump, taken as the job is ended; nothing is left running. A rank frozen before it reached
    init_process_group: no second launch (that is for a hang inside it, the test below); one that the watcher froze
    late, inside it: one more launch, frozen the same way, and the error says both hung."""
    me, frozen, done = psutil.Process(), [], threading.Event()
    before = {p.pid for p in me.children(recursive=True)}

    def freeze_the_first_rank():  # of each launch (torchrun agent)
        agents = set()
        while not done.is_set():
            for agent, ranks in _new_ranks(me, before).items():
                if ranks and agent not in agents:
                    ranks[0].send_signal(signal.SIGSTOP)
                    agents.add(agent)
                    frozen.append(ranks[0].pid)
            time.sleep(0.002)

    watcher = threading.Thread(target=freeze_the_first_rank, daemon=True)
    watcher.start()
    try:
        with pytest.raises(RanksError) as err:
            labkit.Ranks(nproc=2, device="cpu", runs_root=tmp_path, start_timeout=20)
    finally:
        done.set()
    text = str(err.value)
    kept = list(tmp_path.rglob("start-*-hung.txt"))
    if kept:  # the watcher was late: the first launch's rank froze inside init_process_group, so one more launch
        assert len(frozen) == 2 and "The launch before it hung too" in text, (frozen, text)
        assert hung_in_init(kept[0].read_text().split("Where the ranks that never joined were:")[1], 2)
    else:  # frozen before init_process_group: one launch, the error at once
        assert len(frozen) == 1 and "hung too" not in text, (frozen, text)
    assert "only 0 of 2 ranks joined within 20 s" in text, text
    where = text.split("Where the ranks that never joined were:")[1]
    assert "rank 0:" in where and "rank 1:" in where, text
    assert "Current thread" in where and 'File "' in where, text  # faulthandler's dump, frames and all
    assert not [p for p in me.children(recursive=True) if p.pid not in before], "the agent and every rank ended"


@pytest.mark.launches
def test_a_start_hung_inside_init_process_group_is_told_and_launched_once_more(tmp_path, capfd):
    """The hang CI saw twice (every rank alive inside init_process_group, in gloo's set-up of the process group,
    none joined in 120 s), made here by freezing the first launch's torchrun agent once it has forked both ranks:
    the store it hosts answers nobody, so each rank waits inside init_process_group. The pool says so, keeps
    where each rank was, launches again (the frozen agent and its ranks ended) and works."""
    me, frozen, done = psutil.Process(), [], threading.Event()
    before = {p.pid for p in me.children(recursive=True)}

    def hang_the_first_launch():
        while not done.is_set() and not frozen:
            for agent in (a for a in me.children() if a.pid not in before):
                try:
                    if len([w for w in agent.children() if w.cmdline() == agent.cmdline() and _is_rank(w)]) == 2:
                        agent.send_signal(signal.SIGSTOP)
                        frozen.append(agent)
                        break
                except psutil.Error:
                    pass
            time.sleep(0.002)

    watcher = threading.Thread(target=hang_the_first_launch, daemon=True)
    watcher.start()
    try:
        with labkit.Ranks(nproc=2, device="cpu", runs_root=tmp_path, start_timeout=20, live="print") as pool:
            assert pool.exec("dist.get_world_size() + rank") == {0: 2, 1: 3}
            assert pool.status()["restarts"] == 0
            kept = list(pool.run_dir.glob("start-*-hung.txt"))
    finally:
        done.set()
    assert len(frozen) == 1 and not frozen[0].is_running(), f"the first launch's agent frozen, then ended: {frozen}"
    err = capfd.readouterr().err
    assert "were still setting up their process group after 20 s" in err and "launching them once more" in err, err
    assert len(kept) == 1 and kept[0].name == "start-0-hung.txt", kept
    text = kept[0].read_text()
    assert "only 0 of 2 ranks joined within 20 s" in text, text
    assert " in init_process_group" in text.split("Where the ranks that never joined were:")[1], text
    assert not [p for p in me.children(recursive=True) if p.pid not in before], "the agent and every rank ended"


_CI_DUMP = """Fatal Python error: Aborted

Thread 0x00007fe3f37fe6c0 (most recent call first):
  File "/check/work/main/labkit/ranks/channel.py", line 65 in _recv_exact
  File "/check/work/main/labkit/ranks/rank.py", line 158 in _reader

Current thread 0x00007fe47ee94b80 (most recent call first):
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 757 in _create_gloo_process_group
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 2721 in init_process_group
  File "/check/work/main/labkit/worker/distributed.py", line 94 in init_distributed

Extension modules: numpy (total: 1)
"""


def test_a_start_is_launched_again_only_when_every_rank_that_never_joined_was_inside_init_process_group():
    """`hung_in_init` reads `Job.unjoined_stacks` (the CI hang's own frames): every unjoined rank inside
    init_process_group, yes; a rank elsewhere (frozen in an import, never started), or no stacks at all, no."""
    from labkit.launching.diagnose import current_thread, other_threads

    stuck = current_thread(_CI_DUMP).strip()
    assert other_threads(_CI_DUMP) == ['thread 0x00007fe3f37fe6c0: File "/check/work/main/labkit/ranks/channel.py", '
                                       'line 65 in _recv_exact']
    elsewhere = 'Current thread 0x1 (most recent call first):\n  File "<frozen runpy>", line 226 in run_module'
    assert hung_in_init(f"rank 0:\n{stuck}\nrank 1:\n{stuck}", 2)
    assert hung_in_init(f"rank 1:\n{stuck}", 2)  # rank 0 joined: the other is still inside it
    assert not hung_in_init(f"rank 0:\n{elsewhere}\nrank 1:\n{stuck}", 2)
    assert not hung_in_init(f"rank 0: not started (torchrun's agent had not started it: see launcher.log)\n"
                            f"rank 1:\n{stuck}", 2)
    assert not hung_in_init("", 2) and not hung_in_init("(every rank joined)", 2)
