"""Real torchrun jobs on CPU/gloo: every schedule, both splits, must equal ONE step of the unsplit model."""

import json
import subprocess

import pytest

from conftest import labkit_cli
from labkit.config import SCHEDULES, RunConfig
from labkit.launch import LaunchError, run

MULTI = [n for n, i in SCHEDULES.items() if i.multi]


def _check(r, cfg):
    res = r.result
    assert r.status == "ok" and res["status"] == "ok", r.error
    assert res["reference_match"] is True
    assert res["max_abs_diff"] <= cfg.tolerance
    assert res["schedule"] == cfg.schedule and res["pp_size"] == cfg.pp_size
    assert res["n_stages"] == cfg.n_stages and res["n_microbatches"] == cfg.n_microbatches
    if not cfg.inference:
        assert len(res["losses"]) == cfg.n_microbatches
        assert res["compared_param_elements"] == res["model_param_elements"] > 0
    assert len(res["peak_memory_bytes"]) == cfg.pp_size and min(res["peak_memory_bytes"]) > 0
    assert len(res["step_time_s"]) == cfg.steps


@pytest.mark.parametrize("split", ["manual", "tracer"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedule_matches_unsplit_model(schedule, split, runs):
    cfg = RunConfig(schedule=schedule, split=split, preset="tiny", n_microbatches=4)
    _check(run(cfg, runs_root=runs, progress=False, stream="none"), cfg)


@pytest.mark.parametrize("schedule", MULTI)
def test_multi_stage_on_one_rank(schedule, runs):
    spr = 2 if SCHEDULES[schedule].v_shaped else 4
    cfg = RunConfig(schedule=schedule, pp_size=1, stages_per_rank=spr, preset="tiny", n_microbatches=4)
    _check(run(cfg, runs_root=runs, progress=False, stream="none"), cfg)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"])
def test_inference_matches_unsplit_outputs(schedule, runs):
    cfg = RunConfig(schedule=schedule, inference=True, preset="tiny", n_microbatches=4)
    r = run(cfg, runs_root=runs, progress=False, stream="none")
    _check(r, cfg)
    assert r.result["losses"] == [] and r.result["max_abs_diff_outputs"] < 1e-5


def test_training_steps_reduce_the_loss(runs):
    cfg = RunConfig(schedule="1F1B", preset="tiny", steps=5)
    r = run(cfg, runs_root=runs, progress=False, stream="none")
    _check(r, cfg)
    assert r.result["step_losses"][-1] < r.result["step_losses"][0]


def test_tutorial_layout_fails_the_whole_batch_check(runs):
    cfg = RunConfig(schedule="GPipe", preset="tiny", layout="tutorial", n_microbatches=4)
    r = run(cfg, runs_root=runs, progress=False, stream="none", check=False)
    assert r.status == "failed" and r.result["reference_match"] is False
    assert r.result["max_abs_diff"] > 100 * cfg.tolerance
    with pytest.raises(LaunchError, match="does not match the unsplit model"):
        run(cfg, runs_root=runs, progress=False, stream="none")


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
