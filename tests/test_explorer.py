"""The explorer's pure logic (no browser, no kernel), then the widget's wiring with a stand-in launcher,
then one real job through the widget. tests/test_browser.py drives the same panel in JupyterLab."""

from __future__ import annotations

import json
import threading
import time

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import importlib  # noqa: E402

import labkit  # noqa: E402
from labkit.core.errors import ConfigError  # noqa: E402
from labkit.config.run import RunConfig  # noqa: E402
from labkit.notebook.explorer_views import (
    DEFAULT_CONTROLS,
    history_table_html,
    measured_view,
    stages_per_rank_for,
    status_line,
    summarize_run,
    theory_view,
    validate,
)
from labkit.launching.launch import Run  # noqa: E402
from labkit.timeline.compare import measured_vs_ideal  # noqa: E402
from labkit.theory import Cost, fit_cost, simulate  # noqa: E402

# `labkit.launching.launch` is the launch() function (re-exported by the package); patch the module itself.
launch_mod = importlib.import_module("labkit.launching.launch")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def controls(**over) -> dict:
    return {**DEFAULT_CONTROLS, **over}


# --------------------------------------------------------------------------------------------------
# validate: the same rules as RunConfig / labkit run


def test_defaults_are_valid_and_small():
    cfg, message = validate(controls())
    assert isinstance(cfg, RunConfig)
    assert (cfg.schedule, cfg.pp_size, cfg.n_microbatches, cfg.preset, cfg.device) == ("GPipe", 2, 4, "small", "auto")
    assert "2 ranks x 1 stage per rank = 2 stages" in message
    assert "4 microbatches of 2" in message


@pytest.mark.parametrize("over", [
    {"n_microbatches": 3},                                       # batch 8 not divisible
    {"schedule": "GPipe", "stages_per_rank": 2},                 # one stage per rank only
    {"schedule": "Interleaved1F1B", "stages_per_rank": 1},       # multi-stage needs 2+
    {"schedule": "ZBVZeroBubble", "stages_per_rank": 3},         # V-shaped needs exactly 2
    {"schedule": "ZBVZeroBubble", "stages_per_rank": 2, "n_microbatches": 2},  # fewer microbatches than stages
    {"pp_size": 16},                                             # more stages than layers
])
def test_invalid_combinations_give_the_runconfig_message(over):
    cfg, message = validate(controls(**over))
    assert cfg is None
    with pytest.raises(ConfigError) as e:
        RunConfig(**controls(**over))
    assert message == str(e.value)  # the SAME text as `labkit run` prints


def test_unknown_control_is_explained():
    cfg, message = validate(controls(colour="red"))
    assert cfg is None and "colour" in message


def test_device_check_is_the_launchers(monkeypatch):
    def refuse(device, nproc):
        raise ConfigError(f"--device cuda with {nproc} ranks needs {nproc} GPUs")

    monkeypatch.setattr(launch_mod, "preflight_device", refuse)
    cfg, message = validate(controls(device="cuda"))
    assert cfg is None and message == "--device cuda with 2 ranks needs 2 GPUs"
    assert validate(controls(device="cuda"), check_device=False)[0] is not None
    assert validate(controls(device="cpu"))[0] is not None  # only cuda is checked


@pytest.mark.parametrize("schedule, current, expected", [
    ("GPipe", 2, 1), ("1F1B", 1, 1), ("Interleaved1F1B", 1, 2), ("Interleaved1F1B", 3, 3),
    ("ZBVZeroBubble", 3, 2), ("DualPipeV", 1, 2), ("nonsense", 4, 4),
])
def test_stages_per_rank_follows_the_schedule(schedule, current, expected):
    assert stages_per_rank_for(schedule, current) == expected


# --------------------------------------------------------------------------------------------------
# theory_view


def test_theory_view_gpipe_matches_the_closed_form():
    view = theory_view(validate(controls())[0])
    assert view["error"] is None
    assert view["bubble_fraction"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    assert view["bubble_ratio"] == pytest.approx(1 / 4)     # (p-1)/m
    assert view["closed_form"] == pytest.approx({"fraction": 0.2, "ratio": 0.25})
    assert "bubble_fraction <b>20.0%</b>" in view["html"] and "bubble_ratio <b>0.25</b>" in view["html"]
    assert "idle / (ranks x makespan)" in view["html"] and "idle / busy" in view["html"]  # both named
    assert view["png"].startswith(PNG_MAGIC)
    assert theory_view(validate(controls())[0])["png"] == view["png"]  # deterministic picture


def test_theory_view_follows_the_controls():
    view = theory_view(controls(schedule="1F1B", n_microbatches=8))
    assert view["bubble_fraction"] == pytest.approx(1 / 9)
    assert "Ideal 1F1B</b>, pp_size=2, 8 microbatches" in view["html"]
    assert "11.1%" in view["html"]


def test_theory_view_compares_multi_stage_schedules_at_equal_model_size():
    view = theory_view(controls(schedule="Interleaved1F1B", stages_per_rank=2), png=False)
    assert view["error"] is None and view["closed_form"] is None and view["png"] is None
    costs = {(a.kind, a.duration) for a in view["timeline"].compute()}
    assert costs == {("F", 0.5), ("B", 1.0)}  # the whole model's F=1, B=2 cut into 2 stages per rank
    assert view["bubble_fraction"] < theory_view(controls(), png=False)["bubble_fraction"]


def test_theory_view_works_for_sizes_the_model_cannot_run():
    cfg, _ = validate(controls(n_microbatches=3))
    assert cfg is None
    view = theory_view(controls(n_microbatches=3), png=False)
    assert view["error"] is None and view["bubble_fraction"] == pytest.approx(1 / 4)


def test_theory_view_explains_what_torch_refuses():
    view = theory_view(controls(schedule="DualPipeV", stages_per_rank=2, n_microbatches=2))
    assert "at least as many microbatches as stages" in view["error"] and view["png"] is None and view["timeline"] is None
    assert view["html"].startswith("<b>No ideal timeline:</b>")


def test_theory_view_passes_on_torchs_1f1b_note():
    view = theory_view(controls(schedule="1F1B", pp_size=4, n_microbatches=2), png=False)
    assert "refuses fewer microbatches" in view["note"] and "<b>Note:</b>" in view["html"]


# --------------------------------------------------------------------------------------------------
# measured_view, summarize_run, status_line, history_table_html (on a synthetic run directory)


def fake_run_dir(tmp_path, schedule="GPipe", pp_size=2, m=4, reference_match=True, status="ok"):
    """A run directory like the launcher leaves: config.json, result.json and per-rank pipelining
    logs in the kit's format, written from an ideal GPipe timeline (F 10 ms, B 20 ms)."""
    cfg = RunConfig(schedule=schedule, pp_size=pp_size, n_microbatches=m)
    d = tmp_path / "run"
    ideal = simulate("GPipe", pp_size, m, 1, Cost(F=0.01, B=0.02))
    t0 = 1_795_000_000.0
    for rank in range(pp_size):
        lines = [f"{t0:.6f} I torch.distributed.pipelining.schedules schedules.py:297] Using ScheduleGPipe"]
        for a in sorted((a for a in ideal.compute() if a.rank == rank), key=lambda a: a.end):
            word = "Forwarded" if a.kind == "F" else "Backwarded"
            end = t0 + 0.001 + a.end
            chunk = f"[Stage {a.stage}] {word} chunk {a.microbatch}" + (", outputs: Tensor(...)" if a.kind == "F" else "")
            lines.append(f"{end:.6f} D torch.distributed.pipelining.stage stage.py:918] {chunk}")
            lines.append(f"{end + 1e-5:.6f} D torch.distributed.pipelining.schedules schedules.py:920] "
                         f"[{a.stage}] {word} microbatch {a.microbatch}")
        rank_dir = d / "logs" / "abc" / "attempt_0" / str(rank)
        rank_dir.mkdir(parents=True)
        (rank_dir / "stderr.log").write_text("\n".join(lines) + "\n")
        (rank_dir / "stdout.log").write_text("")
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    result = {"schedule": schedule, "pp_size": pp_size, "stages_per_rank": 1, "n_microbatches": m,
              "split": "manual", "preset": "small", "reference_match": reference_match, "max_abs_diff": 2e-8,
              "failure": None if reference_match else "reference mismatch: max abs diff 1 > tolerance 0.0001",
              "step_time_s": [0.5, 0.25]}
    (d / "result.json").write_text(json.dumps(result))
    return Run(run_dir=d, command=["torchrun"], nproc=pp_size, status=status, returncode=0, result=result), cfg


def test_measured_view_beside_the_fitted_ideal(tmp_path):
    run, cfg = fake_run_dir(tmp_path)
    view = measured_view(run.run_dir)
    assert view["error"] is None, view["error"]
    assert len(view["measured"].compute()) == 16 and len(view["ideal"].compute()) == 16
    assert view["cost"].unit == "s" and view["cost"].B > view["cost"].F > 0
    for key in ("measured_metrics", "ideal_metrics"):
        assert 0 <= view[key]["bubble_fraction"] < 1 and view[key]["bubble_ratio"] >= 0
    assert "bubble_fraction" in view["html"] and "bubble_ratio" in view["html"]
    assert view["png"].startswith(PNG_MAGIC)
    # the same as labkit.timeline.compare.measured_vs_ideal, the one owner of "measured beside its fitted ideal"
    measured, ideal, summary = measured_vs_ideal(run.run_dir)
    assert view["measured_metrics"] == measured.metrics() and view["ideal_metrics"] == ideal.metrics()
    assert view["cost"] == fit_cost(measured)
    # without result.json the run's shape comes from its logs ("Using ScheduleGPipe", ranks, microbatches)
    (run.run_dir / "result.json").unlink()
    again = measured_view(run.run_dir, png=False)
    assert again["error"] is None and again["ideal_metrics"] == view["ideal_metrics"]
    meta = again["measured"].meta
    assert (meta["schedule"], meta["pp_size"], meta["n_microbatches"]) == ("ScheduleGPipe", 2, 4)


def test_measured_view_without_logs_says_why(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RunConfig().to_dict()))
    view = measured_view(tmp_path)
    assert view["measured"] is None and view["png"] is None
    assert view["error"] and view["html"].startswith("<b>No measured timeline:</b>")


def test_summarize_run_row(tmp_path):
    run, cfg = fake_run_dir(tmp_path)
    row = summarize_run(run, measured_view(run.run_dir, png=False))
    assert {k: row[k] for k in ("schedule", "pp_size", "n_microbatches", "status", "reference_match")} == \
        {"schedule": "GPipe", "pp_size": 2, "n_microbatches": 4, "status": "ok", "reference_match": True}
    assert row["step_time_s"] == 0.25  # the last step (the first one carries the warm-up)
    assert row["measured_bubble_fraction"] is not None and row["ideal_bubble_fraction"] is not None
    # An interrupted run has no result.json: the row still names what ran, from config.json.
    stopped = Run(run_dir=run.run_dir, command=[], nproc=2, status="interrupted")
    row = summarize_run(stopped)
    assert (row["schedule"], row["n_microbatches"], row["status"], row["reference_match"]) == ("GPipe", 4, "interrupted", None)
    assert row["measured_bubble_fraction"] is None and row["step_time_s"] is None


def test_status_line(tmp_path):
    run, _ = fake_run_dir(tmp_path)
    kind, text = status_line(run)
    assert kind == "ok" and text.startswith("ok: reference match") and "0.250 s" in text
    run.result = {**run.result, "reference_match": False}
    run.status = "failed"
    assert status_line(run)[0] == "mismatch" and "NO reference match" in status_line(run)[1]
    stopped = Run(run_dir=run.run_dir, command=[], nproc=2, status="interrupted", error="stopped on request")
    assert status_line(stopped) == ("interrupted", "interrupted: stopped on request")
    crashed = Run(run_dir=run.run_dir, command=[], nproc=2, status="failed", error="Rank 1 failed: boom")
    assert status_line(crashed)[0] == "failed" and "Rank 1 failed: boom" in status_line(crashed)[1]


def test_history_table_html():
    assert "No runs yet" in history_table_html([])
    rows = [{"schedule": "GPipe", "pp_size": 2, "stages_per_rank": 1, "n_microbatches": 4, "split": "manual",
             "status": "ok", "reference_match": True, "measured_bubble_fraction": 0.3, "measured_bubble_ratio": 0.43,
             "ideal_bubble_fraction": 0.2, "ideal_bubble_ratio": 0.25, "step_time_s": 0.1234},
            {"schedule": "<1F1B>", "pp_size": 2, "n_microbatches": 8, "status": "interrupted"}]
    text = history_table_html(rows)
    assert text.count("<tr class=") == 2 and "pplab-history-table" in text
    assert ">30.0% / 0.43</td>" in text and ">20.0% / 0.25</td>" in text and ">0.123 s</td>" in text
    assert "&lt;1F1B&gt;" in text and "<1F1B>" not in text  # escaped
    assert ">yes</td>" in text and "pplab-run-interrupted" in text
    assert "idle share of wall time" in text and "idle / busy" in text  # both bubble definitions named


# --------------------------------------------------------------------------------------------------
# The widget's wiring (a stand-in launcher; no job)

widgets = pytest.importorskip("ipywidgets")


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the explorer launched a job without Run being pressed")

    monkeypatch.setattr(launch_mod, "run", refuse)


def test_display_launches_and_prints_nothing(no_launch, capsys):
    panel = labkit.explorer()
    assert isinstance(panel, widgets.VBox)
    assert repr(panel) == "PP Lab explorer (GPipe, pp_size=2, 4 microbatches): press Run to launch a job"
    bundle = panel._repr_mimebundle_()
    assert bundle["text/plain"] == repr(panel)  # what nbval compares: short and fixed
    assert capsys.readouterr() == ("", "")
    ex = panel.explorer
    assert not ex.run_button.disabled and ex.stop_button.disabled
    assert ex.error_panel.layout.display == "none"
    assert bytes(ex.theory_image.value).startswith(PNG_MAGIC) and ex.timeline_image.layout.display == "none"
    assert "No runs yet" in ex.history.value


def test_dom_hooks(no_launch):
    panel = labkit.explorer()
    ex = panel.explorer
    hooks = {"pplab-explorer": panel, "pplab-run": ex.run_button, "pplab-stop": ex.stop_button,
             "pplab-status": ex.status, "pplab-timeline": ex.timeline_image, "pplab-history": ex.history,
             "pplab-error": ex.error_panel, "pplab-theory-image": ex.theory_image,
             "pplab-theory-bubble": ex.theory_text, "pplab-schedule": ex.schedule,
             "pplab-microbatches": ex.n_microbatches, "pplab-pp-size": ex.pp_size, "pplab-log": ex.log,
             "pplab-progress": ex.progress, "pplab-measured-bubble": ex.measured_text}
    for cls, w in hooks.items():
        assert cls in w._dom_classes, cls


def test_controls_update_theory_and_validation(no_launch):
    ex = labkit.explorer().explorer
    ex.schedule.value = "1F1B"
    ex.n_microbatches.value = 8
    assert "Ideal 1F1B</b>, pp_size=2, 8 microbatches" in ex.theory_text.value and "11.1%" in ex.theory_text.value
    ex.n_microbatches.value = 3
    assert ex.run_button.disabled and ex.error_panel.layout.display is None
    assert "not divisible by 3 microbatches" in ex.error_panel.value
    assert "Theory only" in ex.theory_text.value
    ex.n_microbatches.value = 4
    assert not ex.run_button.disabled and ex.error_panel.layout.display == "none"
    ex.schedule.value = "ZBVZeroBubble"  # V-shaped: stages_per_rank follows, 4 stages need 4 microbatches
    assert ex.stages_per_rank.value == 2 and not ex.run_button.disabled
    ex.schedule.value = "GPipe"
    assert ex.stages_per_rank.value == 1 and not ex.run_button.disabled
    ex.start()  # disabled Run: start() checks again and launches nothing when invalid
    ex.n_microbatches.value = 3
    ex.start()
    assert ex._state.thread is None


def test_run_and_stop_wiring(monkeypatch, tmp_path):
    run, cfg = fake_run_dir(tmp_path)
    calls = []

    def fake_run(cfg, *, stop_event, echo, on_progress, progress, check, **kw):
        calls.append((cfg, progress, check, kw))
        echo("[rank0] hello")
        on_progress(1, 1)
        return run

    monkeypatch.setattr(launch_mod, "run", fake_run)
    ex = labkit.explorer(runs_root=tmp_path / "runs").explorer
    ex.start()
    ex.wait(60)
    (got, progress, check, kw), = calls
    assert got.schedule == "GPipe" and progress is False and check is False and kw["runs_root"] == tmp_path / "runs"
    assert ex.status.value.startswith("ok: reference match")
    assert ex.timeline_image.layout.display is None and bytes(ex.timeline_image.value).startswith(PNG_MAGIC)
    assert "bubble_fraction" in ex.measured_text.value
    assert ex.history.value.count("<tr class=") == 1 and ex.rows[0]["status"] == "ok"
    assert ex.log.outputs[0]["text"] == "[rank0] hello\n"
    assert (ex.progress.value, ex.progress.max, ex.progress.bar_style) == (1, 1, "success")
    assert not ex.run_button.disabled and ex.stop_button.disabled

    started = threading.Event()

    def blocking_run(cfg, *, stop_event, **kw):
        started.set()
        assert stop_event.wait(30)
        return Run(run_dir=run.run_dir, command=[], nproc=2, status="interrupted",
                   error="stopped on request (stop_event); every rank was stopped")

    monkeypatch.setattr(launch_mod, "run", blocking_run)
    ex.start()
    assert started.wait(30)
    assert ex.run_button.disabled and not ex.stop_button.disabled
    ex.start()  # a second Run while one runs does nothing
    ex.stop()
    ex.wait(60)
    assert ex.status.value.startswith("interrupted: stopped on request")
    assert [r["status"] for r in ex.rows] == ["ok", "interrupted"]
    assert ex.progress.bar_style == "warning" and not ex.run_button.disabled


def test_launcher_errors_end_in_the_status(monkeypatch):
    def refuse(cfg, **kw):
        raise ConfigError("--device cuda with 2 ranks on this node needs 2 GPUs")

    monkeypatch.setattr(launch_mod, "run", refuse)
    ex = labkit.explorer().explorer
    ex.start()
    ex.wait(60)
    assert ex.status.value.startswith("not launched: --device cuda")
    assert not ex.run_button.disabled and ex.stop_button.disabled and ex.rows == []


# --------------------------------------------------------------------------------------------------
# One real job through the widget (what the browser test also does, without a browser)


@pytest.mark.launches
def test_real_run_through_the_widget(runs):
    ex = labkit.explorer(runs_root=runs, timeout=240, preset="tiny").explorer
    t0 = time.monotonic()
    ex.start()
    ex.wait(300)
    assert ex._state.thread is None, f"still running after {time.monotonic() - t0:.0f} s"
    log = "".join(o.get("text", "") for o in ex.log.outputs)
    assert ex.status.value.startswith("ok: reference match"), (ex.status.value, log)
    assert ex.last_run.status == "ok" and ex.last_run.result["reference_match"] is True
    assert bytes(ex.timeline_image.value).startswith(PNG_MAGIC), ex.measured_text.value
    row, = ex.rows
    assert (row["schedule"], row["pp_size"], row["n_microbatches"], row["status"], row["reference_match"]) == \
        ("GPipe", 2, 4, "ok", True)
    assert row["measured_bubble_fraction"] is not None and row["step_time_s"] > 0
    assert "matches the unsplit model" in log
