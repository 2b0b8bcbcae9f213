"""scripts/gpu_check.py, the GPU checklist's essentials in one call, rehearsed on CPU the way a GPU
machine runs it: a plain checkout, nothing of ours installed, PYTHONPATH the repository root.

The rehearsal's checkout is a copy of labkit/ and the script (the clone's root also holds the
editable install's labkit.egg-info, whose entry points a plain checkout lacks). Its interpreter is a
bare venv (no site-packages of its own) that sees this environment's third-party packages through a
folder of links: every package except the kit's own installation (its metadata, its editable finder:
so torchrun's `torchrun.handlers` entry point is missing, as on that machine) and what such a machine
lacks (JupyterLab, ipywidgets, ipykernel, nbval, OR-Tools).

Cost: 2 torchrun jobs (the reference job's suite for parts 1-3, a live pool for parts 4-5), 4 processes
that import torch (the script itself does not on CPU): 32 s on 2 idle cores, 45-60 s beside other work.
The other tests here start nothing: the GPU-only readings (kernels matched to their actions, the memory
verdict against the allocator, the GPU plan) on stand-ins.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ABSENT_THERE = ("labkit", "__editable__", "jupyter", "ipywidgets", "ipykernel", "nbval", "ortools", "notebook")


def bare_python(root: Path) -> tuple[Path, Path]:
    """A venv with no packages of its own, and a folder linking this environment's packages minus the kit's
    installation and what the GPU machines lack. Returns (its python, the folder)."""
    venv = root / "bare-venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)
    shadow = root / "site"
    shadow.mkdir()
    for p in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = p.name.lower()
        if name.endswith(".pth") or any(name.startswith(a) for a in ABSENT_THERE):
            continue
        (shadow / p.name).symlink_to(p)
    return venv / "bin" / "python", shadow


def plain_checkout(root: Path) -> Path:
    """What the check needs of a fresh clone, copied: the kit's package, the script and its steps (gpu_checks/)."""
    checkout = root / "checkout"
    shutil.copytree(REPO / "labkit", checkout / "labkit", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(REPO / "scripts" / "gpu_checks", checkout / "scripts" / "gpu_checks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "scripts" / "gpu_check.py", checkout / "scripts" / "gpu_check.py")
    return checkout


@pytest.mark.launches
def test_gpu_check_runs_bare_on_cpu_and_every_part_has_a_verdict(runs, tmp_path):
    python, shadow = bare_python(tmp_path)
    checkout = plain_checkout(tmp_path)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", str(tmp_path)),
           "PYTHONPATH": os.pathsep.join([str(checkout), str(shadow)]), "LANG": "C.UTF-8"}
    if os.environ.get("PPLAB_TORCH_IMPORTS"):  # dev.py test's count of torch-importing processes follows them
        env["PPLAB_TORCH_IMPORTS"] = os.environ["PPLAB_TORCH_IMPORTS"]
        env["PYTHONPATH"] += os.pathsep + str(REPO / "scripts" / "torch_count")  # a sitecustomize; no labkit there
    probe = subprocess.run([str(python), "-c", "import importlib.util as u, importlib.metadata as m; "
                            "print(u.find_spec('jupyterlab') is None, "
                            "[e.name for e in m.entry_points(group='torchrun.handlers')])"],
                           env=env, cwd=checkout, capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["True", "[]"], probe.stdout + probe.stderr  # as bare as the GPU machine

    out = runs / "gpu-check"
    t0 = time.monotonic()
    r = subprocess.run([str(python), "scripts/gpu_check.py", "--device", "cpu", "--out", str(out)],
                       env=env, cwd=checkout, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    print(r.stdout[-4000:], r.stderr[-4000:], f"gpu_check on CPU: {took:.0f} s", sep="\n")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]

    data = json.loads((out / "gpu_check.json").read_text())
    verdicts = {p["key"]: p["verdict"] for p in data["parts"]}
    assert verdicts == {"1_schedules": "pass", "2_tutorial": "skipped", "3_spans": "pass", "4_live_ranks": "pass",
                        "5_memory": "pass", "6_observer": "pass"}, data["parts"]
    assert all(p["why"] for p in data["parts"])  # every verdict says why, a skip its reason
    assert "GPU only" in next(p["why"] for p in data["parts"] if p["key"] == "2_tutorial")
    assert data["device"] == "cpu" and data["torch"] and data["ok"] is True
    assert "declared for this check" in data["rendezvous"]  # torchrun found the kit's rendezvous without an install
    assert data["launches"]["torchrun_jobs"] == 4 and data["launches"]["processes"] == 8
    schedules = next(p for p in data["parts"] if p["key"] == "1_schedules")["figures"]["configs"]
    assert len(schedules) == 10 and all(c["reference_match"] for c in schedules)
    spans = next(p for p in data["parts"] if p["key"] == "3_spans")["figures"]
    # the bubble gap is judged where the machine was quiet (labkit.spans.quiet); the reading is kept either way
    assert spans["machine"].endswith(("a quiet baseline: compared", "not compared")), spans
    observer = next(p for p in data["parts"] if p["key"] == "6_observer")["figures"]
    assert observer["dynamo"]["graphs"] >= 2 and observer["dynamo"]["limit_hits"] == 0  # both stages compiled
    for line in ("1_schedules", "3_spans", "4_live_ranks", "5_memory", "6_observer"):  # each verdict as it came
        assert f"[gpu_check] {line} (" in r.stdout
    assert "| 5_memory" in (out / "report.md").read_text()


# ---- the GPU-only readings, on stand-ins (no process started) ---------------------------------------------

def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def cuda_trace() -> dict:
    """A Kineto-style trace: two kit annotations, the launches inside them (a backward's from autograd's
    device thread), kernels matched by correlation id, and a launch outside any annotation (the loss)."""
    def ev(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}

    return {"baseTimeNanoseconds": 1_000_000_000, "traceEvents": [
        ev("user_annotation", "labkit::0F0", 100, 50), ev("user_annotation", "labkit::0B0", 200, 60),
        ev("cuda_runtime", "cudaLaunchKernel", 110, 2, correlation=1),
        ev("cuda_runtime", "cudaLaunchKernel", 140, 2, correlation=2),
        ev("cuda_runtime", "cudaLaunchKernel", 170, 2, correlation=9),  # between the two: not an action's
        ev("cuda_runtime", "cudaLaunchKernel", 210, 2, tid=2, correlation=3),
        ev("kernel", "gemm", 150, 20, tid=7, correlation=1), ev("gpu_memcpy", "Memcpy DtoD", 175, 30, tid=7, correlation=2),
        ev("kernel", "loss", 206, 3, tid=7, correlation=9), ev("kernel", "gemm_bwd", 260, 40, tid=7, correlation=3),
        {"ph": "i", "cat": "ac2g", "name": "ac2g", "ts": 110}]}


def test_kernel_windows_are_matched_to_their_actions_by_correlation():
    from labkit.core.actions import Action

    m = gpu_check_module()
    host, kernels = m.profiler_windows(cuda_trace(), "kernels")
    base = 1e6  # microseconds: the trace's baseTimeNanoseconds (1e9 ns)
    assert [(a.stage, a.kind, a.microbatch) for a in kernels] == [(0, "F", 0), (0, "B", 0)]
    assert [(round(a.start * 1e6 - base), round(a.end * 1e6 - base)) for a in kernels] == [(150, 205), (260, 300)]
    assert [(round(a.start * 1e6 - base), round(a.end * 1e6 - base)) for a in host] == [(100, 150), (200, 260)]
    spans = [Action(0, 0, 0, "F", (base + 145) / 1e6, (base + 210) / 1e6),
             Action(0, 0, 0, "B", (base + 255) / 1e6, (base + 301) / 1e6)]
    c = m.compare_actions(spans, kernels)
    assert c["matched"] == 2 and c["contained_share"] == 1.0
    assert c["start_offset_us"]["min"] == pytest.approx(5) and c["duration_diff_us"]["max"] == pytest.approx(10)
    # the device waited for the host: 5 us in each action before its first kernel, over 1 rank x 156 us of step
    assert c["waited_for_host"]["median_us"] == pytest.approx(5)
    assert c["waited_for_host"]["share"] == pytest.approx(10 / 156)


def test_memory_verdict_on_cuda_holds_the_tracker_under_the_allocator():
    m = gpu_check_module()
    mib = 2 ** 20
    row = {"expected_bytes": 3 * mib, "peak_bytes": 3 * mib, "held_after_step": 0, "allocator_readings": 40,
           "input_bytes": mib // 2, "grad_bytes": 4 * mib, "cuda_max_allocated_above_start_bytes": 5 * mib,
           "held_after_first_step": 0}
    verdict, why = m.memory_verdict(row, "cuda")
    assert verdict == "pass" and "the 2.50 MiB the tracker saw allocated in the step (50%)" in why, why
    verdict, why = m.memory_verdict({**row, "cuda_max_allocated_above_start_bytes": 2 * mib}, "cuda")
    assert verdict == "fail" and "less than the 2.50 MiB" in why, why
    verdict, why = m.memory_verdict({**row, "peak_bytes": 2 * mib, "held_after_step": 8}, "cpu")
    assert verdict == "fail" and "expected 3.00 MiB" in why and "8 bytes still held" in why


def test_check_stages_on_a_gpu_may_add_at_most_half_the_steps_peak_to_the_device():
    """Part 4's check_stages verdict (issue 56): pass, and on a GPU the device memory it adds against the
    step's own peak (its float64 and microbatched references on the host); read, not run, here: no GPU."""
    from gpu_checks.live import stages_problems, stages_text

    mib = 2 ** 20
    fine = {"stages_ok": True, "stages_worst": 0.4, "step_peak_bytes": 8 * mib, "check_stages_added_bytes": 3 * mib}
    assert stages_problems(fine) == [] and "adding 3.00 MiB to the device against the step's own peak of 8.00 MiB " \
        "(0.38x)" in stages_text(fine)
    heavy = {**fine, "check_stages_added_bytes": 5 * mib}
    assert stages_problems(heavy) == ["check_stages added 5.00 MiB to the device, more than half the step's own "
                                      "peak (8.00 MiB)"]
    cpu = {**fine, "step_peak_bytes": None, "check_stages_added_bytes": None}
    assert stages_problems(cpu) == [] and "device" not in stages_text(cpu)
    assert "check_stages failed the correct step" in stages_problems({**cpu, "stages_ok": False})[0]


def test_the_gpu_plan_has_every_multi_stage_schedule_twice_and_one_profiled_run(tmp_path):
    m = gpu_check_module()
    items = m.suite_items(m.Check(tmp_path, "cuda", 450.0))
    by_part = {k: [it for it in items if it.part == k] for k in ("1_schedules", "2_tutorial", "3_spans")}
    assert [len(v) for v in by_part.values()] == [10, 10, 1]
    assert {it.config.preset for it in by_part["2_tutorial"] + by_part["3_spans"]} == {"tutorial"}
    assert all(it.config.device == "cuda" and it.config.pp_size == 1 for it in items)
    assert {it.config.stages_per_rank for it in by_part["1_schedules"]} == {2, 4}  # V-shaped: 2, the rest 4
