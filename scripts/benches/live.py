"""Live ranks (labkit.Ranks): a 1F1B step (tiny preset, 2 ranks) sent as a cell to a warm pool against the
same code as a fresh `labkit launch` job, end to end (code sent to output and timeline back), interleaved pair
by pair, and an empty cell's round trip; and the notebook suite under nbval (wall time), which live ranks
made faster (`NOTEBOOKS_BEFORE_LIVE_RANKS_S`: the suite before them)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from .common import REPO_ROOT, _pairs, _ratio

LIVE_SETUP = textwrap.dedent("""
    from labkit.config.run import RunConfig
    from labkit.models.tutorial import build_model, make_batch, tokenwise_loss_fn
    from labkit.worker.stages import build_schedule, build_stages
    cfg = RunConfig(schedule="1F1B", pp_size=world_size, n_microbatches=4, preset="tiny")
    full = build_model(cfg)
    stages, _ = build_stages(cfg, full, rank, device)
    schedule = build_schedule(cfg, stages, tokenwise_loss_fn)
    x, y = make_batch(cfg, device)
""")
LIVE_STEP = textwrap.dedent("""
    losses = []
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
    print(f"rank {rank}: stepped, {len(losses)} losses")
""")
LIVE_JOB = ("import os, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "rank, world_size, device = dist.get_rank(), dist.get_world_size(), torch.device('cpu')\n"
            + LIVE_SETUP + LIVE_STEP + "dist.barrier()\ndist.destroy_process_group()\n")
NOTEBOOKS_BEFORE_LIVE_RANKS_S = 250.0  # the notebook suite in the bench of commit 740ea78 (before live ranks)


def live_ranks(n: int = 5, round_trips: int = 50) -> dict:
    """A 1F1B step sent as a cell to 2 warm ranks vs the same code as a fresh `labkit launch` job, end to
    end: from sending the code to having its output and its measured timeline back. Interleaved pair by
    pair. Also an empty cell's round trip."""
    from labkit.timeline.compare import load_timeline
    from labkit.launching.launch import launch
    from labkit.ranks import Ranks

    expected = {(s, k): 4 for s in (0, 1) for k in ("F", "B")}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "one_step.py"
        script.write_text(LIVE_JOB)
        with Ranks(nproc=2, device="cpu", runs_root=tmp, live="print") as pool:
            pool.exec(LIVE_SETUP)

            def cell() -> float:
                t = time.perf_counter()
                pool.exec(LIVE_STEP)
                assert pool.timeline().counts() == expected
                return time.perf_counter() - t

            def fresh() -> float:
                t = time.perf_counter()
                r = launch(script, nproc=2, runs_root=tmp, progress=False, stream="none")
                assert load_timeline(r.run_dir).counts() == expected
                return time.perf_counter() - t

            fresh_s, cell_s = _pairs(fresh, cell, n)
            pool.exec("pass")
            trips = []
            for _ in range(round_trips):
                t = time.perf_counter()
                pool.exec("pass")
                trips.append(time.perf_counter() - t)
    return {**_ratio(fresh_s, cell_s), "fresh_job_median_s": statistics.median(fresh_s),
            "cell_median_s": statistics.median(cell_s), "empty_cell_median_ms": 1000 * statistics.median(trips),
            "empty_cell_max_ms": 1000 * max(trips), "round_trips": round_trips}


def notebook_suite() -> float:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                        "--nbval-sanitize-with", str(REPO_ROOT / "notebooks" / "sanitize.cfg"),
                        str(REPO_ROOT / "notebooks")], cwd=REPO_ROOT, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError("notebook suite failed:\n" + p.stdout[-3000:])
    return time.perf_counter() - t
