"""Smoke tests of the benchmark pieces in scripts/bench.py (structure and sanity, never timed asserts)."""

import importlib.util
import statistics
from collections import Counter
from pathlib import Path

import pytest

from labkit.worker.distributed import pp_logs_on_step

REPO = Path(__file__).resolve().parent.parent


def _load_bench():
    """scripts/bench.py is dev tooling, not part of the package: import it from its file."""
    spec = importlib.util.spec_from_file_location("pplab_bench", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
bench.common.WARM_UP = False  # these tests check structure, never timings: the warm-up runs only cost CI time


def test_bench_finds_the_repository_from_its_own_path():
    assert bench.REPO_ROOT == REPO and bench.BENCH_DIR == REPO / "bench"
    assert bench.TUTORIAL_SCRIPT.is_file() and bench._fixture_lines()


def test_parser_throughput_structure():
    out = bench.parser_throughput((2_000, 4_000))
    assert set(out) == {"2000", "4000", "linearity"}
    assert out["4000"]["lines_per_s"] > 0 and out["4000"]["actions"] > out["2000"]["actions"] > 0
    # the log -> timeline path includes the parse, so it is never faster than the parse alone
    assert 0 < out["4000"]["timeline_lines_per_s"] <= out["4000"]["lines_per_s"]


@pytest.mark.launches
def test_launch_overhead_runs_both_commands():
    out = bench.launch_overhead(n=1)
    assert out["ratio"] > 0 and len(out["pair_ratios"]) == 1
    # the kit's own time outside torchrun: real (an interpreter starts), and a small part of the run
    assert 0 < out["kit_outside_torchrun_s"] < out["a_median_s"]
    assert out["pair_ratio_iqr"][0] <= out["ratio"] <= out["pair_ratio_iqr"][1]


def _minimal_results(**over) -> dict:
    return {"machine": "m", "machine_detail": {"cpus": 2}, "torch": "t", "date": "d",
            "launch_overhead_ratio": 1.0, "capture_overhead_ratio": 1.0, "profiler_overhead_ratio": 1.2,
            "fidelity": [], "parser_lines_per_s": {}, "parser_linearity": 1.0, "notebook_suite_s": None,
            "gpu": {"available": False, "reason": "none"}, **over}


def test_notebook_suite_rows_compare_with_the_suite_before_live_ranks():
    md = bench.markdown(_minimal_results(notebook_suite_s=125.0))
    assert "| 125 s |" in md and "| 2.00x faster | >= 1.5x | yes |" in md
    assert "| 1.25x faster | >= 1.5x | no |" in bench.markdown(_minimal_results(notebook_suite_s=200.0))


@pytest.mark.launches
def test_fidelity_row_and_table():
    rows = bench.fidelity(shapes=((2, 2),), schedules=("GPipe",), fwd_ms=20, bwd_ms=40)
    assert rows[0]["ideal_bubble"] == round(1 / 3, 4) and 0 <= rows[0]["measured_bubble"] < 1
    res = {"machine": "m", "machine_detail": {"cpus": 2}, "torch": "t", "date": "d",
           "launch_overhead_ratio": 1.0, "capture_overhead_ratio": 1.0, "profiler_overhead_ratio": 1.2,
           "fidelity": rows, "parser_lines_per_s": {"10000": 6e5}, "parser_linearity": 1.0,
           "notebook_suite_s": None, "gpu": {"available": False, "reason": "none"}}
    md = bench.markdown(res)
    assert "| GPipe | 2 | 2 |" in md and "launch overhead" in md


@pytest.mark.launches
def test_tutorial_as_written_vs_kit_script():
    """Both programs run for real (tiny sizes, CPU) and give a step-time ratio; the table shows it."""
    out = bench.tutorial_vs_kit(sizes="tiny", steps=3, n=1)
    assert out["ratio"] > 0 and out["a_median_s"] > 0 and out["b_median_s"] > 0
    assert (out["sizes"], out["device"]) == ("tiny", "cpu")
    res = {"machine": "m", "machine_detail": {"cpus": 2}, "torch": "t", "date": "d",
           "launch_overhead_ratio": 1.0, "capture_overhead_ratio": 1.0, "profiler_overhead_ratio": 1.2,
           "fidelity": [], "parser_lines_per_s": {}, "parser_linearity": 1.0, "notebook_suite_s": None,
           "tutorial_vs_kit": out, "gpu": {"available": False, "reason": "none"}}
    assert f"| {out['ratio']:.3f}x |" in bench.markdown(res)


def test_on_off_pairs_put_the_logging_step_on_top_whatever_the_order():
    times = [9.0, 9.0, 1.1, 1.0, 2.0, 2.2, 3.3, 3.0]
    on = [pp_logs_on_step(i) for i in range(8)]  # on off off on on off off on
    assert on == [True, False, False, True, True, False, False, True]
    # pairs (2,3) and (4,5), (6,7): the warm-up pair (0,1) is left out
    assert bench._on_off_pairs(times, on) == pytest.approx([1.0 / 1.1, 2.0 / 2.2, 3.0 / 3.3])
    with pytest.raises(ValueError, match="not an A/B pair"):
        bench._on_off_pairs(times, [True] * 8)


@pytest.mark.launches
def test_log_ab_switches_torchs_pipelining_logger_step_by_step(runs):
    """The in-job capture A/B is real: the rank logs hold the PP lines of the logging steps only
    (steps 0 and 3 of 4: 2 steps x 4 microbatches forwards per stage), and step times for all."""
    from labkit.config.run import RunConfig
    from labkit.logs import timeline_from_path
    from labkit.spans import timeline_from_spans

    cfg = RunConfig(schedule="1F1B", pp_size=2, n_microbatches=4, preset="tiny", steps=4)
    r = bench._reference_launch(cfg, runs, ["--log-ab", "--spans-ab"])
    assert r.result["step_pp_logs"] == [True, False, False, True] and len(r.result["step_time_s"]) == 4
    tl = timeline_from_path(r.run_dir)
    forwards = Counter(a.stage for a in tl.compute() if a.kind == "F")
    assert forwards == {0: 2 * 4, 1: 2 * 4}, forwards
    # the span-overhead A/B, in the same job: spans of the recording steps only
    assert r.result["step_spans"] == [True, False, False, True]
    spans = timeline_from_spans(r.run_dir)
    assert spans.meta["steps"] == 2 and Counter(a.stage for a in spans.compute() if a.kind == "F") == forwards
    rows = "\n".join(bench._spans_rows({"spans": {"ratio": 1.01, "pair_ratios": [1.01], "jobs": 1, "steps": 4},
                                        "control": {"ratio": 1.0, "pair_ratios": [1.0]}}))
    assert "span recording overhead" in rows and "1.010x | <= 1.03x | yes" in rows


@pytest.mark.launches
def test_capture_overhead_within_jobs_and_its_table_rows():
    out = bench.capture_within_jobs(n=1, steps=6, preset="tiny")
    # 6 steps: pairs (2,3), (4,5) of the one measured job (the warm-up job is left out)
    assert len(out["capture"]["pair_ratios"]) == 2 and len(out["control"]["pair_ratios"]) == 2
    assert all(x > 0 for x in out["capture"]["pair_ratios"] + out["control"]["pair_ratios"])
    co = {**out, "between_jobs": {"ratio": 1.1, "pair_ratios": [1.1]}}
    rows = "\n".join(bench._capture_detail_rows(co))
    assert "A/A control" in rows and "median of 2 step pairs" in rows and "1.100x" in rows


@pytest.mark.launches
def test_live_ranks_bench_measures_a_real_cell_and_a_real_job():
    """Both sides really run the step: each asserts its timeline holds 4 F and 4 B per stage."""
    out = bench.live_ranks(n=1, round_trips=3)
    assert len(out["pair_ratios"]) == 1 and out["fresh_job_median_s"] > out["cell_median_s"] > 0
    assert 0 < out["empty_cell_median_ms"] <= out["empty_cell_max_ms"]
    row = bench.markdown({**_minimal_results(), "live_ranks": out})
    assert "live ranks: fresh 2-rank job / a cell on 2 warm ranks" in row and "empty cell's round trip" in row


@pytest.mark.launches
def test_startup_bench_measures_cpu_with_the_collector_paused_and_not():
    """Structure only (one pair, the agent: the cheapest kind); the ratio is the bench's to report."""
    out = bench.startup_cost(n=1, kinds=("agent",))
    assert set(out) == {"agent"} and out["agent"]["a_median_s"] > 0 and out["agent"]["b_median_s"] > 0
    row = "\n".join(bench._startup_rows({**out, "date": "2026-11-26 00:00 UTC", "torch": "2.15.0"}))
    assert "torchrun's agent start-up" in row and "median of 1 pairs; measured 2026-11-26 00:00 UTC, torch 2.15.0" in row
    assert bench._startup_rows(None) == []


def test_the_instruments_table_shows_each_reading_with_its_error_against_spans():
    rows = [{"model": "MLP 64-256-64", "schedule": "1F1B", "spans": 0.5, "profiler": 0.49, "logs raw": 0.1,
             "logs split": 0.3, "logs trimmed": 0.6}]
    text = "\n".join(bench._instrument_rows(rows))
    assert "| MLP 64-256-64 | 1F1B | 0.500 | 0.490 (-0.010) | 0.100 (-0.400) | 0.300 (-0.200) | 0.600 (+0.100) |" in text
    assert bench._instrument_rows(None) == []


def test_the_paper_table_puts_the_papers_rate_beside_the_kits():
    """The zero-bubble paper's Table 5 beside the kit's simulation; searched columns only where searched."""
    out = bench.paper_comparison(search_max_m=0)  # no search: simulations only (seconds)
    assert "2401.10241" in out["citation"] and len(out["rows"]) == 12
    text = "\n".join(bench._paper_rows(out))
    assert "| 1.5B | 8 | 24 | 0.2431 / 0.2431 | 0.1585 / 0.1585 | 0.1083 / 0.1083 | 0.1585 / - | 0.0433 / - | 0.1055 |" in text
    assert bench._paper_rows(None) == []


def test_rewriting_results_keeps_the_hand_kept_figures(tmp_path):
    """RESULTS.md's tail from KEPT_HEADING on (figures the modules cite) survives a bench run's rewrite."""
    path = tmp_path / "RESULTS.md"
    assert bench.kept_notes(path) == ""
    path.write_text("# old tables\n\n" + bench.KEPT_HEADING + "\n\n### labkit/x.py\n\n1.5 s\n")
    assert bench.kept_notes(path) == "\n" + bench.KEPT_HEADING + "\n\n### labkit/x.py\n\n1.5 s\n"
    repo_results = REPO / "bench" / "RESULTS.md"
    assert "### labkit/core/startup.py" in bench.kept_notes(repo_results)


def _phase(s: float, mb: int, cpu: float | None = None, **kw) -> dict:
    return {"s": s, "cpu_s": s if cpu is None else cpu, "peak_bytes": mb * 2 ** 20, **kw}


def test_the_checks_cost_table_reads_each_check_against_the_step():
    """One row per model and rank: time and peak beside the step's (x step), and the failing checks' extra."""
    rank = {"held_bytes": {"stage": 12 * 2 ** 20, "full": 24 * 2 ** 20, "slice": 12 * 2 ** 20},
            "step": _phase(0.5, 50), "check_step": _phase(3.0, 500, passed=3),
            "check_stages": _phase(3.0, 250, cpu=1.5, passed=3),
            "failing": {"step": _phase(0.5, 50), "check_step": _phase(5.0, 1500, passed=0),
                        "check_stages": _phase(4.0, 1000, passed=0)}}
    cc = {"models": [{"model": "small_lm", "dim": 256, "n_blocks": 8, "batch": 16, "seq": 64, "microbatches": 4,
                      "ranks": {"0": rank, "1": rank}}], "repeats": 3, "failing": 1}
    text = "\n".join(bench._check_cost_rows(cc))
    assert f"## {bench.CHECK_HEADING}" in text and "VmHWM" in text
    assert ("| small_lm | 0 | 12 MB / 24 MB / 12 MB | 0.50 s (CPU 0.50 s), 50 MB | 3.00 s (6.0x; CPU 3.00 s), "
            "500 MB (10.0x) | 3.00 s (6.0x; CPU 1.50 s), 250 MB (5.0x) | +2.00 s (CPU +2.00 s), 1500 MB | "
            "+1.00 s (CPU +2.50 s), 1000 MB |") in text
    assert "its peak was 0.5x of check_step's and its CPU time 0.5x" in text and "Failing (one round" in text
    assert bench._check_cost_rows(None) == [] and "| - | - |" in "\n".join(
        bench._check_cost_rows({**cc, "failing": 0, "models": [{**cc["models"][0], "ranks": {"0": {
            k: v for k, v in rank.items() if k != "failing"}}}]}))


@pytest.mark.launches
def test_the_checks_cost_runs_both_checks_on_a_real_step():
    """On 2 warm ranks: a tiny small_lm's step, both checks passing, then failing with the planted bug."""
    out = bench.check_cost({"small_lm": {"dim": 32, "n_blocks": 2, "batch": 8, "seq": 8}}, repeats=1, failing=1)
    r0 = out["models"][0]["ranks"]["0"]
    assert r0["check_step"]["passed"] == 1 and r0["failing"]["check_stages"]["passed"] == 0
    assert r0["held_bytes"]["full"] > r0["held_bytes"]["slice"] and r0["check_step"]["s"] > 0


def test_tree_run_counts_the_cpu_of_an_orphan_nobody_waited_for():
    """A grandchild left running when its parent ends (as a forkserver is when torchrun's agent ends) is
    reparented to the bench, waited for, and its CPU counted; RUSAGE_CHILDREN alone would miss it."""
    import sys

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    parent = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}])"
    wall, cpu = bench._tree_run([sys.executable, "-c", parent], None)
    assert cpu >= 0.4 and wall > 0


def test_rounds_run_every_side_once_a_round_in_alternating_order():
    calls = []
    sides = {k: (lambda k=k: calls.append(k) or len(calls)) for k in ("plain", "fork", "spawn")}
    out = bench._rounds(sides, 3, {"spawn": 2})
    assert calls == ["plain", "fork", "spawn", "spawn", "fork", "plain", "plain", "fork"]
    assert out == {"plain": [1, 6, 7], "fork": [2, 5, 8], "spawn": [3, 4]}
    # a side in fewer rounds is paired with the others' runs of the same rounds
    pair = bench._wall_and_cpu([(1.0, 2.0), (1.0, 2.0)], [(2.0, 8.0), (4.0, 8.0), (9.0, 9.0)])
    assert pair["wall"]["pair_ratios"] == [0.5, 0.25] and pair["cpu"]["ratio"] == 0.25


def _ratio_of(a: float, b: float) -> dict:
    return {"ratio": a / b, "pair_ratios": [a / b], "a_median_s": a, "b_median_s": b}


def test_the_warm_start_rows_hold_the_4_rank_goal_and_every_start_method():
    jobs = {n: {m: {"cpu": _ratio_of(c, 20.0), "wall": _ratio_of(w, 10.0)} for m, c, w in
                (("fork", 6.0, 4.0), ("forkserver", 9.0, 7.0), ("spawn", 21.0, 11.0))} for n in ("2", "4")}
    ws = {"jobs": jobs, "pools": {"2": {"cpu": _ratio_of(3.0, 12.0), "wall": _ratio_of(2.0, 8.0),
                                        "methods": ["fork", "spawn"]}},
          "rounds": 5, "spawn_rounds": 4, "date": "2026-11-28 00:00 UTC", "torch": "2.15.0", "load": [1.0, 1.5]}
    rows = "\n".join(bench._warm_rows(ws))
    assert "a fresh 4-rank job, labkit launch (fork) / plain torchrun, CPU" in rows
    assert "| 0.30x | <= 0.4x | yes |" in rows and "| 0.40x | <= 0.6x | yes |" in rows
    assert "measured 2026-11-28 00:00 UTC, torch 2.15.0, load average 1.0 at the start, 1.5 at the end" in rows
    text = "\n".join(bench._warm_section(ws))
    assert f"## {bench.WARM_HEADING}" in text and "5 rounds (4 for spawn)" in text
    assert "| 4-rank job | labkit launch, fork / plain torchrun | 6.0 s / 20.0 s = **0.30x** | 4.0 s / 10.0 s = " \
           "**0.40x** | 1 | <= 0.4x / <= 0.6x | yes / yes |" in text
    assert "| 2-rank live pool's start | fork / spawn | 3.0 s / 12.0 s = **0.25x** |" in text
    assert "The least CPU: fork at every size." in text and "is met" in text
    assert "The better start method: fork, on both counts at every size." in text
    md = bench.markdown({**_minimal_results(), "warm_start": ws})
    assert rows in md and bench.WARM_HEADING in md
    assert bench._warm_rows(None) == [] and bench._warm_section(None) == []


@pytest.mark.launches
def test_warm_start_measures_a_fresh_job_and_a_pools_start():
    """Structure only: one round at 2 ranks with a forkserver (whose server outlives the agent) and a
    pool's start, fork against spawn."""
    out = bench.warm_start(n=1, nprocs=(2,), methods=("forkserver",), pool_pairs=1)
    r = out["jobs"]["2"]["forkserver"]
    assert r["cpu"]["a_median_s"] > 0 and r["cpu"]["b_median_s"] > 0 and r["wall"]["b_median_s"] > 0
    assert out["pools"]["2"]["methods"] == ["fork", "spawn"] and out["pools"]["2"]["wall"]["a_median_s"] > 0


def test_the_check_at_scale_rows_read_each_rank_against_its_step():
    """RESULTS.md's section of the 1B-parameter check: a row per rank, the ratio to the step, check_step's refusal."""
    rank = {"whole_params": 1_000_000_000, "stage_params": 250_000_000, "ok": True, "compared": 1000, "expected": 1000,
            "step": _phase(10.0, 1000), "check_stages": _phase(60.0, 2000),
            "check_step_refused": "check_step needs at least 26.00 GiB on each rank for this model: check this step"}
    cs = {**bench.check_scale.__defaults__[0], "ranks": {str(r): rank for r in range(4)}, "date": "d", "torch": "t"}
    text = "\n".join(bench._check_scale_rows(cs))
    assert f"## {bench.SCALE_HEADING}" in text and "1.00B parameters" in text
    assert "| 0 | 250M | 10.0 s, 1000 MB | 60.0 s, 2000 MB (2.0x) | True |" in text
    assert "the check passed with every parameter compared; its peak was 2.0-2.0x" in text
    assert "refuses before it starts: \"check_step needs at least 26.00 GiB" in text
    assert bench._check_scale_rows(None) == []


def test_the_instruments_as_launched_rows_say_each_condition():
    """RESULTS.md's section of the instruments' cost as a user launches: a row per instrument and machine."""
    summary = {"median": 1.05, "min": 0.98, "max": 1.2, "slower_in": 4, "ratios": [1.05] * 5}
    al = {"pairs": 5, "steps": 20, "model": "m", "quiet": {"pp_logs": summary, "spans": summary, "load": [0.3, 0.5]},
          "loaded": {"pp_logs": summary, "spans": summary, "load": [2.1, 2.4]}}
    text = "\n".join(bench._as_launched_rows(al))
    assert f"## {bench.AS_LAUNCHED_HEADING}" in text
    assert "| pipelining logs (+pp) | quiet (load 0.3-0.5) | 1.050x | 0.980-1.200x | 4 of 5 |" in text
    assert "| span recording | loaded (load 2.1-2.4) | 1.050x |" in text and bench._as_launched_rows(None) == []


def test_the_observer_rows_say_each_way_and_condition():
    """RESULTS.md's section of the kit against plain torchrun: a row per way of running and machine,
    step and peak memory each as a median with its range."""
    s = {"median": 1.01, "min": 0.97, "max": 1.04, "ratios": [1.01] * 5}
    p = {"median": 0.64, "min": 0.63, "max": 0.66, "ratios": [0.64] * 5}
    row = {w: {"step": s, "peak": p} for w in ("launch eager", "launch compiled", "live ranks eager")}
    ob = {"pairs": 5, "compiled_pairs": 3, "steps": 20, "model": "m", "quiet": {**row, "load": [0.3, 0.5]},
          "loaded": {**row, "load": [2.1, 2.4]}}
    text = "\n".join(bench._observer_rows(ob))
    assert f"## {bench.OBSERVER_HEADING}" in text
    assert "| launch compiled | no busy loop (load 0.3-0.5) | 1.010x (0.970-1.040) | - | - | 0.640x (0.630-0.660) |" in text
    ob["quiet"]["launch eager"] = {**row["launch eager"], "cpu": s, "step": {**s, "ci95": [0.99, 1.035]}}
    assert ("| launch eager | no busy loop (load 0.3-0.5) | 1.010x (0.970-1.040) | 0.990-1.035 | 1.010x (0.970-1.040) | "
            "0.640x") in "\n".join(bench._observer_rows(ob))
    assert "| live ranks eager | a busy loop a core (load 2.1-2.4) |" in text and bench._observer_rows(None) == []
    assert "against itself" not in text.split("\n\n| the kit |")[1]  # not measured: no row
    from benches.observer import AA
    ob["quiet"][AA] = row["launch eager"]
    text = "\n".join(bench._observer_rows(ob))
    assert ("| plain torchrun against itself | no busy loop (load 0.3-0.5) | 1.010x (0.970-1.040) |" in text
            and "plain torchrun against itself | a busy loop" not in text)


def test_the_observer_section_says_the_instruments_cost_inside_one_job():
    """Under the observer's table: each way's step and CPU with every instrument on over off, pairs of steps in one
    job, and the step with them off."""
    s = {"median": 1.01, "min": 0.97, "max": 1.04, "ratios": [1.01] * 5}
    row = {w: {"step": s, "peak": s} for w in ("launch eager", "launch compiled", "live ranks eager")}
    fig = {"step": 1.0213, "cpu": 1.0448, "pairs": 150, "off_step_s": 0.1223}
    ob = {"pairs": 5, "compiled_pairs": 3, "steps": 20, "model": "m", "quiet": {**row, "load": [0.3, 0.5]},
          "within": {"pairs": 150, "load": 1.2, "launch eager": fig, "live ranks eager": {**fig, "step": 1.04}}}
    text = "\n".join(bench._observer_rows(ob))
    assert "150 pairs of steps" in text and "load 1.2 at the end" in text
    assert "| launch eager | 1.021x | - | 1.045x | 122 ms |" in text and "| live ranks eager | 1.040x |" in text
    ob["within"]["launch eager"] = {**fig, "step_ci95": [1.0101, 1.0302]}
    assert "| launch eager | 1.021x | 1.010-1.030 | 1.045x | 122 ms |" in "\n".join(bench._observer_rows(ob))
    assert "| launch compiled |" not in text.split("inside one job")[1]  # a way not measured: no row
    del ob["within"]
    assert "inside one job" not in "\n".join(bench._observer_rows(ob))


def test_the_median_interval_holds_the_median_and_narrows_with_more_pairs():
    """benches.observer.median_interval: a bootstrap interval of a median, the same for the same values, that holds
    the median, is no wider than the values' range, and narrows as pairs are added from the same spread."""
    from benches.observer import median_interval

    few = [1.01, 0.95, 1.08, 1.03]
    lo, hi = median_interval(few)
    assert min(few) <= lo <= statistics.median(few) <= hi <= max(few) and median_interval(few) == (lo, hi)
    many = few * 8
    lo8, hi8 = median_interval(many)
    assert lo8 <= statistics.median(many) <= hi8 and hi8 - lo8 < hi - lo
    assert median_interval([1.02] * 6) == (1.02, 1.02)


def test_the_watch_rows_say_the_cost_and_the_step_named():
    """RESULTS.md's section of the run watch: the clean run's ratio (median and range of its pairs) and the
    step the watch named for the bug."""
    w = {"pairs": 3, "steps": 100, "every": 10, "bug_at": 37, "model": "m", "plain_s": 21.04, "watched_s": 35.2,
         "ratio": {"median": 1.67, "min": 1.6, "max": 1.71, "ratios": [1.6, 1.67, 1.71]}, "clean_ok": True,
         "bug": {"named_step": 37, "stage": 1, "failure": "...", "ranks_agree": True}}
    text = "\n".join(bench._watch_rows(w))
    assert f"## {bench.WATCH_HEADING}" in text
    assert "| clean, every 10 | 21.0 s | 35.2 s | 1.67x (1.60-1.71) | holds at every step |" in text, text
    assert "| bug at step 37 | - | - | - | named step 37, stage 1 |" in text and bench._watch_rows(None) == []


def test_the_watch_rows_say_the_load_the_pairs_ran_under():
    """Another job on the machine slows the two runs of a pair unequally: the section says the load average at the
    start and after each pair."""
    w = {"pairs": 2, "steps": 100, "every": 10, "bug_at": 37, "model": "m", "plain_s": 14.0, "watched_s": 20.0,
         "ratio": {"median": 1.43, "min": 1.4, "max": 1.45, "ratios": [1.4, 1.45]}, "clean_ok": True,
         "bug": {"named_step": 37, "stage": 1, "failure": "...", "ranks_agree": True}, "date": "d", "torch": "t",
         "load": [0.52, 1.04, 2.0], "cores": 2}
    assert "load average 0.5 at the start and 1.0, 2.0 after each pair on 2 cores" in "\n".join(bench._watch_rows(w))


def test_the_watch_memory_rows_say_the_worst_rank_and_round_against_the_same_rounds_step():
    """RESULTS.md's section of the watch's memory with slices=: per batch and case, the worst ratio over ranks and
    rounds, each round's watch against that round's step; a failed verdict said."""
    def rank(plain, watched, ok=True):
        return {"params_mb": 12.2, "check_stages_mb": 60.0, "check_stages_ok": True, "plain_mb": plain,
                "cases": {"every 1": [(w, ok) for w in watched]}}

    w = {"rounds": 2, "model": "m", "load": [1.0, 1.2], "date": "d", "torch": "t",
         "batches": {"16": {"0": rank([50.0, 40.0], [80.0, 76.0]), "1": rank([52.0, 50.0], [70.0, 90.0], ok=False)}}}
    text = "\n".join(bench._watch_memory_rows(w))
    assert f"## {bench.WATCH_MEMORY_HEADING}" in text
    assert "load average 1.0 at the start and 1.2 after each batch" in text, text
    # rank 0's second round: 76 / 40 = 1.90x, the worst (rank 1: 90 / 50 = 1.80x)
    assert "| 16 x 64 | every 1 | 40 MB | 76 MB | 1.90x | 60 MB | FAILED |" in text, text
    assert bench._watch_memory_rows(None) == []
