"""The package stands alone: a built wheel, installed NON-editable into a fresh venv, runs the kit
from any directory (no repository folders read at run time, no PYTHONPATH edits).

The fresh venv borrows torch and the other dependencies from the test's own environment through a
plain path line (so nothing big is installed again); the kit itself comes only from the wheel, and
the test checks that every import and every rank resolves `labkit` inside the fresh venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.launches  # a wheel built and installed in a new venv, then run there (jobs included)

# What the notebooks import (grep notebooks/*.ipynb for "labkit"): all must come from the wheel.
NOTEBOOK_IMPORTS = ["labkit", "labkit.notebook.helpers", "labkit.config.run", "labkit.models.tutorial", "labkit.worker.stages", "labkit.theory",
                    "labkit.timeline.plot", "labkit.timeline.compare", "labkit.logs", "labkit.models.workload", "labkit.launching.sweep", "labkit.timeline.perfetto",
                    "labkit.worker.distributed", "labkit.notebook.explorer", "labkit.check.reference", "labkit.ranks", "labkit.models",
                    "labkit.parallel", "labkit.spans"]

USER_SCRIPT = """
import os, torch.distributed as dist
dist.init_process_group("gloo")
import labkit
print(f"rank {dist.get_rank()} of {dist.get_world_size()} labkit from {os.path.dirname(labkit.__file__)}", flush=True)
dist.barrier(); dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp / "dist")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    wheel = next((tmp / "dist").glob("labkit-*.whl"))
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                           text=True).strip())
    # Dependencies (torch, matplotlib, ...) from this environment; a plain path line runs no .pth of it,
    # so the editable install of the kit there stays invisible.
    (purelib / "zz_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    work = tmp / "elsewhere"  # not the repository: nothing of it is on sys.path there
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LABKIT_RUN_DIR")}
    if os.environ.get("PPLAB_TORCH_IMPORTS"):  # dev.py test's count of torch-importing processes follows them
        env["PYTHONPATH"] = str(REPO / "scripts" / "torch_count")  # (a sitecustomize of its own; no labkit there)
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return {"py": py, "bin": env_dir / "bin", "purelib": purelib, "cwd": work, "env": env, "wheel": wheel}


def _run(fresh, *argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=fresh["cwd"], env=fresh["env"], capture_output=True,
                          text=True, timeout=timeout)


def test_wheel_holds_the_jobs_and_no_repository_folders(fresh):
    import zipfile

    names = zipfile.ZipFile(fresh["wheel"]).namelist()
    assert "labkit/jobs/train.py" in names and "labkit/jobs/controlled_workload.py" in names
    assert "labkit/spans/boot/sitecustomize.py" in names  # what records spans in every rank
    assert not [n for n in names if n.startswith(("scripts/", "tests/", "notebooks/"))]


def test_notebook_imports_come_from_the_wheel(fresh):
    code = ("import importlib, json, sys; mods = json.loads(sys.argv[1]); "
            "print(json.dumps({m: importlib.import_module(m).__file__ for m in mods}))")
    out = _run(fresh, fresh["py"], "-c", code, json.dumps(NOTEBOOK_IMPORTS))
    assert out.returncode == 0, out.stderr
    files = json.loads(out.stdout)
    assert not {m: f for m, f in files.items() if not str(f).startswith(str(fresh["purelib"]))}


def test_labkit_run_from_any_directory(fresh):
    out = _run(fresh, fresh["bin"] / "labkit", "run", "--schedule", "1F1B", "--preset", "tiny", "--quiet",
               "--tolerance", "1e-4", "--out", "r1")
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = fresh["cwd"] / "r1"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["reference_match"] is True and result["schedule"] == "1F1B"
    assert sorted(p.name for p in (run_dir / "spans").iterdir()) == ["rank0.jsonl", "rank1.jsonl"]  # from the wheel
    argv = json.loads((run_dir / "command.json").read_text())["argv"]
    assert argv[-2:] == ["-m", "labkit.jobs.train"], argv  # the job is the package's module, not a repo file

    tl = _run(fresh, fresh["bin"] / "labkit", "timeline", "r1", "--json")
    assert tl.returncode == 0, tl.stderr
    counts = {}
    for a in json.loads(tl.stdout)["actions"]:
        counts[(a["stage"], a["kind"])] = counts.get((a["stage"], a["kind"]), 0) + 1
    assert counts == {(s, k): 4 for s in (0, 1) for k in ("F", "B")}, counts


def test_labkit_launch_and_theory_from_any_directory(fresh):
    (fresh["cwd"] / "mine.py").write_text(USER_SCRIPT)
    out = _run(fresh, fresh["bin"] / "labkit", "launch", "--nproc", "2", "--quiet", "--out", "r2", "mine.py")
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        line = (fresh["cwd"] / "r2").glob(f"logs/*/attempt_0/{rank}/stdout.log").__next__().read_text()
        assert f"rank {rank} of 2 labkit from {fresh['purelib']}" in line, line
    th = _run(fresh, fresh["bin"] / "labkit", "theory", "--schedule", "GPipe", "--pp-size", "2",
              "--microbatches", "4", "--json")
    assert th.returncode == 0, th.stderr
    assert abs(json.loads(th.stdout)["bubble_fraction"] - 0.2) < 1e-9
