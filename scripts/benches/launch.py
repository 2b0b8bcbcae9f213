"""What launching through the kit costs: `labkit launch` against plain torchrun on the same short job (whole
processes, wall time; beside it the kit's own time outside torchrun, from run.json), and the CPU that pausing
the collector during torch's imports saves (labkit.core.startup): torchrun's agent, a rank's imports and a whole
2-rank `labkit run`, paused against not (LABKIT_GC_PAUSE=0). Both interleaved pair by pair (common._pairs)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

from .common import _cpu, _pairs, _ratio, _wall

SHORT_JOB = textwrap.dedent("""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
""")


def launch_overhead(n: int = 5, nproc: int = 2) -> dict:
    """`labkit launch` vs plain torchrun on the same short script, whole-process wall time.

    Beside the ratio (whose pairs scatter by several percent here: three processes import torch on
    two cores), the kit's own time outside torchrun, measured exactly: the CLI's wall time minus
    the torchrun wall time it records in run.json (interpreter start, imports, run directory).
    """
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "short_job.py"
        script.write_text(SHORT_JOB)
        # TMPDIR: plain torchrun (no --log-dir) leaves a torchelastic_* folder in the temp dir per run
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)
        count = iter(range(10_000))
        outside: list[float] = []

        def kit() -> float:
            out = Path(tmp) / f"run{next(count)}"
            wall = _wall([sys.executable, "-m", "labkit", "launch", "--nproc", str(nproc), "--quiet", "--stream",
                          "none", "--out", str(out), str(script)], env)
            outside.append(wall - json.loads((out / "run.json").read_text())["wall_time_s"])
            return wall

        plain = lambda: _wall([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), str(script)], env)
        res = _ratio(*_pairs(kit, plain, n))
        res["kit_outside_torchrun_s"] = statistics.median(outside)
        res["kit_outside_share"] = res["kit_outside_torchrun_s"] / res["b_median_s"]
        return res


def startup_cost(n: int = 5, kinds=("agent", "rank_imports", "job")) -> dict:
    """What pausing the collector during torch's imports saves (labkit.core.startup), in CPU seconds,
    paused / not paused (LABKIT_GC_PAUSE=0), interleaved pair by pair: torchrun's agent start-up, a
    rank's imports (torch's pipelining and the kit's job), and a whole 2-rank `labkit run` (the
    command, the agent and both ranks). CPU time, not wall: the saving is work the machine no longer
    does, which is what a suite of hundreds of processes on 2 cores waits for."""
    from labkit.spans.paths import BOOT_DIR

    boot = os.pathsep.join([str(BOOT_DIR), os.environ.get("PYTHONPATH", "")])
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        count = iter(range(10_000))
        commands = {
            "agent": lambda: [py, "-m", "torch.distributed.run", "--help"],
            "rank_imports": lambda: [py, "-c",
                                     "import torch.distributed.pipelining, labkit.jobs.train, os; os._exit(0)"],
            "job": lambda: [py, "-m", "labkit", "run", "--schedule", "1F1B", "--pp-size", "2", "--quiet", "--stream",
                            "none", "--out", str(Path(tmp) / f"run{next(count)}")],
        }
        res = {}
        for kind in kinds:
            cmd = commands[kind]
            env = lambda on: dict(os.environ, PYTHONPATH=boot, OMP_NUM_THREADS="1", TMPDIR=tmp,  # noqa: E731
                                  LABKIT_GC_PAUSE="1" if on else "0")
            res[kind] = _ratio(*_pairs(lambda: _cpu(cmd(), env(True)), lambda: _cpu(cmd(), env(False)), n))
        return res
