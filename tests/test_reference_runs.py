"""Real torchrun jobs on CPU/gloo: every schedule, both splits, must equal ONE step of the unsplit model."""

import json
import subprocess

import pytest

from conftest import labkit_cli, run_suite
from labkit.schedules.table import SCHEDULES
from labkit.config.run import RunConfig
from labkit.launching.launch import LaunchError, run

pytestmark = pytest.mark.launches  # every test here starts, or runs on, processes that import torch

MULTI = [n for n, i in SCHEDULES.items() if i.multi]


def _check(res, cfg):
    assert res is not None, "the run wrote no result.json"
    assert res["status"] == "ok", res.get("failure")
    assert res["reference_match"] is True
    if cfg.tolerance is None:  # judged against the float noise measured for this model and data
        assert res["tolerance"] is None and res["noise"]["within"] is True
        assert res["noise"]["worst_ratio"] <= res["noise"]["multiple"] == 2
    else:
        assert res["max_abs_diff"] <= cfg.tolerance
    assert (res["dtype"], res["autocast"]) == (cfg.dtype, cfg.autocast)
    assert res["schedule"] == cfg.schedule and res["pp_size"] == cfg.pp_size
    assert res["n_stages"] == cfg.n_stages and res["n_microbatches"] == cfg.n_microbatches
    if not cfg.inference:
        assert len(res["losses"]) == cfg.n_microbatches
        assert res["compared_param_elements"] == res["model_param_elements"] > 0
    assert len(res["peak_memory_bytes"]) == cfg.pp_size and min(res["peak_memory_bytes"]) > 0
    assert len(res["step_time_s"]) == cfg.steps


# Every config below is a real run of the reference job under torchrun; the configs of one world size
# share ONE job (the job's --suite mode: one after the other on the same ranks, each with its own run
# directory and result.json), which saves a launch (~6 s of torchrun and imports) per config.
TRAIN = {(s, split): RunConfig(schedule=s, split=split, preset="tiny", n_microbatches=4)
         for s in SCHEDULES for split in ("manual", "tracer")}
ONE_RANK = {s: RunConfig(schedule=s, pp_size=1, stages_per_rank=2 if SCHEDULES[s].v_shaped else 4, preset="tiny",
                         n_microbatches=4) for s in MULTI}
INFERENCE = {s: RunConfig(schedule=s, inference=True, preset="tiny", n_microbatches=4)
             for s in ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"]}
# --autocast bfloat16 and --dtype float64 on every schedule x split, --dtype bfloat16 on every schedule
DTYPED = {(s, split, kind): RunConfig(schedule=s, split=split, preset="tiny", n_microbatches=4, **kw)
          for kind, kw in (("autocast bf16", {"autocast": "bfloat16"}), ("float64", {"dtype": "float64"}),
                           ("bfloat16", {"dtype": "bfloat16"}))
          for s in SCHEDULES for split in ("manual", "tracer") if split == "manual" or kind != "bfloat16"}
STEPS = RunConfig(schedule="1F1B", preset="tiny", steps=5)
TUTORIAL_LAYOUT = RunConfig(schedule="GPipe", preset="tiny", layout="tutorial", n_microbatches=4)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite2")
    cfgs = {**{("train",) + k: c for k, c in TRAIN.items()}, **{("inference", s): c for s, c in INFERENCE.items()},
            **{("dtype",) + k: c for k, c in DTYPED.items()}, ("steps",): STEPS, ("tutorial_layout",): TUTORIAL_LAYOUT}
    yield run_suite(root, "two", cfgs, 2)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite1")
    yield run_suite(root, "one", ONE_RANK, 1)


@pytest.mark.parametrize("split", ["manual", "tracer"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedule_matches_unsplit_model(schedule, split, two_ranks):
    _check(two_ranks[("train", schedule, split)], TRAIN[(schedule, split)])


@pytest.mark.parametrize("split", ["manual", "tracer"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_spans_time_every_planned_action_at_both_ends(schedule, split, two_ranks):
    """Spans (labkit.spans), on this torch: the run's own spans hold exactly the actions torch planned,
    in the planned order on each rank (F, B or F, I, W; both halves of DualPipeV's overlapped pairs),
    each with a measured start and end."""
    from labkit.schedules.orders import rank_orders
    from labkit.spans.read import timeline_from_spans
    from labkit.theory import planned_actions

    cfg = TRAIN[(schedule, split)]
    tl = timeline_from_spans(two_ranks["__dirs__"][("train", schedule, split)], "last")
    assert tl.source == "spans"
    assert rank_orders(tl) == planned_actions(schedule, cfg.pp_size, cfg.n_microbatches, cfg.stages_per_rank)
    assert all(a.end >= a.start > 0 for a in tl.compute())


@pytest.mark.parametrize("schedule", MULTI)
def test_multi_stage_on_one_rank(schedule, one_rank):
    _check(one_rank[schedule], ONE_RANK[schedule])


@pytest.mark.parametrize("schedule", list(INFERENCE))
def test_inference_matches_unsplit_outputs(schedule, two_ranks):
    res = two_ranks[("inference", schedule)]
    _check(res, INFERENCE[schedule])
    assert res["losses"] == [] and res["max_abs_diff_outputs"] < 1e-5


@pytest.mark.parametrize("key", list(DTYPED), ids=lambda k: "-".join(k))
def test_dtypes_and_autocast_match_the_unsplit_model_within_its_noise(key, two_ranks):
    """--autocast bfloat16 (the reference under the same autocast), --dtype bfloat16 (a bf16 reference,
    its own floor) and --dtype float64 (where the float noise vanishes: differences near 1e-16)."""
    res = two_ranks[("dtype",) + key]
    _check(res, DTYPED[key])
    if key[2] == "float64":
        assert res["max_abs_diff"] < 1e-12
    if key[2] == "bfloat16":
        assert res["max_abs_diff"] > 1e-5  # bf16 rounds: the same step differs, and passes as noise


def test_training_steps_reduce_the_loss(two_ranks):
    res = two_ranks[("steps",)]
    _check(res, STEPS)
    assert res["step_losses"][-1] < res["step_losses"][0]


def test_tutorial_layout_fails_the_whole_batch_check(two_ranks, runs):
    res = two_ranks[("tutorial_layout",)]
    assert res["status"] == "failed" and res["reference_match"] is False
    assert res["max_abs_diff"] > 1e-2 and res["noise"]["worst_ratio"] > 1e3  # far outside float noise
    assert two_ranks["__codes__"][("tutorial_layout",)] == 3  # the job says a check failed
    with pytest.raises(LaunchError, match="does not match the unsplit model"):  # and labkit.run raises
        run(TUTORIAL_LAYOUT, runs_root=runs, progress=False, stream="none")


def test_cli_run_contract(tmp_path, runs):
    out = runs / "cli"
    p = subprocess.run(labkit_cli("run", "--schedule", "Interleaved1F1B", "--nproc", "2", "--microbatches", "4",
                                  "--split", "tracer", "--stages-per-rank", "2", "--preset", "tiny", "--out", str(out)),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "result.json").read_text())
    for key in ("status", "schedule", "pp_size", "n_stages", "n_microbatches", "losses", "reference_match", "max_abs_diff"):
        assert key in res
    assert res["status"] == "ok" and res["n_stages"] == 4 and isinstance(res["max_abs_diff"], float)
    for f in ("command.json", "command.txt", "config.json", "launcher.log", "run.json"):
        assert (out / f).exists(), f
    assert sorted(p.parent.name for p in out.glob("logs/*/attempt_0/*/stderr.log")) == ["0", "1"]
    cmd = (out / "command.txt").read_text()
    # an OS-chosen port on loopback (port 0), never a fixed 29500
    assert "--rdzv-backend labkit-loopback --rdzv-endpoint 127.0.0.1:0" in cmd and "29500" not in cmd


def test_cli_run_bad_input_fails_fast(runs):
    p = subprocess.run(labkit_cli("run", "--schedule", "ZBVZeroBubble", "--nproc", "2", "--stages-per-rank", "3",
                                  "--out", str(runs / "bad")), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--stages-per-rank 2" in p.stderr
    assert not (runs / "bad").exists()
