"""Shared fixtures: a run root under tmp_path, and a check that no test leaves a rank running."""

from __future__ import annotations

import os
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


def run_suite(root: Path, name: str, cfgs: dict, nproc: int) -> dict:
    """Run the RunConfigs `cfgs` ({key: RunConfig}) one after the other in ONE torchrun job of the
    reference job (`python -m labkit.jobs.train --suite`), each in its own run directory: real runs,
    without paying a launch (~6 s of torchrun and imports on 2 cores) per config.
    Returns {key: that run's result.json, or None} and the job's Run under "__job__"."""
    import json

    from labkit.launching.launch import REFERENCE_JOB, launch

    items = [{"config": c.to_dict(), "out": str(root / name / str(i))} for i, c in enumerate(cfgs.values())]
    spec = root / f"{name}.json"
    spec.write_text(json.dumps(items))
    job = launch(REFERENCE_JOB, ["--suite", str(spec)], nproc=nproc, module=True, out=root / name / "job",
                 progress=False, stream="none", check=False)
    out = {}
    for key, it in zip(cfgs, items):
        f = Path(it["out"]) / "result.json"
        out[key] = json.loads(f.read_text()) if f.exists() else None
    out["__job__"] = job
    out["__dirs__"] = {key: Path(it["out"]) for key, it in zip(cfgs, items)}  # each run's directory
    return out
