"""What every benchmark shares: where the repository is, and the timing helpers behind "A and B
interleaved pair by pair" (these machines are noisy: every figure is a ratio within one run).

- `_wall`, `_cpu`, `_tree_run`: one command's wall time, its CPU (user + system of the processes waited
  for), or both for its whole process tree, orphans included (this process a subreaper for the run);
- `_pairs` (two sides) and `_rounds` (k sides), run alternately, after one unmeasured warm-up run of
  each side while `WARM_UP` holds (tests/test_bench.py clears it here: structure, never timings);
- `_spread`, `_ratio`, `_wall_and_cpu`: the median of the pair ratios, their middle half, each side's median;
- `_reference_launch`: one quiet run of the kit's reference job; `machine`, `_torch`: what ran it.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import subprocess
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # this file is <repo>/scripts/benches/common.py
BENCH_DIR = REPO_ROOT / "bench"


def _wall(cmd: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return time.perf_counter() - t0


WARM_UP = True  # one unmeasured run of each side first; tests/test_bench.py (structure, never timings) skips it


def _pairs(a, b, n: int, warm_up: bool = True) -> tuple[list[float], list[float]]:
    """Run a() and b() alternately n times (after one warm-up each, with WARM_UP and warm_up); their results."""
    if WARM_UP and warm_up:
        a(), b()
    ra, rb = [], []
    for i in range(n):
        if i % 2:
            rb.append(b()), ra.append(a())
        else:
            ra.append(a()), rb.append(b())
    return ra, rb


def _spread(ratios: list[float]) -> dict:
    """Median of a list of pair ratios, with the ratios and their middle half."""
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "pair_ratios": ratios, "pair_ratio_iqr": [q[0], q[2]]}


def _ratio(ra: list[float], rb: list[float]) -> dict:
    return {**_spread([x / y for x, y in zip(ra, rb)]),
            "a_median_s": statistics.median(ra), "b_median_s": statistics.median(rb)}


def _cpu(cmd: list[str], env: dict) -> float:
    """CPU seconds (user + sys) of a command and every process under it that was waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _tree_run(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a command and its whole process tree.

    RUSAGE_CHILDREN counts a process once someone waits for it, and nobody waits for a forkserver or
    multiprocessing's resource tracker once their agent has ended (they are orphans, and so are the ranks
    a forkserver had not reaped yet): this process becomes a subreaper for the run, orphans of the tree
    are reparented to it, and it waits for each before reading the counts."""
    import ctypes

    import psutil

    libc = ctypes.CDLL(None, use_errno=True)
    me = psutil.Process()
    before_kids = {c.pid for c in me.children()}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    try:
        wall = _wall(cmd, env)
        deadline = time.monotonic() + 60
        while orphans := [c.pid for c in me.children() if c.pid not in before_kids]:
            for pid in orphans:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"process {pid} of `{' '.join(cmd)}` outlived it by 60 s")
                    time.sleep(0.02)
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def _rounds(sides: dict, n: int, fewer: dict | None = None, warm_up=None) -> dict:
    """Every side run once per round, n rounds, the order reversed every other round (the pairs of
    `_pairs`, k sides at once: each side's i-th run is paired with the others' i-th, run in the same
    round); with WARM_UP, after one warm-up run of each side named in `warm_up` (None: every side).
    `fewer`: {side: rounds} for a side that runs only in the first rounds. {side: [result, ...]}."""
    if WARM_UP:
        for k in sides if warm_up is None else warm_up:
            sides[k]()
    out: dict = {k: [] for k in sides}
    for i in range(n):
        names = [k for k in sides if i < (fewer or {}).get(k, n)]
        for k in (names if i % 2 == 0 else reversed(names)):
            out[k].append(sides[k]())
    return out


def _wall_and_cpu(a: list[tuple], b: list[tuple]) -> dict:
    """{"cpu": _ratio, "wall": _ratio} of (wall, cpu) runs a over b, paired by round (b's first len(a))."""
    b = b[:len(a)]
    return {"wall": _ratio([x[0] for x in a], [x[0] for x in b]), "cpu": _ratio([x[1] for x in a], [x[1] for x in b])}


def _reference_launch(cfg, runs_root, job_args=(), **run_kw):
    """One quiet run of the kit's reference job (`labkit.run`) for `cfg`, whatever it ends with."""
    from labkit.launching.launch import run

    return run(cfg, job_args=job_args, runs_root=runs_root,
               **{"progress": False, "stream": "none", "check": False, **run_kw})


def _torch() -> str:
    from importlib import metadata

    return metadata.version("torch")


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
