"""Benchmarks of the kit itself: what it costs and whether its timelines tell the truth.

    python3 scripts/dev.py bench            # full run: bench/results.json + bench/RESULTS.md
    .venv/bin/python scripts/bench.py --quick   # a small, fast subset
    python3 scripts/dev.py bench --only check   # one section alone (here the check's cost), the rest kept

Dev tooling, not part of what a learner imports: it imports labkit, and finds the repository (its
fixtures, notebooks and scripts) from its own place in it, scripts/bench.py. This file runs the steps;
each benchmark lives in scripts/benches/, one module a concern (named in brackets below).

Every figure is a ratio or a fraction measured within one run, with A and B interleaved pair by
pair, because these machines are noisy: never compare absolute times across runs (benches/common.py).
1. launch overhead: a short job through `labkit launch` vs plain `torchrun` (whole processes) [launch];
2. capture overhead: the reference job's step time with PP log capture (+pp, microsecond
   format, to files) vs without, step by step inside each job (with an A/A control), and between
   whole jobs; the profiler between jobs [capture];
3. fidelity: measured vs ideal bubble on the controlled workload, GPipe and 1F1B, several shapes; beside it
   every instrument's bubble on ms-scale real models [fidelity];
4. parser throughput at 10k, 100k, 1M lines (and whether time grows linearly), and the whole
   log -> timeline path beside it [fidelity];
5. the notebook suite under nbval (wall time) [live];
6. span recording (labkit.spans): step time with spans on vs off inside each job (A/A control) [capture]; the
   pipelining logs' and the spans' cost as a user launches, whole jobs in pairs, quiet and loaded
   (`--only as_launched`) [as_launched]; the kit against plain torchrun on one user script, eager and
   compiled, launched and in live ranks, and plain torchrun against itself (how far whole jobs part): step
   time and peak memory (`--only observer`) [observer], and the
   instruments' own cost inside one job, steps in pairs (`--only observer_within`) [observer.within]; the run
   watch, a 100-step run checked every 10 steps against the run alone, and a bug at step 37 named
   (`--only watch`) [watch], and its peak memory with slices= against the step's (`--only watch_memory`)
   [watch_memory];
7. the check's cost: check_step and check_stages beside the step they check, time and peak memory per rank
   [check_cost]; at scale, a 1B-parameter Llama over 4 CPU ranks, on its own (`--only scale`) [check_scale];
8. GPU, when one is present: the tutorial-size preset on one GPU (world size 1, multi-stage schedules)
   [tutorial];
9. ranks started warm (labkit.launching.warm): a fresh 2- and 4-rank job's CPU and wall time by start method
   against plain torchrun, and a live pool's start, fork against spawn (`--only warm`) [warm];
also start-up CPU with the collector paused during torch's imports [launch], live ranks against fresh jobs
[live], the kit's job against the tutorial's program as written [tutorial], and the zero-bubble paper's
bubble rates beside the kit's [paper]. RESULTS.md is written by benches/report.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent  # <repo>/scripts: the benchmarks in benches/ beside this file
if str(HERE) not in sys.path:  # already first when run as a script; not when a test loads this file
    sys.path.append(str(HERE))

# tests/test_bench.py reads the names below as bench.<name>, and clears WARM_UP as bench.common.WARM_UP: in
# benches/common.py, where _pairs and _rounds read it (check_cost reads it there too)
from benches import common  # noqa: E402, F401 (after the path above)
from benches.capture import (_on_off_pairs, capture_overhead, capture_within_jobs,  # noqa: E402, F401
                             spans_within_jobs)
from benches.check_cost import CHECK_HEADING, _check_cost_rows, check_cost  # noqa: E402, F401
from benches.check_scale import SCALE_HEADING, _check_scale_rows, check_scale  # noqa: E402, F401
from benches.as_launched import AS_LAUNCHED_HEADING, _as_launched_rows, as_launched  # noqa: E402, F401
from benches.observer import OBSERVER_HEADING, _observer_rows, observer, within  # noqa: E402, F401
from benches.watch import WATCH_HEADING, _watch_rows, watch_bench  # noqa: E402, F401
from benches.watch_memory import WATCH_MEMORY_HEADING, _watch_memory_rows, watch_memory  # noqa: E402, F401
from benches.common import (BENCH_DIR, REPO_ROOT, _reference_launch, _rounds, _torch,  # noqa: E402, F401
                            _tree_run, _wall_and_cpu, machine)
from benches.fidelity import _fixture_lines, fidelity, instrument_fidelity, parser_throughput  # noqa: E402, F401
from benches.launch import launch_overhead, startup_cost  # noqa: E402
from benches.live import live_ranks, notebook_suite  # noqa: E402
from benches.paper import _paper_rows, paper_comparison  # noqa: E402, F401
from benches.report import (KEPT_HEADING, _capture_detail_rows, _instrument_rows,  # noqa: E402, F401
                            _spans_rows, _startup_rows, kept_notes, markdown)
from benches.tutorial import TUTORIAL_SCRIPT, gpu, tutorial_vs_kit  # noqa: E402, F401
from benches.warm import WARM_HEADING, _warm_rows, _warm_section, warm_start  # noqa: E402, F401


def main(argv=None) -> int:
    """The benchmarks as their steps: every one in turn (or, with --only, those named, into the results
    already there), then results.json and RESULTS.md written and the tables printed."""
    a = parse_args(argv)
    out = Path(a.out)
    res = update_only(out, a.only, a.pairs) if a.only else run_all(quick=a.quick, notebooks=not a.no_notebooks)
    write_results(out, res)
    print(markdown(res))
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small, fast subset (smoke test)")
    ap.add_argument("--no-notebooks", action="store_true")
    ap.add_argument("--out", default=str(BENCH_DIR))
    ap.add_argument("--pairs", type=int, default=15, help="--only launch: how many interleaved pairs (>= 7)")
    ap.add_argument("--only", default=None, choices=["live_ranks", "notebooks", "live_ranks,notebooks", "spans",
                                                      "instruments", "paper", "launch", "startup", "check", "warm",
                                                      "scale", "as_launched", "observer", "observer_within", "watch",
                                                      "watch_memory"],
                    help="measure only these and update them in the existing results (each keeps its own date)")
    return ap.parse_args(argv)


def run_all(quick: bool = False, notebooks: bool = True) -> dict:
    """Every benchmark in turn (`quick`: each at its smallest); results.json's dict, keys in the order measured."""
    import torch

    res: dict = {"machine": machine()["platform"], "machine_detail": machine(), "torch": torch.__version__,
                 "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "quick": quick}
    measure_overheads(res, quick)
    measure_instruments(res)
    measure_startup(res, quick)
    measure_fidelity(res, quick)
    measure_notebooks(res, quick, notebooks)
    measure_comparisons(res, quick)
    measure_check_cost(res, quick)
    measure_warm_start(res, quick)
    measure_gpu(res, quick)
    return res


def _say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def measure_overheads(res: dict, quick: bool) -> None:
    """What the kit adds to a job: launching it, PP log capture and the profiler, span recording."""
    _say("launch overhead")
    lo = launch_overhead(n=1 if quick else 15)
    res["launch_overhead_ratio"], res["launch_overhead"] = lo["ratio"], lo
    _say("capture and profiler overhead")
    co = capture_overhead(n=1 if quick else 3, steps=8 if quick else 80, preset="tiny" if quick else "small",
                          between_jobs=1 if quick else 3, between_steps=4 if quick else 10)
    res["capture_overhead_ratio"], res["profiler_overhead_ratio"] = co["capture"]["ratio"], co["profiler"]["ratio"]
    res["capture_overhead"] = co
    _say("span recording overhead")
    so = spans_within_jobs(n=1 if quick else 3, steps=8 if quick else 80, preset="tiny" if quick else "small")
    res["spans_overhead_ratio"], res["spans_overhead"] = so["spans"]["ratio"], so


def measure_instruments(res: dict) -> None:
    _say("instruments on real models (spans, profiler, logs)")
    res["instrument_fidelity"] = instrument_fidelity()


def measure_startup(res: dict, quick: bool) -> None:
    import torch

    _say("start-up CPU with the collector paused during torch's imports, and without")
    res["startup"] = {**startup_cost(n=1 if quick else 5), "torch": torch.__version__}


def measure_fidelity(res: dict, quick: bool) -> None:
    """Measured against ideal bubble on the controlled workload, and how fast the logs are read."""
    _say("fidelity")
    res["fidelity"] = fidelity(shapes=((2, 4),) if quick else ((2, 2), (2, 4), (2, 8), (4, 4), (4, 8)),
                               fwd_ms=20 if quick else 30, bwd_ms=40 if quick else 60)
    _say("parser throughput")
    pt = parser_throughput((1_000, 10_000) if quick else (10_000, 100_000, 1_000_000))
    res["parser_linearity"] = pt.pop("linearity")
    res["parser_lines_per_s"] = {k: v["lines_per_s"] for k, v in pt.items()}
    res["log_to_timeline_lines_per_s"] = {k: v["timeline_lines_per_s"] for k, v in pt.items()}
    res["parser_detail"] = pt


def measure_notebooks(res: dict, quick: bool, notebooks: bool) -> None:
    if notebooks and not quick:
        _say("notebook suite under nbval")
        res["notebook_suite_s"] = notebook_suite()
    else:
        res["notebook_suite_s"] = None


def measure_comparisons(res: dict, quick: bool) -> None:
    """The kit against another way: warm ranks against fresh jobs, its job against the tutorial's program,
    its simulator and search against the zero-bubble paper."""
    _say("live ranks: a step cell on warm ranks vs a fresh job; an empty cell's round trip")
    res["live_ranks"] = live_ranks(n=2 if quick else 5, round_trips=10 if quick else 50)
    _say("kit's reference job vs the tutorial's program as written (CPU)")
    tk = tutorial_vs_kit(sizes="tiny" if quick else "small", steps=4 if quick else 10, n=1 if quick else 3)
    res["tutorial_vs_kit_ratio"], res["tutorial_vs_kit"] = tk["ratio"], tk
    _say("zero-bubble paper's bubble rates vs the kit's simulator and search")
    res["paper_comparison"] = paper_comparison(search_max_m=0 if quick else 32)


def measure_check_cost(res: dict, quick: bool) -> None:
    _say("the check's cost: check_step and check_stages vs the step, per rank")
    res["check_cost"] = check_cost({"small_lm": {"dim": 64, "n_blocks": 4, "batch": 8, "seq": 16}}, 1, 1) \
        if quick else check_cost()


def measure_warm_start(res: dict, quick: bool) -> None:
    import torch

    _say("ranks started warm: fresh jobs by start method vs plain torchrun; a live pool's start")
    ws, load = _under_load(lambda: warm_start(n=1 if quick else 5, nprocs=(2,) if quick else (2, 4),
                                              pool_pairs=1 if quick else 3))
    res["warm_start"] = {**ws, "torch": torch.__version__, "load": load}


def measure_gpu(res: dict, quick: bool) -> None:
    _say("gpu")
    g = gpu() if not quick else None
    res["gpu"] = g if g is not None else {"available": False, "reason": "no CUDA device on this machine"}


def _under_load(measure) -> tuple[dict, list[float]]:
    """measure()'s result, and the load average at its start and at its end (rounded)."""
    load = os.getloadavg()[0]
    out = measure()
    return out, [round(load, 1), round(os.getloadavg()[0], 1)]


def update_only(out: Path, only: str, pairs: int) -> dict:
    """The results already in `out` with the benchmarks `only` names measured again, each stamped with its
    date (launch, startup, check and warm also with torch's version; launch, check and warm with the load
    average at their start and end)."""
    res = json.loads((out / "results.json").read_text())
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if "live_ranks" in only:
        res["live_ranks"] = {**live_ranks(), "date": stamp}
    if only == "launch":
        lo, load = _under_load(lambda: launch_overhead(n=pairs))
        res["launch_overhead_ratio"], res["launch_overhead"] = lo["ratio"], {
            **lo, "date": stamp, "torch": _torch(), "load": load}
    if only == "startup":
        res["startup"] = {**startup_cost(n=pairs), "date": stamp, "torch": _torch()}
    if "instruments" in only:
        res["instrument_fidelity"], res["instrument_fidelity_date"] = instrument_fidelity(), stamp
    if "spans" in only:
        so = spans_within_jobs()
        res["spans_overhead_ratio"], res["spans_overhead"] = so["spans"]["ratio"], {**so, "date": stamp}
    if only == "check":
        cc, load = _under_load(check_cost)
        res["check_cost"] = {**cc, "date": stamp, "torch": _torch(), "load": load}
    if only == "scale":  # never in a full run: about 18 GB of memory over 4 ranks, minutes of CPU
        cs, load = _under_load(check_scale)
        res["check_scale"] = {**cs, "date": stamp, "torch": _torch(), "load": load}
    if only == "as_launched":  # whole jobs as a user launches them, quiet and beside busy loops
        res["as_launched"] = {**as_launched(), "date": stamp, "torch": _torch()}
    if only == "observer":  # the same user script under the kit and under plain torchrun, quiet and loaded
        res["observer"] = {**observer(), "date": stamp, "torch": _torch(),
                           **({"within": res["observer"]["within"]} if "within" in res.get("observer", {}) else {})}
    if only == "observer_within":  # the instruments' own cost inside one job, steps in pairs
        res.setdefault("observer", {})["within"] = {**within(), "date": stamp, "torch": _torch()}
    if only == "watch":  # a 100-step run checked every 10 steps against the run alone, and a bug at step 37
        res["watch"] = {**watch_bench(), "date": stamp, "torch": _torch()}
    if only == "watch_memory":  # the watch's peak memory with slices= against the step's, per rank
        res["watch_memory"] = {**watch_memory(), "date": stamp, "torch": _torch()}
    if only == "warm":
        ws, load = _under_load(warm_start)
        res["warm_start"] = {**ws, "date": stamp, "torch": _torch(), "load": load}
    if "paper" in only:
        res["paper_comparison"] = {**paper_comparison(), "date": stamp}
    if "notebooks" in only:
        res["notebook_suite_s"], res["notebook_suite_date"] = notebook_suite(), stamp
    return res


def write_results(out: Path, res: dict) -> None:
    """results.json, and RESULTS.md's tables from it above the hand-kept tail of the RESULTS.md already there."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    (out / "RESULTS.md").write_text(markdown(res) + kept_notes(out / "RESULTS.md"))


if __name__ == "__main__":
    sys.exit(main())
