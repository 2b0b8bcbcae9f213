"""What the instruments cost the step they watch: PP log capture (TORCH_LOGS=+pp, the kit's microsecond
format, to files) and span recording (labkit.spans), each turned on and off step by step inside the reference
job (`--log-ab`, `--spans-ab`) with an A/A control, capture also between whole jobs, and the profiler
between whole jobs. Step-time ratios, on over off."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile

from .common import _pairs, _ratio, _reference_launch, _spread


def _on_off_pairs(step_times: list[float], on: list[bool], skip: int = 2) -> list[float]:
    """Step-time ratios (logging step / silent step) of the step pairs (skip, skip+1), ... of one job."""
    ratios = []
    for i in range(skip, len(step_times) - 1, 2):
        if on[i] == on[i + 1]:
            raise ValueError(f"steps {i} and {i + 1} both have PP logs {'on' if on[i] else 'off'}: not an A/B pair")
        logging_step, silent_step = (i, i + 1) if on[i] else (i + 1, i)
        ratios.append(step_times[logging_step] / step_times[silent_step])
    return ratios


def _reference_job(cfg, pp_logs: bool, extra: list[str]) -> dict:
    """result.json of one run of the reference job (quiet, in a throw-away folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _reference_launch(cfg, tmp, extra, pp_logs=pp_logs).result


def _capture_config(preset: str, steps: int):
    """The capture and profiler benchmarks' job: 1F1B, 2 ranks, 4 microbatches."""
    from labkit.config.run import RunConfig

    return RunConfig(schedule="1F1B", pp_size=2, n_microbatches=4, preset=preset, steps=steps)


def capture_within_jobs(n: int = 3, steps: int = 80, preset: str = "small") -> dict:
    """PP log capture's cost step by step inside each job (1F1B, 2 ranks, 4 microbatches).

    Under TORCH_LOGS=+pp (the kit's microsecond format, to the rank's log files) the reference
    script's `--log-ab` turns the pipelining logger on and off between steps, in pairs
    (worker.pp_logs_on_step); `capture` is the median of (logging step / silent step) over every
    pair of n jobs. `control` runs the same jobs without TORCH_LOGS (an A/A test: the ratio that
    noise alone gives). Jobs of the two kinds alternate.
    """
    cfg = _capture_config(preset, steps)

    def in_job(pp_logs: bool) -> list[float]:
        r = _reference_job(cfg, pp_logs, ["--log-ab"])
        return _on_off_pairs(r["step_time_s"], r["step_pp_logs"])

    logged, control = _pairs(lambda: in_job(True), lambda: in_job(False), n)
    return {"capture": {**_spread([x for ps in logged for x in ps]), "method": "within jobs, step pairs",
                        "jobs": n, "steps": steps},
            "control": {**_spread([x for ps in control for x in ps]), "method": "same jobs without TORCH_LOGS (A/A)"}}


def spans_within_jobs(n: int = 3, steps: int = 80, preset: str = "small") -> dict:
    """Span recording's cost step by step inside each job (labkit.spans; 1F1B, 2 ranks, 4 microbatches).

    The reference job's `--spans-ab` turns recording on and off between steps in the same pairs as
    the capture A/B, without PP logs (spans alone); `spans` is the median of (recording step / silent
    step) over every pair of n jobs; `control` is the A/A test of the capture benchmark's kind (the
    same jobs, recording off on both sides of each pair)."""
    cfg = _capture_config(preset, steps)

    def in_job(ab: bool) -> list[float]:
        r = _reference_job(cfg, False, ["--spans-ab"] if ab else [])
        on = r.get("step_spans") or [worker_pairs(i) for i in range(len(r["step_time_s"]))]
        return _on_off_pairs(r["step_time_s"], on)

    rec, control = _pairs(lambda: in_job(True), lambda: in_job(False), n)
    return {"spans": {**_spread([x for ps in rec for x in ps]), "method": "within jobs, step pairs",
                      "jobs": n, "steps": steps},
            "control": {**_spread([x for ps in control for x in ps]), "method": "same jobs, no recording (A/A)"}}


def worker_pairs(step: int) -> bool:
    """The step pairing of the in-job A/B (labkit.worker.distributed.pp_logs_on_step), for the A/A control."""
    from labkit.worker.distributed import pp_logs_on_step

    return pp_logs_on_step(step)


def capture_overhead(n: int = 3, steps: int = 80, preset: str = "small", between_jobs: int = 3,
                     between_steps: int = 10) -> dict:
    """PP log capture's cost on the reference job's step time, and the profiler's.

    `capture` and `control` (the figure with the target, and its A/A test): capture_within_jobs.
    Steps of one job share the machine's mood; two jobs in a row do not (their median step times
    differ by up to +-10% here with nothing changed), so `between_jobs`, whole jobs with vs without
    capture pair by pair, is reported beside it and mostly measures that. profiler: between jobs.
    """
    within = capture_within_jobs(n, steps, preset)
    cfg = _capture_config(preset, between_steps)
    step_time = lambda pp_logs, profile=False: statistics.median(
        _reference_job(dataclasses.replace(cfg, profile=profile), pp_logs, [])["step_time_s"][1:])  # step 1 warms up
    logs, none_a = _pairs(lambda: step_time(True), lambda: step_time(False), between_jobs)
    prof, none_b = _pairs(lambda: step_time(False, True), lambda: step_time(False), between_jobs)
    return {**within,
            "between_jobs": {**_ratio(logs, none_a), "steps": between_steps},
            "profiler": {**_ratio(prof, none_b), "steps": between_steps}, "preset": preset}
