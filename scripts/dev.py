#!/usr/bin/env python3
"""Set-up and everyday commands for PP Lab, on a machine that has only python3 and pip.

    python3 scripts/dev.py lab        # create .venv, install torch + the kit, start JupyterLab on notebooks/
    python3 scripts/dev.py test       # same set-up, then the whole test suite (pytest + nbval notebooks), and
                                      # the reference runs, log parser and notebooks again on torch 2.11
    python3 scripts/dev.py handouts   # HTML (and PDF, with chromium) handouts of the executed notebooks
    python3 scripts/dev.py bench      # benchmarks of the kit: bench/results.json and bench/RESULTS.md
    python3 scripts/dev.py setup      # only the set-up

Torch: the kit supports 2.11 to 2.15. An existing torch >= 2.11 in .venv is kept (install a CUDA
build there first on GPU nodes); otherwise `torch==2.15.0`, the newest supported, is installed
(override with PPLAB_TORCH, e.g. PPLAB_TORCH="torch==2.13.0"). `test` then builds a second
environment, .venv-torch2.11, for the other end of the range (PPLAB_OTHER_TORCH overrides it;
`test --one-torch` skips that leg).
This file uses only the standard library: it must run before anything is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("PPLAB_VENV", ROOT / ".venv"))
DEFAULT_TORCH = "torch==2.15.0"  # the newest the kit supports (labkit/versions.py), what `pip install torch` gives
OTHER_END_TORCH = "torch==2.11.0"  # the oldest it supports (the GPU machines' torch)
MIN_TORCH = (2, 11)  # = labkit.versions.SUPPORTED[0]; this file cannot import labkit before it is installed
OTHER_END_TESTS = ("tests/test_versions.py", "tests/test_pplog.py", "tests/test_reference_runs.py", "notebooks")


def vpython(venv: Path = VENV) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def sh(*cmd, **kw) -> None:
    print("+ " + " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def torch_version(venv: Path = VENV) -> tuple[int, int] | None:
    r = subprocess.run([str(vpython(venv)), "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True)
    if r.returncode:
        return None
    major, minor = r.stdout.strip().split("+")[0].split(".")[:2]
    return int(major), int(minor)


def spec_version(spec: str) -> tuple[int, int] | None:
    """(2, 11) for 'torch==2.11.0 --index-url ...'; None when the spec pins no version."""
    pin = spec.split()[0].partition("==")[2]
    return tuple(int(x) for x in pin.split(".")[:2]) if pin else None


def setup(extras: str = "lab,test", venv_dir: Path = VENV, torch_spec: str | None = None) -> None:
    """A virtual environment with torch and the kit (editable). With `torch_spec`, torch is that one
    exactly (reinstalled if another is there); without, a supported torch already there is kept."""
    if not vpython(venv_dir).exists():
        print(f"creating virtual environment {venv_dir}", flush=True)
        venv.EnvBuilder(with_pip=True).create(venv_dir)
    have = torch_version(venv_dir)
    if torch_spec is not None:
        want = spec_version(torch_spec)
        install = have is None or (want is not None and have != want)
    else:
        torch_spec = os.environ.get("PPLAB_TORCH", DEFAULT_TORCH)
        install = have is None or have < MIN_TORCH
    if install:
        # torch first and pinned, so that the kit's `torch>=2.11` is already met.
        sh(vpython(venv_dir), "-m", "pip", "install", "--disable-pip-version-check", *torch_spec.split())
    sh(vpython(venv_dir), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-e", f"{ROOT}[{extras}]")


def lab(argv: list[str]) -> int:
    setup()
    sh(vpython(), "-m", "labkit", "doctor")
    (ROOT / "notebooks").mkdir(exist_ok=True)
    args = [str(vpython()), "-m", "jupyterlab", "--notebook-dir", str(ROOT / "notebooks"), "--ip", "127.0.0.1"]
    if os.name == "posix" and os.geteuid() == 0:
        args.append("--allow-root")  # containers and workshop VMs often run as root; Jupyter refuses without it
    args += argv
    print("+ " + " ".join(args), flush=True)
    os.execv(args[0], args)  # JupyterLab takes over this terminal; Ctrl-C stops it


def ensure_browser() -> None:
    """Chromium (Debian's package, via apt-get as root) and Playwright's Python package, for
    tests/test_browser.py. Never fails: without them that test skips and says why. Playwright's own
    browser download (`playwright install`) is not used: it fails where only package registries are
    reachable, and the test drives the system chromium instead."""
    found = shutil.which("chromium")
    if found:
        print(f"browser test: chromium found at {found}", flush=True)
    elif os.name == "posix" and os.geteuid() == 0 and shutil.which("apt-get"):
        print("browser test: chromium is missing; installing it with apt-get", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        try:
            sh("apt-get", "update", "-q", env=env)
            sh("apt-get", "install", "-y", "-q", "chromium", env=env)
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"browser test: could not install chromium ({e}); tests/test_browser.py will be skipped", flush=True)
    else:
        print("browser test: chromium is missing and apt-get cannot be used here (needs root on Debian/Ubuntu); "
              "tests/test_browser.py will be skipped. Install chromium to run it.", flush=True)
    have = subprocess.run([str(vpython()), "-c", "import playwright"], capture_output=True).returncode == 0
    if have:
        print("browser test: playwright already installed", flush=True)
        return
    print("browser test: installing playwright (Python package only; the browser is the system chromium)", flush=True)
    try:
        sh(vpython(), "-m", "pip", "install", "--disable-pip-version-check", "-q", "playwright")
    except (subprocess.CalledProcessError, OSError) as e:
        print(f"browser test: could not install playwright ({e}); tests/test_browser.py will be skipped", flush=True)


def pytest(venv_dir: Path, paths, argv: list[str]) -> int:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    cmd = [str(vpython(venv_dir)), "-m", "pytest", "-p", "no:cacheprovider", "--nbval", "--nbval-cell-timeout", "600",
           "--nbval-sanitize-with", str(ROOT / "notebooks" / "sanitize.cfg"), *paths, "-q", "-ra", "--durations=15",
           *argv]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def test(argv: list[str]) -> int:
    """The whole suite on .venv's torch (2.15 by default), then, unless `--one-torch`, the version-
    dependent part (torch's API table, the log parser, the reference runs, every notebook) on the
    other end of the supported range, in .venv-torch2.11. Fails if either leg fails."""
    one_torch = "--one-torch" in argv
    argv = [a for a in argv if a != "--one-torch"]
    setup()
    ensure_browser()
    main_rc = pytest(VENV, ("tests", "notebooks"), argv)
    if one_torch:
        return main_rc
    other_spec = os.environ.get("PPLAB_OTHER_TORCH", OTHER_END_TORCH)
    want = spec_version(other_spec)
    other_venv = ROOT / f".venv-torch{want[0]}.{want[1]}" if want else ROOT / ".venv-other-torch"
    print(f"\n== the other end of the supported range: {other_spec} in {other_venv.name} ==", flush=True)
    setup(venv_dir=other_venv, torch_spec=other_spec)
    other_rc = pytest(other_venv, OTHER_END_TESTS, argv)
    print(f"\nwhole suite on torch {torch_version()}: {'passed' if main_rc == 0 else f'FAILED (pytest exit {main_rc})'}; "
          f"{', '.join(OTHER_END_TESTS)} on torch {torch_version(other_venv)}: "
          f"{'passed' if other_rc == 0 else f'FAILED (pytest exit {other_rc})'}", flush=True)
    return main_rc or other_rc


def handouts(argv: list[str]) -> int:
    """Handouts that print cleanly (scripts/handouts.py): HTML with math as MathML, wrapped code and
    widgets as text, and PDFs printed by Chromium when present. `--execute` runs the notebooks again
    first (the committed outputs are used otherwise); names of notebooks limit it to those."""
    setup()
    return subprocess.run([str(vpython()), str(ROOT / "scripts" / "handouts.py"), *argv], cwd=ROOT).returncode


def bench(argv: list[str]) -> int:
    """The benchmarks: bench/results.json and bench/RESULTS.md (see scripts/bench.py)."""
    setup()
    return subprocess.run([str(vpython()), str(ROOT / "scripts" / "bench.py"), *argv], cwd=ROOT).returncode


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("lab", "test", "setup", "handouts", "bench"):
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "setup":
        setup()
        return 0
    return {"lab": lab, "test": test, "handouts": handouts, "bench": bench}[cmd](rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
