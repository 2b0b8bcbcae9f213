"""What every step of the GPU check shares: the budget, the verdicts, the parts, and the check's record
(`Check`), which prints each verdict as it comes and writes gpu_check.json and report.md after it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # this file is <repo>/scripts/gpu_checks/common.py
BUDGET_S = 540.0           # the whole script, with a margin under the 10 minutes a device command may run
MIN_JOB_S = 20.0           # a launch needs at least this much of the budget left (torch's import, CUDA's start)
PASS, FAIL, SKIPPED, PENDING = "pass", "fail", "skipped", "pending"


@dataclass
class Part:
    """One part of the check and its outcome (a line in the report, an entry in gpu_check.json)."""

    key: str
    title: str
    deadline_s: float
    """Seconds this part may take, its share of a job's start-up included."""
    verdict: str = PENDING
    """pass, fail, skipped (why says why), or pending while it has not concluded"""
    why: str = "not run yet"
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0

    def conclude(self, verdict: str, why: str, seconds: float | None = None, **figures) -> None:
        self.verdict, self.why = verdict, why
        self.figures.update(figures)
        if seconds is not None:
            self.seconds = round(seconds, 1)

    def line(self) -> str:
        return f"[gpu_check] {self.key} ({self.title}): {self.verdict.upper()} - {self.why} [{self.seconds:.1f} s]"


def make_parts() -> dict[str, Part]:
    # 430 s of deadlines in all: with the stops (stacks, a pool restart after a hung cell) the worst case
    # stays within BUDGET_S; a run where nothing hangs takes about a minute on 2 CPU cores
    parts = [Part("1_schedules", "every multi-stage schedule x split, one rank", 90.0),
             Part("2_tutorial", "the tutorial preset, every multi-stage schedule x split", 110.0),
             Part("3_spans", "spans beside the profiler's view of the same actions", 50.0),
             Part("4_live_ranks", "live ranks on one rank: a pipelined step", 60.0),
             Part("5_memory", "the memory tracker against the allocator", 40.0),
             Part("6_observer", "a compiled user script under the kit against plain torchrun", 80.0)]
    return {p.key: p for p in parts}


# ---- the whole check: environment, budget, output ----------------------------------------------------

class Check:
    """The parts, the output folder, the time budget, and what was launched."""

    def __init__(self, out: Path, device: str, budget_s: float):
        self.out, self.device = out, device
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.budget_s = budget_s
        self.parts = make_parts()
        self.env: dict = {}
        self.jobs: list[dict] = []
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def conclude(self, key: str, verdict: str, why: str, seconds: float | None = None, **figures) -> None:
        part = self.parts[key]
        part.conclude(verdict, why, seconds, **figures)
        print(part.line(), flush=True)
        self.save()

    def not_run(self, keys, why: str) -> None:
        for k in keys:
            if self.parts[k].verdict == PENDING:
                self.conclude(k, SKIPPED, f"did not run: {why}", 0.0)

    @property
    def failed(self) -> bool:
        return any(p.verdict == FAIL for p in self.parts.values())

    def to_json(self) -> dict:
        return {"script": "scripts/gpu_check.py", **self.env, "budget_s": self.budget_s,
                "seconds": round(time.monotonic() - self.started, 1), "ok": not self.failed,
                "launches": {"torchrun_jobs": len(self.jobs), "processes": sum(j["processes"] for j in self.jobs),
                             "jobs": self.jobs},
                "parts": [asdict(p) for p in self.parts.values()]}

    def save(self) -> None:
        with self._lock:
            data = self.to_json()
            (self.out / "gpu_check.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
            (self.out / "report.md").write_text(report_text(data))


def report_text(data: dict) -> str:
    """The human report: environment, one row per part, then each part's figures."""
    lines = [f"# GPU check: {data.get('device_name')} ({data.get('device')})", "",
             f"torch {data.get('torch')}, transformers {data.get('transformers') or 'not installed'}, "
             f"Python {data.get('python')}, commit {data.get('commit') or 'unknown'}; "
             f"{data['seconds']:.0f} s of a {data['budget_s']:.0f} s budget; "
             f"{data['launches']['torchrun_jobs']} torchrun jobs ({data['launches']['processes']} processes). "
             f"Rendezvous: {data.get('rendezvous')}.", "",
             "| part | verdict | seconds | why |", "|---|---|---|---|"]
    for p in data["parts"]:
        lines.append(f"| {p['key']} {p['title']} | **{p['verdict']}** | {p['seconds']:.1f} | {p['why']} |")
    lines += ["", f"Overall: {'no part failed' if data['ok'] else 'SOME PART FAILED'}.", ""]
    for p in data["parts"]:
        if p["figures"]:
            lines += [f"## {p['key']}", "", "```json", json.dumps(p["figures"], indent=1, default=str), "```", ""]
    return "\n".join(lines)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
