"""Smoke tests of the benchmark pieces (structure and sanity, never timed asserts)."""

from labkit import bench


def test_parser_throughput_structure():
    out = bench.parser_throughput((2_000, 4_000))
    assert set(out) == {"2000", "4000", "linearity"}
    assert out["4000"]["lines_per_s"] > 0 and out["4000"]["actions"] > out["2000"]["actions"] > 0
    # the log -> timeline path includes the parse, so it is never faster than the parse alone
    assert 0 < out["4000"]["timeline_lines_per_s"] <= out["4000"]["lines_per_s"]


def test_launch_overhead_runs_both_commands():
    out = bench.launch_overhead(n=1)
    assert out["ratio"] > 0 and len(out["pair_ratios"]) == 1
    # the kit's own time outside torchrun: real (an interpreter starts), and a small part of the run
    assert 0 < out["kit_outside_torchrun_s"] < out["a_median_s"]
    assert out["pair_ratio_iqr"][0] <= out["ratio"] <= out["pair_ratio_iqr"][1]


def test_fidelity_row_and_table():
    rows = bench.fidelity(shapes=((2, 2),), schedules=("GPipe",), fwd_ms=20, bwd_ms=40)
    assert rows[0]["ideal_bubble"] == round(1 / 3, 4) and 0 <= rows[0]["measured_bubble"] < 1
    res = {"machine": "m", "machine_detail": {"cpus": 2}, "torch": "t", "date": "d",
           "launch_overhead_ratio": 1.0, "capture_overhead_ratio": 1.0, "profiler_overhead_ratio": 1.2,
           "fidelity": rows, "parser_lines_per_s": {"10000": 6e5}, "parser_linearity": 1.0,
           "notebook_suite_s": None, "gpu": {"available": False, "reason": "none"}}
    md = bench.markdown(res)
    assert "| GPipe | 2 | 2 |" in md and "launch overhead" in md


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
