"""Shared fixtures: a run root under tmp_path, and a check that no test leaves a rank running."""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def kit_processes(under: Path | None = None) -> list[psutil.Process]:
    """Processes started by a labkit launch (they carry LABKIT_RUN_DIR), optionally under one folder."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            d = p.environ().get("LABKIT_RUN_DIR")
        except (psutil.Error, OSError):
            continue
        if d and (under is None or str(d).startswith(str(under))):
            found.append(p)
    return found


@pytest.fixture
def runs(tmp_path):
    """A folder for run directories; fails the test if any kit process is still alive after it."""
    root = tmp_path / "runs"
    root.mkdir()
    yield root
    deadline = time.time() + 10
    left = kit_processes(root)
    while left and time.time() < deadline:
        time.sleep(0.2)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left running: {[(p.pid, p.cmdline()) for p in left]}"


def labkit_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "labkit", *args]


_POOLS: dict = {}  # {nproc: labkit.Ranks}: the suite's warm ranks, shared by every module (closed at the end)
_POOL_ROOTS: list = []  # their run directories in the temp folder (~20 MB each): removed when the session passed
POOL_BASE = {"__name__", "__builtins__", "rank", "world_size", "local_rank", "device", "dist", "torch"}


def live_ranks(nproc: int, root: Path | None = None):
    """The suite's pool of `nproc` live CPU ranks (labkit.Ranks), started on first use and shared by
    every test module: tests that check what a pipelined step computes run there, warm, instead of
    paying a launch each (torchrun's agent and every rank importing torch: ~6 s of CPU apiece on 2
    cores). A pool that was closed or restarted (a test of faults) is replaced. Modules leave its
    namespace clean (`clean_namespace`)."""
    import tempfile

    import labkit

    pool = _POOLS.get(nproc)
    if pool is None or pool.closed:
        runs_root = root or Path(tempfile.mkdtemp(prefix=f"pplab-pool{nproc}-"))
        if root is None:
            _POOL_ROOTS.append(runs_root)
        pool = _POOLS[nproc] = labkit.Ranks(nproc=nproc, device="cpu", runs_root=runs_root, live="print")
    return pool


def clean_namespace(pool) -> None:
    """Every name a module's cells left on the pool's ranks deleted: the next module starts as a new pool."""
    pool.exec(f"[globals().pop(k) for k in list(globals()) if k not in {sorted(POOL_BASE)!r}] and None")


def module_pool(nproc: int, setup: str = ""):
    """A module-scoped `pool` fixture: the suite's pool of `nproc` ranks (`live_ranks`), `setup` run on
    it first, its namespace cleaned after the module (`pool = module_pool(2, SETUP)` in a test file)."""
    @pytest.fixture(scope="module")
    def pool():
        p = live_ranks(nproc)
        if setup:
            p.exec(setup)
        yield p
        clean_namespace(p)
    return pool


# Two xdist workers (scripts/dev.py test, `--dist loadgroup`): each file is one unit of work, run in
# order on one worker (a notebook's cells share a kernel, a module's fixtures its jobs), except that
# every file that runs tests on the suite's warm pools (it calls live_ranks, module_pool or run_suite)
# is ONE unit, so the pools start once per leg, not once per worker. Units go out longest first
# (UNIT_SECONDS), so the two workers end together. The units are the suite's own scheduler: xdist's
# xdist_group marks rename node ids, which pytest 9.2 no longer lets a plugin do.
POOL_CALLS = re.compile(r"(?<![\w.])(live_ranks|module_pool|run_suite)\(")  # not bench.live_ranks(
POOLS_UNIT = "suite-pools"
UNIT_SECONDS = {  # {unit: its tests' seconds in leg 1 of a full run on 2 workers, 2 cores}; others count 0
    "suite-pools": 610,
    "tests/test_reliability.py": 240,
    "tests/test_ranks.py": 180,
    "notebooks/09_gotchas.ipynb": 170,
    "notebooks/05_schedules_multistage.ipynb": 160,
    "tests/test_bench.py": 150,
    "notebooks/12_composing_parallelisms.ipynb": 130,
    "notebooks/04_schedules_gpipe_1f1b.ipynb": 100,
    "tests/test_browser.py": 100,
    "notebooks/13_schedule_search.ipynb": 90,
    "tests/test_launch.py": 80,
    "notebooks/14_pipelining_in_practice.ipynb": 70,
    "notebooks/09c_training_drift.ipynb": 70,
    "tests/test_fidelity.py": 70,
    "notebooks/07_inference.ipynb": 60,
    "tests/test_gpu_check.py": 60,
    "tests/test_setup.py": 50,
    "notebooks/11_your_own_model.ipynb": 50,
    "tests/test_spans.py": 50,
    "notebooks/06_reading_pp_logs.ipynb": 50,
}
_uses_pools: dict = {}


def uses_pools(path: Path) -> bool:
    """Whether the test file at `path` runs tests on the suite's shared pools (POOL_CALLS)."""
    if path not in _uses_pools:
        text = path.read_text(errors="replace") if path.suffix == ".py" and path.name != "conftest.py" else ""
        _uses_pools[path] = POOL_CALLS.search(text) is not None
    return _uses_pools[path]


def work_unit(nodeid: str) -> str:
    """The unit of work a test or notebook cell belongs to: POOLS_UNIT or its file."""
    path = nodeid.split("::")[0]
    return POOLS_UNIT if uses_pools(REPO / path) else path


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Units(config, log)


@functools.lru_cache(maxsize=None)
def runs_alone(path: Path) -> bool:
    """Whether the notebook at `path` runs alone, in the serial pass (scripts/dev.py reads its metadata)."""
    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    from dev import runs_alone as says_alone

    return says_alone(path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:  # a notebook that compares a quiet machine with a busy one runs alone, as `serial`
        if runs_alone(REPO / item.nodeid.split("::")[0]):
            item.add_marker(pytest.mark.serial)
    if getattr(config.option, "loadgroup", False):  # on an xdist worker of `--dist loadgroup`
        items.sort(key=lambda item: -UNIT_SECONDS.get(work_unit(item.nodeid), 0))  # stable: in-file order kept


def pytest_sessionfinish(session, exitstatus):
    """Close the suite's pools; remove their run directories if every test passed (a failure keeps
    them for reading: their paths are in the failing tests' output). Each full run left ~10 of ~20 MB
    in the temp folder; 232 of them had piled up on this machine."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
    if exitstatus == 0:
        for root in _POOL_ROOTS:
            shutil.rmtree(root, ignore_errors=True)
    _POOL_ROOTS.clear()


def run_suite(root: Path, name: str, cfgs: dict, nproc: int, job_args: dict | None = None) -> dict:
    """Run the RunConfigs `cfgs` ({key: RunConfig}) one after the other on the suite's warm pool of
    `nproc` ranks (`live_ranks`), each as the reference job runs it (`labkit.ranks.suite.run_configs`)
    in its own run directory under root/name: real runs, without paying a launch per config or per
    module. `job_args`: {key: the job's flags for that config}. Returns {key: that run's result.json,
    or None}, "__dirs__" ({key: its run directory}) and "__codes__" ({key: the job's exit code for it})."""
    from labkit.ranks.suite import run_configs

    return run_configs(live_ranks(nproc), cfgs, root / name, job_args=job_args)


@pytest.fixture
def no_ortools(monkeypatch):
    """This test's imports of OR-Tools fail, as on an install without the `search` extra."""
    import builtins

    real = builtins.__import__

    def refuse(name, *a, **k):
        if name.startswith("ortools"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", refuse)
