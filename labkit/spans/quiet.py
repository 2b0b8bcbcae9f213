"""When a timing may be compared: the quiet-baseline rule, stated once.

A bound asserted on a timing (a busy machine descheduled the ranks more than a quiet one; the
measured speed-up stays below its bound) is only true of a machine that gave the baseline its cores:
a learner's laptop is never idle, and CI runs beside another test worker. The spans say how busy the
machine was at every step's end (`labkit.spans.read.machine_load`): the processes runnable, the
load average, and the share of the step the rank's thread was runnable without a CPU. A baseline is
QUIET when, over its steps (medians):

- at most one runnable thread more than the cores (the ranks' own included: 2 on an idle 2-core
  machine, 4-5 beside one busy process per core);
- a load average of at most 2 per core + 2;
- at most a quarter of a step descheduled (`QUIET_SHARE`).

Otherwise a comparison is not made, and the reading says why (`Quiet.text`). Used by notebook 06b's
checks and tests/test_load.py; `labkit.timeline.explain_slowdown` reads it from the before side's steps
and says a verdict given on a busy baseline is one (`quiet_from_loads`).

May import: labkit.core."""

from __future__ import annotations

import os
from dataclasses import dataclass
from statistics import median

QUIET_SHARE = 0.25


@dataclass(frozen=True)
class Quiet:
    """How busy the machine was for a baseline's steps, and whether that is quiet (the rule above)."""

    runnable: float
    load1: float
    descheduled: float
    cores: int

    @property
    def ok(self) -> bool:
        return (self.runnable <= self.cores + 1 and self.load1 <= 2 * self.cores + 2
                and self.descheduled <= QUIET_SHARE)

    def figures(self) -> str:
        """What the rule read, in words (without the verdict)."""
        return (f"{self.runnable:g} runnable at the steps' ends on {self.cores} cores, load average "
                f"{self.load1:.2f}, descheduled {self.descheduled:.1%} of the steps")

    def text(self) -> str:
        what = "a quiet baseline: compared" if self.ok else \
            "no quiet baseline (something else kept the machine busy): not compared"
        return f"{self.figures()}: {what}"


def quiet_baseline(timelines, cores: int | None = None) -> Quiet:
    """The rule read from spans timelines (`labkit.spans.timeline_from_spans`, a live cell's or a run's
    steps): the medians over their steps and ranks. A timeline without scheduler clocks (no
    `machine_load`: older files, CUDA) gives no reading: not quiet, said so by `Quiet.text`'s figures."""
    cores = cores or os.cpu_count() or 1
    reading = quiet_from_loads([tl.meta.get("machine_load", {}) for tl in timelines], cores)
    return reading or Quiet(float("inf"), float("inf"), 1.0, cores)


def quiet_from_loads(loads: list[dict], cores: int | None = None) -> Quiet | None:
    """The rule read from `machine_load` readings ({rank: ...} each, `labkit.spans.read.machine_load`),
    None where they hold none (no scheduler clocks). `cores`: the cores they were recorded on by
    default (else this machine's). What `quiet_baseline` and `labkit.timeline.explain_slowdown` read."""
    every = [v for per_rank in loads for v in (per_rank or {}).values()]
    runnable = [n for v in every for n in v.get("runnable", []) if n is not None]
    load1 = [n for v in every for n in v.get("load1", []) if n is not None]
    shares = [v["descheduled_in_steps_s"] / v["step_s"] for v in every if v.get("step_s")]
    if not (runnable and load1 and shares):
        return None
    cores = cores or next((v["cores"] for v in every if v.get("cores")), None) or os.cpu_count() or 1
    return Quiet(median(runnable), median(load1), median(shares), cores)
