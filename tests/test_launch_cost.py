"""What `labkit launch` costs beside plain torchrun, kept small (the bench's launch overhead row,
scripts/bench.py, measures the whole: <= 1.03x).

- `import labkit` runs in every torchrun agent of the environment (torch loads every
  `torchrun.handlers` plugin, the kit's labkit.launching.rendezvous, plain `torchrun --standalone` too) and in
  the launcher: it must not import the live ranks, the log readers or torch;
- the launcher looks for the job's ranks (to end them if torchrun dies) in /proc's children lists,
  a few reads per process of the job, not a walk of every process on the machine;
- it wakes the moment torchrun exits (a pidfd), not at the next poll.
"""

import subprocess
import sys
import time

import psutil
import pytest

from labkit.launching.launch import _ExitWaiter
from labkit.launching.stop import descendants


def test_importing_the_kit_as_torchruns_plugin_leaves_the_heavy_parts_out():
    code = ("import sys, labkit.launching.rendezvous, labkit.launching.launch; "
            "print(sorted(m for m in sys.modules if m.startswith(('labkit.ranks', 'labkit.logs.', 'torch', 'matplotlib'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['labkit.logs.messages', 'labkit.logs.parse']", out.stdout  # the log format only


def test_the_lazy_names_still_resolve():
    import labkit
    import labkit.logs as logs

    assert labkit.Ranks.__name__ == "Ranks" and labkit.RanksError.__name__ == "RanksError"
    assert labkit.ranks.pool.current is not None  # the notebooks' labkit.ranks.pool.current() after `import labkit`
    assert logs.CAUSES[0] == "fill / drain" and callable(logs.parse_files) and logs.gaps.explain_idle is logs.explain_idle
    with pytest.raises(AttributeError):
        labkit.no_such_name
    with pytest.raises(AttributeError):
        logs.no_such_name


def test_descendants_are_the_same_processes_psutil_finds():
    p = subprocess.Popen(["bash", "-c", "sleep 30 & (sleep 30; true) & sleep 30 & wait"])
    try:
        deadline = time.time() + 30
        while len(psutil.Process(p.pid).children(recursive=True)) < 4 and time.time() < deadline:
            time.sleep(0.05)
        want = sorted(c.pid for c in psutil.Process(p.pid).children(recursive=True))
        assert len(want) == 4  # three sleeps and the subshell
        assert sorted(c.pid for c in descendants(p.pid)) == want
    finally:
        for c in psutil.Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
        p.wait()
    assert descendants(p.pid) == []  # gone: nothing, no error


def test_the_launcher_wakes_when_the_job_exits_not_at_its_timeout():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    waiter = _ExitWaiter(p)
    try:
        t0 = time.monotonic()
        while p.poll() is None and time.monotonic() - t0 < 60:
            waiter(30.0)
        assert p.returncode == 0
        assert time.monotonic() - t0 < 20  # woken by the exit, far before its 30 s timeout
    finally:
        waiter.close()
