"""Schedule search (labkit/theory/search.py): zero-bubble's bounds, validity by the kit's rules and by
torch's own lowering, and a searched order run on torch's runtime against the unsplit model."""

import itertools
import json
import subprocess

import pytest

from labkit.schedules.orders import check_order, peak_in_flight
from labkit.theory import Cost, simulate, simulate_order
from labkit.theory import paper
from labkit.theory.search import HANDCRAFTED, handcrafted, lower_bound, rank_spans, search, zb_h1_makespan

from conftest import REPO, labkit_cli

UNIT = Cost(F=1, I=1, W=1)


def test_at_1f1b_memory_it_meets_zb_h1():
    """K = P: makespan <= M(F+I+W) + (P-1)(F+I-W) (ZB-H1), below 1F1B's own with the same costs."""
    r = search(4, 8, UNIT, memory_limit=4)
    assert r.makespan <= zb_h1_makespan(4, 8, UNIT) == 27
    assert max(r.peak.values()) <= 4
    one_f_one_b = simulate("1F1B", 4, 8, 1, Cost(F=1, B=2)).metrics()["makespan"]
    assert r.makespan < one_f_one_b


def test_at_twice_the_memory_its_steady_state_has_no_bubble():
    """K = 2P: each rank's span (a step's time once steps overlap, zero-bubble's ZB-H2 setting) is
    exactly M(F+I+W), no bubble at all (the issue asks within 5%): the ZB-H2 seed fits (2P - 1 held)
    and has that period at F=I=W, no order has less, and search ranks by period first. One isolated
    step cannot beat the last stage's fill, (P-1)F later."""
    r = search(4, 8, UNIT, memory_limit=8)
    assert r.period == pytest.approx(8 * 3)
    assert r.period <= 1.05 * 8 * 3
    assert max(r.peak.values()) <= 8
    assert r.makespan == pytest.approx(lower_bound(4, 8, UNIT)) == 27


@pytest.mark.parametrize("p, m, k, cost", [
    (p, m, k, c) for p, m, k, c in itertools.product((2, 4), (3, 8), (1, "p", "2p"), ("F=1,I=2,W=0.5", "F=2,I=1,W=1,p2p=0.3"))])
def test_every_searched_order_is_valid_within_memory_and_above_the_lower_bound(p, m, k, cost):
    k = {"p": p, "2p": 2 * p}.get(k, k)
    r = search(p, m, cost, memory_limit=k)
    assert not check_order(r.order, p, m)
    assert max(peak_in_flight(r.order).values()) <= k
    replay = simulate_order(r.order, p, m, cost).metrics()["makespan"]
    assert replay == pytest.approx(r.makespan)
    assert r.makespan >= r.lower_bound - 1e-9 and r.gap >= 0


@pytest.mark.parametrize("setting", [s for s in paper.SETTINGS if s.p == 8 and s.m == 24], ids=str)
@pytest.mark.parametrize("limit", ["p", "2p-1", "2p"])
def test_search_is_never_worse_than_a_handcrafted_order_that_fits(setting, limit):
    """At the zero-bubble paper's measured costs (Table 9, with communication): the searched order's
    bubble rate (the paper's, on the longest stage's span) is at most that of every handcrafted seed
    within the limit: ZB-H1 and 1F1B (I and W back to back) from K = p, ZB-H2 from K = 2p - 1. The
    8-stage, m=24 rows only: larger settings take minutes per search (bench runs m=32)."""
    k = {"p": setting.p, "2p-1": 2 * setting.p - 1, "2p": 2 * setting.p}[limit]
    c = paper.cost(setting)
    r = search(setting.p, setting.m, c, memory_limit=k)
    assert max(r.peak.values()) <= k and check_order(r.order, setting.p, setting.m) == []
    rate = paper.bubble_rate(r.timeline, setting.m, c)
    fitting = [kind for kind in HANDCRAFTED if max(peak_in_flight(handcrafted(kind, setting.p, setting.m)).values()) <= k]
    assert "ZB-H1" in fitting and ("ZB-H2" in fitting) == (k >= 2 * setting.p - 1)
    for kind in fitting:
        seed = simulate_order(handcrafted(kind, setting.p, setting.m), setting.p, setting.m, c)
        assert rate <= paper.bubble_rate(seed, setting.m, c) + 1e-12, (kind, rate)
        assert r.period <= max(rank_spans(seed).values()) + 1e-9
    if k == setting.p:  # the paper's searched ZB-1p equals its ZB-H1 (Table 5): so does the kit's, to 4 decimals
        assert rate <= paper.BUBBLE_RATES[setting]["ZB-1p"] + 5e-5


def test_seeds_that_need_more_memory_are_left_out():
    """Below 2P - 1 the ZB-H2 seed does not fit and is not returned; below P no seed fits and the
    rule's own orders remain (each one within the limit)."""
    assert search(4, 8, UNIT, memory_limit=6).rule != "seed: ZB-H2 (arXiv 2401.10241 Fig. 3)"
    assert search(4, 8, UNIT, memory_limit=7).rule == "seed: ZB-H2 (arXiv 2401.10241 Fig. 3)"
    r = search(4, 8, UNIT, memory_limit=2)
    assert not r.rule.startswith("seed:") and max(r.peak.values()) <= 2


def test_torch_lowers_and_simulates_the_searched_order():
    """torch's own lowering (SEND/RECV added) and its comms/compute simulation accept the order; an
    order whose I comes before its F is refused by the same path (the check can fail)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "_add_send_recv") or not hasattr(schedules, "_simulate_comms_compute"):
        pytest.skip("this torch has no _add_send_recv/_simulate_comms_compute (private helpers)")
    act = schedules._Action.from_str

    def lower(order, n_stages):
        compute = {rank: [act(f"{s}{k}{mb}") for k, s, mb in acts] for rank, acts in order.items()}
        comms = schedules._add_send_recv(compute, lambda s: s, n_stages)
        return schedules._simulate_comms_compute(comms, lambda s: s, n_stages)

    r = search(4, 8, UNIT, memory_limit=4)
    lowered = lower(r.order, 4)
    assert sum(1 for acts in lowered.values() for a in acts if a is not None and "SEND" in str(a)) > 0
    bad = {0: [("I", 0, 0), ("F", 0, 0), ("W", 0, 0)], 1: [("F", 1, 0), ("I", 1, 0), ("W", 1, 0)]}
    with pytest.raises(Exception):
        lower(bad, 2)


def test_cli_search_writes_torchs_csv_and_json(tmp_path):
    out = tmp_path / "zb.csv"
    p = subprocess.run(labkit_cli("search", "--pp-size", "4", "--microbatches", "8", "--cost", "F=1,I=1,W=1",
                                  "--memory-limit", "4", "--csv", str(out), "--json"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert {"makespan", "bubble", "peak", "lower_bound", "period", "bound", "gap"} <= set(data) and data["makespan"] <= 27
    rows = out.read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("0F0,")
    assert f"labkit run --nproc 4 --microbatches 8 --schedule-csv {out}" in p.stderr  # how to run what it wrote
    bad = subprocess.run(labkit_cli("search", "--pp-size", "4", "--microbatches", "8", "--memory-limit", "4"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--cost" in bad.stderr


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows[:3], "has 3 rows but the run has 4 ranks: pass --nproc 3"),
    (lambda rows: [r.replace("0F", "1F") if i == 0 else r for i, r in enumerate(rows)], "rank r must run stage r"),
    (lambda rows: [",".join(a for a in r.split(",") if not a.endswith("7")) for r in rows], "pass --microbatches 7"),
])
def test_a_schedule_csv_that_cannot_run_is_refused_before_launch(tmp_path, edit, message):
    from labkit.core.errors import ConfigError
    from labkit.config.run import RunConfig
    rows = search(4, 8, UNIT, memory_limit=4).csv().strip().splitlines()
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(edit(rows)) + "\n")
    with pytest.raises(ConfigError, match=message):
        RunConfig(schedule="1F1B", pp_size=4, n_microbatches=8, preset="tiny", schedule_csv=str(path))


def _run_flags(*flags: str):
    """The RunConfig `labkit run` makes of these flags (its own parser), device cpu: the suite's pools."""
    from labkit.cli import build_parser, config_from_flags

    a = build_parser().parse_args(["run", *flags, "--device", "cpu"])
    return config_from_flags(a, pp_size=a.pp_size)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """Two searched orders as torch's compute-only CSV (the K = P order; a V order at half of 1F1B's
    memory), each made into a config by `labkit run`'s own flags (--schedule-csv), both run on the
    suite's warm 4-rank pool as the reference job runs them (conftest.run_suite)."""
    from conftest import run_suite

    root = tmp_path_factory.mktemp("searched")
    kp, v = search(4, 8, UNIT, memory_limit=4), search(4, 8, Cost(F=0.5, I=0.5, W=0.5), memory_limit=2, stages_per_rank=2)
    (root / "zb.csv").write_text(kp.csv())
    (root / "v.csv").write_text(v.csv())
    cfgs = {"k=p": _run_flags("--schedule", "1F1B", "--nproc", "4", "--microbatches", "8", "--preset", "tiny",
                              "--schedule-csv", str(root / "zb.csv")),
            "v": _run_flags("--schedule", "ZBVZeroBubble", "--stages-per-rank", "2", "--nproc", "4", "--microbatches",
                            "8", "--preset", "tiny", "--schedule-csv", str(root / "v.csv"))}
    return run_suite(root, "runs", cfgs, 4), v


@pytest.mark.launches
def test_a_searched_order_runs_on_torchs_runtime_and_matches_the_unsplit_model(searched):
    """The K = P order on 4 real ranks (the tutorial model, tiny preset): torch's runtime adds the
    sends, the step equals the unsplit model's, and the timeline is drawn beside the order simulated
    at the measured costs."""
    runs, _ = searched
    result, run = runs["k=p"], runs["__dirs__"]["k=p"]
    assert result is not None and runs["__codes__"]["k=p"] == 0, runs["__codes__"]
    assert result["reference_match"] is True and result["n_microbatches"] == 8
    assert result["runtime"].endswith("_PipelineScheduleRuntime")
    from labkit.timeline.compare import measured_vs_ideal
    measured, ideal, _ = measured_vs_ideal(run)
    assert measured.source == "spans" and ideal.meta["schedule"] == "order from --schedule-csv"
    assert measured.counts() == ideal.counts() == {(s, k): 8 for s in range(4) for k in ("F", "I", "W")}
    assert "I" in "".join(result["order"]["0"]) and "W" in "".join(result["order"]["0"])


def test_cli_search_fits_costs_from_a_measured_run_and_adds_the_sends(tmp_path):
    """--cost-from RUN: F, I, W fitted from a real InterleavedZeroBubble run's timeline (torch 2.15's
    logs, 4 ranks, 8 microbatches), as the ideal timelines are; --comm adds a send's time to each hop.
    The CLI's answer is the search at exactly those costs, and a slower link lengthens the makespan."""
    from labkit.timeline.compare import load_timeline
    from labkit.theory import fit_cost

    run = REPO / "tests" / "fixtures" / "pplogs" / "2.15.0" / "InterleavedZeroBubble-p4-m8"

    def cli(*extra):
        p = subprocess.run(labkit_cli("search", "--pp-size", "4", "--microbatches", "8", "--memory-limit", "4",
                                      "--cost-from", str(run), "--json", *extra),
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout), p.stderr

    plain, said = cli()
    fitted = fit_cost(load_timeline(run))
    assert f"costs fitted from {run}: F={fitted.F:.4g} I={fitted.input_grad:.4g} W={fitted.weight_grad:.4g}" in said
    assert plain["makespan"] == pytest.approx(search(4, 8, fitted, memory_limit=4).makespan)
    comm = 0.5 * fitted.F
    linked, _ = cli("--comm", str(comm))
    with_sends = fit_cost(load_timeline(run), p2p=comm)
    assert linked["makespan"] == pytest.approx(search(4, 8, with_sends, memory_limit=4).makespan)
    assert linked["makespan"] > plain["makespan"]


# ---- issue 32: the paper's memory count, the exact model, V placement --------------------------------

def test_weight_memory_counts_what_w_still_holds():
    """F holds 1, I frees 1 - R, W frees R (the zero-bubble paper's count); R = 1 is peak_in_flight's."""
    from labkit.theory.search import memory_peak
    order = {0: [("F", 0, 0), ("I", 0, 0), ("F", 0, 1), ("I", 0, 1), ("W", 0, 0), ("W", 0, 1)]}
    assert memory_peak(order, 1.0) == {0: 2.0} == {0: float(peak_in_flight(order)[0])}
    assert memory_peak(order, 0.5) == {0: 1.5}
    assert memory_peak(order, 0.0) == {0: 1.0}
    v = {0: [("F", 0, 0), ("F", 1, 0), ("I", 1, 0), ("I", 0, 0), ("W", 1, 0), ("W", 0, 0)]}
    assert memory_peak(v, 1.0, stages_per_rank=2) == {0: 1.0}  # two half stages of one rank


def test_less_weight_memory_never_hurts_and_the_json_has_the_peak_in_those_units():
    r1 = search(4, 8, UNIT, memory_limit=3, weight_memory=1.0)
    r_half = search(4, 8, UNIT, memory_limit=3, weight_memory=0.5)
    assert max(r_half.peak.values()) <= 3 and r_half.period <= r1.period
    data = r_half.to_json()
    assert data["weight_memory"] == 0.5 and max(data["peak"].values()) <= 3
    assert {"bound", "gap", "objective"} <= set(data) and data["bound"] <= data["value"] + 1e-9


def test_the_papers_memory_model_comes_from_its_formulas():
    """R = M_W / M_B = 32h / (34h + 5as) with the paper's Table 4 sizes (s = 1024)."""
    assert paper.weight_memory("1.5B") == pytest.approx(32 * 2304 / (34 * 2304 + 5 * 24 * 1024))
    assert paper.weight_memory("6.2B") == pytest.approx(0.4324, abs=1e-4)
    assert set(paper.MODELS) == {s.model for s in paper.SETTINGS}


def test_v_placement_at_1f1b_memory_is_no_slower_than_zbv():
    """Two stages per rank (torch's V: rank r holds r and 2P-1-r), F=I=W=1 per full stage (0.5 per
    half), 1F1B's memory (P stage microbatches; ZBVZeroBubble's own peak): makespan <= ZBV's 25.5."""
    half = Cost(F=0.5, I=0.5, W=0.5)
    zbv = simulate("ZBVZeroBubble", 4, 8, 2, half)
    r = search(4, 8, half, memory_limit=4, stages_per_rank=2, objective="makespan")
    assert r.makespan <= zbv.metrics()["makespan"] == 25.5
    assert max(r.peak.values()) <= 4 and check_order(r.order, 8, 8) == []
    assert all(sorted({s for _, s, _ in acts}) == [rk, 7 - rk] for rk, acts in r.order.items())


def test_theory_json_has_each_schedules_peak():
    from labkit.theory import theory_json
    half = Cost(F=0.5, I=0.5, W=0.5, B=1)
    assert theory_json(simulate("ZBVZeroBubble", 4, 8, 2, half))["peak"] == {str(r): 4.0 for r in range(4)}
    assert theory_json(simulate("1F1B", 4, 8, 1, Cost(F=1, B=2)))["peak"] == {"0": 4.0, "1": 3.0, "2": 2.0, "3": 1.0}


def test_the_exact_model_proves_its_bound_and_never_loses_to_its_seed():
    """CP-SAT (OR-Tools, the `search` extra), P=3, M=4, unequal costs: the answer is valid, within
    memory, no worse than the list scheduler's, and at or above the solver's proven bound."""
    pytest.importorskip("ortools", reason="the exact model needs OR-Tools: pip install 'labkit[search]'")
    c = Cost(F=1, I=2, W=1, p2p=0.5)
    seed = search(3, 4, c, memory_limit=3, objective="makespan")
    r = search(3, 4, c, memory_limit=3, objective="makespan", time_limit=10)
    assert check_order(r.order, 3, 4) == [] and max(r.peak.values()) <= 3
    assert r.makespan <= seed.makespan + 1e-9
    assert r.bound <= r.makespan + 1e-9 and r.bound >= lower_bound(3, 4, c) - 1e-9
    assert r.solver["status"] in ("OPTIMAL", "FEASIBLE") and r.gap >= 0
    assert simulate_order(r.order, 3, 4, c).metrics()["makespan"] == pytest.approx(r.makespan)


def test_the_exact_model_without_ortools_says_how_to_install_it(no_ortools):
    from labkit.core.errors import ConfigError
    with pytest.raises(ConfigError, match=r"labkit\[search\]"):
        search(2, 2, UNIT, memory_limit=2, time_limit=1)


def test_v_at_half_memory_beats_1f1b_with_the_exact_model():
    """V placement at half of 1F1B's memory (2 stage microbatches per rank): the exact model's order
    is faster than 1F1B with twice the memory (33) and holds the limit."""
    pytest.importorskip("ortools", reason="the exact model needs OR-Tools: pip install 'labkit[search]'")
    half = Cost(F=0.5, I=0.5, W=0.5)
    r = search(4, 8, half, memory_limit=2, stages_per_rank=2, objective="makespan", time_limit=20)
    assert max(r.peak.values()) <= 2 and check_order(r.order, 8, 8) == []
    assert r.makespan < simulate("1F1B", 4, 8, 1, Cost(F=1, B=2)).metrics()["makespan"] == 33


@pytest.mark.launches
def test_a_searched_v_order_runs_on_torchs_runtime_and_matches_the_unsplit_model(searched):
    """A V order (list scheduler, half of 1F1B's memory) as torch's CSV through `labkit run
    --schedule ZBVZeroBubble --stages-per-rank 2 --schedule-csv`'s config on 4 ranks: matches the unsplit model."""
    runs, r = searched
    result = runs["v"]
    assert result is not None and runs["__codes__"]["v"] == 0, runs["__codes__"]
    assert result["reference_match"] is True and result["runtime"].endswith("_PipelineScheduleRuntime")
    assert result["order"] == {str(k): row.split(",") for k, row in enumerate(r.csv().splitlines())}
