"""Run directories and the `Run` record: what a launch leaves behind, and where.

A run directory holds `command.json` / `command.txt` (the exact argv), `config.json`,
`launcher.log` (torchrun's own output), `logs/<id>/attempt_0/<rank>/{stdout,stderr}.log` (the
pipelining logger at DEBUG in stderr), `result.json` (written by the job) and `run.json` (status,
return code, wall time, failing rank). Run directories are never overwritten. Taught in notebook 00.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ..core.errors import ConfigError
from .diagnose import TAIL_LINES

DEFAULT_RUNS_ROOT = "runs"


class LaunchError(RuntimeError):
    """A job that failed: names the rank, the command and the tail of that rank's log."""

    def __init__(self, message: str, run: "Run"):
        super().__init__(message)
        self.run = run


@dataclass
class Run:
    """What a launch left behind. `result` is the job's result.json (None if it wrote none)."""

    run_dir: Path
    command: list[str]
    nproc: int
    status: str = "running"  # ok | failed | interrupted | timeout
    returncode: int | None = None
    wall_time_s: float = 0.0
    result: dict | None = None
    failed_rank: int | None = None
    error: str | None = None
    rank_exitcodes: dict = field(default_factory=dict)
    """{rank: exit code} for the ranks torchrun reported as failed."""

    @property
    def job_exitcode(self) -> int:
        """The failing rank's own exit code (torchrun itself always exits 1); 0 when all went well."""
        if self.returncode == 0:
            return 0
        code = self.rank_exitcodes.get(self.failed_rank)
        return code if isinstance(code, int) and code > 0 else (self.returncode or 1)

    def rank_dir(self, rank: int) -> Path | None:
        """torchrun's per-rank log folder (`logs/<id>/attempt_<n>/<rank>`), newest attempt."""
        hits = sorted(self.run_dir.glob(f"logs/*/attempt_*/{rank}"))
        return hits[-1] if hits else None

    def log_path(self, rank: int, stream: str = "stderr") -> Path | None:
        d = self.rank_dir(rank)
        return d / f"{stream}.log" if d else None

    def log(self, rank: int, stream: str = "stderr") -> str:
        p = self.log_path(rank, stream)
        return p.read_text(errors="replace") if p and p.exists() else ""

    def tail(self, rank: int, n: int = TAIL_LINES) -> str:
        """Last `n` lines of a rank's stdout and stderr together (what an error message shows)."""
        lines = []
        for stream in ("stdout", "stderr"):
            lines += [f"{stream}: {l}" for l in self.log(rank, stream).splitlines()]
        return "\n".join(lines[-n:])

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def timeline(self, source: str = "auto"):
        """The run's measured Timeline: its spans (both ends of every action), else its PP logs or
        profiler traces (`labkit.timeline.compare.load_timeline`)."""
        from ..timeline.compare import load_timeline

        return load_timeline(self.run_dir, source)

    def idle(self, which: str | int = "last"):
        """Where a step's idle time went, by cause and per gap, measured from the run's spans (one
        report per pipeline when the ranks formed several: `labkit.spans.idle.IdleByPipeline`)."""
        from ..spans import explain_idle_by_pipeline

        return explain_idle_by_pipeline(self.run_dir, which)

    def where_stuck(self):
        """Where each rank was when the job was stopped (stall, deadline) or failed, in pipeline terms: per
        rank its step, the action it is in (or "outside the schedule" with its frame), the microbatch and
        the peer it waits on, then the cause (`labkit.timeline.stuck.Stuck`; print it, or `.text()`).
        Read from the run directory's PP logs, stack dumps and spans; notebook 09."""
        from .diagnose import where_stuck

        return where_stuck(self)

    @classmethod
    def read(cls, run_dir) -> "Run":
        """The `Run` a launch left in `run_dir` (its run.json), e.g. to ask an old run `where_stuck()`."""
        d = Path(run_dir)
        p = d / "run.json"
        if not p.is_file():
            raise ConfigError(f"{d} has no run.json: pass a run directory a labkit launch made (runs/<name>).")
        data = json.loads(p.read_text())
        run = cls(run_dir=d, command=data.get("command", []), nproc=int(data.get("nproc", 1)),
                  status=data.get("status", "running"), returncode=data.get("returncode"),
                  wall_time_s=data.get("wall_time_s", 0.0), failed_rank=data.get("failed_rank"),
                  error=data.get("error"),
                  rank_exitcodes={int(k): v for k, v in (data.get("rank_exitcodes") or {}).items()})
        rp = d / "result.json"
        if rp.is_file():
            try:
                run.result = json.loads(rp.read_text())
            except ValueError:
                pass
        return run

    def summary(self) -> dict:
        """Deterministic facts about the run (no times, paths or pids): safe to print in a tested notebook."""
        r = self.result or {}
        keys = ("schedule", "pp_size", "n_stages", "n_microbatches", "split", "reference_match")
        return {"status": self.status, "returncode": self.returncode, **{k: r[k] for k in keys if k in r}}

    def to_dict(self) -> dict:
        return {
            "run_dir": str(self.run_dir), "command": self.command, "nproc": self.nproc,
            "status": self.status, "returncode": self.returncode, "wall_time_s": self.wall_time_s,
            "failed_rank": self.failed_rank, "error": self.error,
            "rank_exitcodes": {str(k): v for k, v in self.rank_exitcodes.items()},
        }

    def finish(self, started: float) -> None:
        """Wall time, the job's result.json, and run.json written."""
        self.wall_time_s = time.monotonic() - started
        rp = self.run_dir / "result.json"
        if rp.exists():
            try:
                self.result = json.loads(rp.read_text())
            except ValueError:
                self.result = None
        (self.run_dir / "run.json").write_text(json.dumps(self.to_dict(), indent=2))

    def __repr__(self) -> str:
        return (f"Run(status={self.status!r}, returncode={self.returncode}, wall_time_s={self.wall_time_s:.1f}, "
                f"run_dir='{self.run_dir}')")


def unfinished(run_dir) -> str:
    """For a run directory whose job was stopped or failed (its run.json says so): where each rank was,
    in pipeline terms, under a line naming the status (what `labkit timeline RUN_DIR` prints); "" otherwise."""
    if not (Path(run_dir) / "run.json").is_file():
        return ""
    run = Run.read(run_dir)
    if run.status in ("ok", "running"):
        return ""
    head = f"labkit timeline: this run did not finish (status {run.status}"
    head += f"; {run.error.splitlines()[0].split('. Where each rank was')[0]})" if run.error else ")"
    try:
        stuck = run.where_stuck()
        return f"{head}\n{stuck.text()}" if stuck.pipelined else f"{head}: it never ran a pipeline schedule"
    except Exception as e:  # noqa: BLE001 - the timeline is still read
        return f"{head}\n(where the ranks were could not be read: {type(e).__name__}: {e})"


def new_run_dir(out: str | os.PathLike | None = None, name: str = "run",
                runs_root: str | os.PathLike | None = None) -> Path:
    """A fresh run directory. An explicit `out` must not exist yet (or be empty): runs are never overwritten."""
    if out is not None:
        d = Path(out)
        if d.exists() and (not d.is_dir() or any(d.iterdir())):
            raise ConfigError(f"Run directory {d} already exists and is not empty: runs are never overwritten. "
                              f"Pass a new --out path, or delete the old run first.")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"Cannot create run directory {d}: {e.strerror}. "
                              "Pass an --out path you can write to.") from None
        if not os.access(d, os.W_OK):
            raise ConfigError(f"Run directory {d} is not writable. Pass an --out path you can write to.")
        return d
    root = Path(runs_root or os.environ.get("LABKIT_RUNS", DEFAULT_RUNS_ROOT))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:40] or "run"
    for _ in range(100):
        d = root / f"{stamp}-{safe}-{uuid.uuid4().hex[:6]}"
        try:
            d.mkdir(parents=True)  # exist_ok=False: two launches can never share a directory
            return d
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"Cannot create a run directory under {root}: {e.strerror}. Set runs_root= "
                              f"(or $LABKIT_RUNS) to a folder you can write to.") from None
    raise RuntimeError(f"could not create a unique run directory under {root}")
