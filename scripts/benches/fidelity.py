"""Whether the kit's timelines tell the truth, and how fast it reads them: every instrument's bubble fraction
(spans, the profiler, three log readings) on ms-scale real models; measured against ideal (closed form) bubble
on the controlled workload, GPipe and 1F1B at several shapes; the log parser's lines per second on a real
log repeated to 10k-1M lines (best of a few runs; whether time grows linearly), and the whole log -> timeline
path beside it."""

from __future__ import annotations

import tempfile
import time

from .common import REPO_ROOT, _reference_launch


def _readings(run_dir) -> dict:
    """One profiled run's last step read by every instrument: bubble fraction from spans, the profiler,
    and the three log readings (raw: waits folded into the next action; split; trimmed)."""
    from labkit.timeline.compare import load_timeline, one_step
    from labkit.logs import timeline_from_path

    spans = load_timeline(run_dir, "spans")
    steps = spans.meta["steps"]

    def last(tl):
        tl.meta["steps"] = steps  # every reading holds the same steps: keep the last
        return one_step(tl).metrics()["bubble_fraction"]

    out = {"spans": last(spans), "profiler": last(load_timeline(run_dir, "profiler")),
           "logs raw": last(timeline_from_path(run_dir, waits="fold")),
           "logs split": last(timeline_from_path(run_dir, waits="split")),
           "logs trimmed": last(timeline_from_path(run_dir, waits="trim"))}
    return {k: round(v, 4) for k, v in out.items()}


def instrument_fidelity(steps: int = 3) -> list[dict]:
    """The instruments on ms-scale real models (issue: exact timelines): the tiny tutorial Transformer
    (1F1B and Interleaved1F1B, `labkit run --profile`) and a learner-sized MLP (scripts/mlp_pipeline.py,
    hidden 256 and 4096, through `labkit launch`), each one profiled job: every reading of its last step."""
    from labkit import RunConfig
    from labkit.launching.launch import launch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in ("1F1B", "Interleaved1F1B"):
            cfg = RunConfig(schedule=schedule, preset="tiny", steps=steps, profile=True, device="cpu")
            r = _reference_launch(cfg, tmp)
            rows.append({"model": "tutorial Transformer (tiny)", "schedule": schedule, **_readings(r.run_dir)})
        for hidden in (256, 4096):
            r = launch(REPO_ROOT / "scripts" / "mlp_pipeline.py", ["--hidden", str(hidden), "--steps", str(steps),
                                                                  "--profile"],
                       nproc=2, runs_root=tmp, progress=False, stream="none")
            rows.append({"model": f"MLP 64-{hidden}-64", "schedule": "1F1B", **_readings(r.run_dir)})
    return rows


def fidelity(shapes=((2, 2), (2, 4), (2, 8), (4, 4), (4, 8)), schedules=("GPipe", "1F1B"),
             fwd_ms: float = 30, bwd_ms: float = 60) -> list[dict]:
    """Measured (spans, the kit's default reading) vs ideal (closed form) bubble on the controlled workload."""
    from labkit.timeline.compare import measured_vs_ideal
    from labkit.theory import closed_form_bubble
    from labkit.models.workload import WorkloadConfig
    from labkit.launching.controlled import run_controlled

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in schedules:
            for p, m in shapes:
                if schedule == "1F1B" and m < p:
                    continue  # torch refuses 1F1B with fewer microbatches than stages
                cfg = WorkloadConfig(schedule=schedule, pp_size=p, n_microbatches=m, fwd_ms=fwd_ms, bwd_ms=bwd_ms)
                r = run_controlled(cfg, runs_root=tmp, progress=False, stream="none")
                _, _, s = measured_vs_ideal(r.run_dir)
                rows.append({"schedule": schedule, "pp_size": p, "n_microbatches": m,
                             "measured_bubble": round(s["measured_bubble_fraction"], 4),
                             "ideal_bubble": round(closed_form_bubble(p, m), 4),
                             "fitted_ideal_bubble": round(s["ideal_bubble_fraction"], 4)})
    return rows


def _fixture_lines() -> list[str]:
    fx = sorted((REPO_ROOT / "tests" / "fixtures" / "pplogs").glob("*/ZBVZeroBubble-p4-m8/**/stderr.log"))
    if not fx:
        fx = sorted((REPO_ROOT / "tests" / "fixtures" / "pplogs").glob("**/stderr.log"))
    return fx[0].read_text().splitlines()


def parser_throughput(sizes=(10_000, 100_000, 1_000_000), repeats: int = 3) -> dict:
    """Lines per second of the parser (`parse_lines`) on a real log repeated (times shifted) to each
    size, and of the whole log -> timeline path (`parse_lines` + `to_timeline`) beside it.

    Best of `repeats` runs per size (as `timeit` does: on a shared machine noise only ever adds time).
    """
    import gc

    from labkit.logs import parse_lines, to_timeline

    base = [l for l in _fixture_lines() if l[:1].isdigit()]
    t0 = float(base[0].split(" ", 1)[0])
    span = float(base[-1].split(" ", 1)[0]) - t0 + 0.01
    out = {}
    for n in sizes:
        lines = []
        k = 0
        while len(lines) < n:
            shift = k * span
            lines += [f"{float(l.split(' ', 1)[0]) + shift:.6f} {l.split(' ', 1)[1]}\n" for l in base]
            k += 1
        lines = lines[:n]
        parse_s = total_s = float("inf")
        for _ in range(repeats):
            gc.collect()  # the previous repeat's events go before the clock starts
            t = time.perf_counter()
            events = parse_lines(lines, rank=0)
            t1 = time.perf_counter()
            tl = to_timeline(events)
            t2 = time.perf_counter()
            parse_s, total_s = min(parse_s, t1 - t), min(total_s, t2 - t)
            n_actions = len(tl.actions)
            events = tl = None
        out[str(n)] = {"lines_per_s": n / parse_s, "seconds": parse_s, "timeline_lines_per_s": n / total_s,
                       "timeline_seconds": total_s, "actions": n_actions, "repeats": repeats}
    sizes_sorted = sorted(out, key=int)
    small, big = out[sizes_sorted[0]], out[sizes_sorted[-1]]
    out["linearity"] = (big["seconds"] / int(sizes_sorted[-1])) / (small["seconds"] / int(sizes_sorted[0]))
    return out
