#!/usr/bin/env python3
"""Set-up and everyday commands for PP Lab, on a machine that has only python3 (3.11+) and pip.

    python3 scripts/dev.py lab        # create .venv from the lock, start JupyterLab on notebooks/ (127.0.0.1)
    python3 scripts/dev.py test       # same set-up, then the whole test suite (pytest + nbval notebooks), and
                                      # the reference runs, log parser and notebooks again on torch 2.11
    python3 scripts/dev.py test --quick        # the inner loop: the tests that start no job, pool or kernel
    python3 scripts/dev.py test --under-load   # both set-ups, then the same beside one busy process per core
    python3 scripts/dev.py test --legs-beside  # the torch 2.11 leg beside the first, not after it
    python3 scripts/dev.py handouts   # HTML (and PDF, with chromium) handouts of the executed notebooks
    python3 scripts/dev.py bench      # benchmarks of the kit: bench/results.json and bench/RESULTS.md
    python3 scripts/dev.py setup      # only the set-up
    python3 scripts/dev.py lock       # refresh requirements/lab-torch*.txt (uv pip compile; needs the registry);
                                      # pins kept where they fit, `lock --upgrade` moves all to the newest

Environment: `requirements/lab-torch2.15.txt`, a lock of every package at versions tested together
(scripts/envsetup.py installs it). A supported torch (2.11 to 2.15) already in .venv is kept (install
a CUDA build there first on GPU nodes); PPLAB_TORCH="torch==X ..." chooses another; when pip's own
configuration caps torch below the lock, the newest supported torch it allows is installed and that
is said in one line. `test` then builds .venv-torch2.11 from `requirements/lab-torch2.11.txt` for the
other end of the range (`test --one-torch` skips that leg). Any failing set-up step ends with one
message (step, command, fix) and exit code 3.
This file and envsetup.py use only the standard library: they run before anything is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envsetup  # noqa: E402  (beside this file)
from envsetup import SetupError, lock_path, vpython  # noqa: E402

ROOT = envsetup.ROOT
VENV = Path(os.environ.get("PPLAB_VENV", ROOT / ".venv"))
MAIN_TORCH = (2, 15)   # the lock of .venv: the newest the kit supports, what `pip install torch` gives
OTHER_END = (2, 11)    # the oldest it supports (the GPU machines' torch): dev.py test's second leg
OTHER_END_TESTS = ("tests/test_versions.py", "tests/test_pplog.py", "tests/test_reference_runs.py", "tests/test_noise.py",
                   "tests/test_load.py", "notebooks")


def sh(*cmd, **kw) -> None:
    print("+ " + " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def setup(venv_dir: Path = VENV, torch_minor: tuple[int, int] = MAIN_TORCH, keep_torch: bool = True) -> str:
    """The environment from the lock of `torch_minor` (scripts/envsetup.py); returns torch's version."""
    torch_spec = os.environ.get("PPLAB_TORCH") if venv_dir == VENV else os.environ.get("PPLAB_OTHER_TORCH")
    envsetup.check_room([room_of(venv_dir, torch_minor, keep_torch)])
    version = envsetup.setup(venv_dir, lock_path(torch_minor), keep_torch=keep_torch, torch_spec=torch_spec)
    print(f"set-up done: {venv_dir.name} has torch {version}", flush=True)
    return version


def room_of(venv_dir: Path, torch_minor: tuple[int, int], keep_torch: bool) -> tuple[Path, str, bool]:
    """What envsetup.check_room needs to know of one environment to build."""
    return venv_dir, envsetup.locked_torch(envsetup.read_lock(lock_path(torch_minor))), keep_torch


def lab_command(venv_dir: Path) -> list[str]:
    """JupyterLab on notebooks/, listening on 127.0.0.1 only (a remote node is reached through an SSH
    tunnel, README), with no update check; the news prompt is off in the venv's settings overrides."""
    return [str(vpython(venv_dir)), "-m", "jupyterlab", "--notebook-dir", str(ROOT / "notebooks"),
            "--ip", "127.0.0.1", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]


def lab(argv: list[str]) -> int:
    """`dev.py lab [--port N] [--no-browser] [any JupyterLab option]`."""
    if any(a == "--ip" or a.startswith("--ip=") for a in argv):
        print("dev.py lab: JupyterLab listens on 127.0.0.1 only; reach a remote node with an SSH tunnel "
              "(README, 'A lab on a remote node') instead of --ip", file=sys.stderr)
        return 2
    setup()
    doctor = [str(vpython(VENV)), "-m", "labkit", "doctor"]
    print("+ " + " ".join(doctor), flush=True)
    if subprocess.run(doctor).returncode != 0:
        raise SetupError("check the environment (labkit doctor)",
                         "fix what doctor reported above (each problem names its fix), then run the same command again",
                         doctor)
    (ROOT / "notebooks").mkdir(exist_ok=True)
    args = lab_command(VENV)
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
    have = subprocess.run([str(vpython(VENV)), "-c", "import playwright"], capture_output=True).returncode == 0
    if have:
        print("browser test: playwright already installed", flush=True)
        return
    print("browser test: installing playwright (Python package only; the browser is the system chromium)", flush=True)
    try:
        sh(vpython(VENV), "-m", "pip", "install", "--disable-pip-version-check", "-q", "playwright")
    except (subprocess.CalledProcessError, OSError) as e:
        print(f"browser test: could not install playwright ({e}); tests/test_browser.py will be skipped", flush=True)


def test_workers() -> int:
    """How many pytest-xdist workers each leg uses: $PPLAB_TEST_WORKERS, else 2 where there are 2
    cores or more (1 on one core). One worker kept about one of 2 cores busy: a test mostly waits
    for ranks that start, import torch and wait for each other."""
    default = "2" if (os.cpu_count() or 1) >= 2 else "1"
    raw = os.environ.get("PPLAB_TEST_WORKERS", default)
    if not raw.isdigit() or int(raw) < 1:
        raise SetupError("read PPLAB_TEST_WORKERS", f"set it to a whole number >= 1 (1: no parallel workers), got {raw!r}")
    return int(raw)


def pytest_command(venv_dir: Path, paths, argv: list[str], workers: int, serial: bool = False,
                   junit: Path | None = None) -> list[str]:
    """One pytest run of a leg. The parallel pass (workers > 1) gives each worker whole units of work
    (`--dist loadgroup`, units in tests/conftest.py: a file, or every file on the suite's warm pools
    as one), longest first, and leaves out the tests marked `serial`, which end or measure every kit
    process on the machine; `serial` selects only those, run alone after every other test of both legs."""
    cmd = [str(vpython(venv_dir)), "-m", "pytest", "-p", "no:cacheprovider", "--nbval", "--nbval-cell-timeout", "600",
           "--nbval-sanitize-with", str(ROOT / "notebooks" / "sanitize.cfg"), *paths, "-q", "-ra", "--durations=15"]
    if junit is not None:  # each test's seconds, for the units' order (tests/conftest.py UNIT_SECONDS)
        cmd.append(f"--junitxml={junit}")
    if serial:
        return [*cmd, "-m", "serial", *argv]
    if workers > 1:
        cmd += ["-n", str(workers), "--dist", "loadgroup", "--no-loadscope-reorder"]
    return [*cmd, "-m", "not serial", *argv]


def runs_alone(path: Path) -> bool:
    """Whether the notebook at `path` says `labkit.alone` in its metadata (it compares a quiet machine
    with a busy one): tests/conftest.py marks its cells `serial`, so it runs in the serial pass, alone."""
    if path.suffix != ".ipynb" or not path.exists():
        return False
    return bool(json.loads(path.read_text()).get("metadata", {}).get("labkit", {}).get("alone"))


def alone_notebooks() -> list[str]:
    """The notebooks that run alone (`runs_alone`), as paths from the repository's root."""
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if runs_alone(p)]


ARTIFACTS = ROOT / "test-artifacts"  # logs of a test run (git-ignored)
COUNT_DIR = ROOT / "scripts" / "torch_count"  # a sitecustomize that logs each process importing torch
ROLES = ("rank", "agent", "kernel", "script", "pytest")


def imports_log(leg: int) -> Path:
    """Where leg `leg`'s processes that import torch are logged (scripts/torch_count)."""
    return ARTIFACTS / f"torch-imports-leg{leg}.tsv"


def junit_path(leg: int) -> Path:
    """Where leg `leg`'s per-test seconds are written (JUnit XML)."""
    return ARTIFACTS / f"junit-leg{leg}.xml"


def pytest_env(leg: int = 1) -> dict:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1", PPLAB_TORCH_IMPORTS=str(imports_log(leg)))
    env["PYTHONPATH"] = os.pathsep.join([str(COUNT_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def reset_imports_log(leg: int) -> None:
    imports_log(leg).parent.mkdir(exist_ok=True)
    imports_log(leg).write_text("")


def count_imports(leg: int) -> str:
    """One line: how many processes of leg `leg` imported torch, by role (scripts/torch_count)."""
    try:
        rows = [line.split("\t") for line in imports_log(leg).read_text(errors="replace").splitlines() if line]
    except OSError:
        return f"leg {leg}: no count ({imports_log(leg)} is missing)"
    by = {r: sum(1 for row in rows if row[0] == r) for r in ROLES}
    parts = ", ".join(f"{n} {r}{'s' if n != 1 else ''}" for r, n in by.items() if n)
    return f"leg {leg}: {len(rows)} processes imported torch ({parts}); per test: {imports_log(leg)}"


def pytest(venv_dir: Path, paths, argv: list[str], workers: int = 1, serial: bool = False, leg: int = 1) -> int:
    cmd = pytest_command(venv_dir, paths, argv, workers, serial, junit=None if serial else junit_path(leg))
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=pytest_env(leg)).returncode


QUICK_MARKS = "not launches and not serial"


def quick(argv: list[str]) -> int:
    """`dev.py test --quick`: the inner loop. Every test that starts no process importing torch (no
    torchrun job, no live pool, no kernel, no script: theory, search, bounds, parsers, config,
    layers, environment, plots) on .venv, in a few minutes; the rest is marked `launches` (or
    `serial`) and left to the full run. The same count as the full run's proves the marks: a test
    that started a torch-importing process here is named, and the run fails until it is marked."""
    main_torch = setup()
    reset_imports_log(1)
    cmd = [str(vpython(VENV)), "-m", "pytest", "-p", "no:cacheprovider", "tests", "-q", "-ra", "--durations=10",
           "-m", QUICK_MARKS, *argv]
    print("+ " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT, env=pytest_env(1)).returncode
    rows = [line.split("\t") for line in imports_log(1).read_text(errors="replace").splitlines() if line]
    unmarked = sorted({row[2] for row in rows if row[0] != "pytest"})
    print(f"\nquick tier on torch {main_torch}: tests/ without the tests marked launches or serial, and no notebook.",
          flush=True)
    print("left out: the tests marked `launches` (torchrun jobs, live pools, kernels, scripts that import torch),\n"
          "  those marked `serial`, and every notebook under nbval; `python3 scripts/dev.py test` runs them all.",
          flush=True)
    if unmarked:
        print("these tests started processes that import torch: mark them `launches` (pytest.mark.launches):\n  "
              + "\n  ".join(t or "(outside any test)" for t in unmarked), flush=True)
        return rc or 1
    return rc


OTHER_VENV = Path(os.environ.get("PPLAB_OTHER_VENV", ROOT / f".venv-torch{OTHER_END[0]}.{OTHER_END[1]}"))
OTHER_SETUP_LOG = ROOT / "test-artifacts" / f"setup-torch{OTHER_END[0]}.{OTHER_END[1]}.log"


def start_other_setup() -> subprocess.Popen:
    """The second leg's environment, built in the background while the first leg's tests run: at the
    lowest CPU priority (it is mostly a download), its output in a log file, not among the tests'."""
    OTHER_SETUP_LOG.parent.mkdir(exist_ok=True)
    log = open(OTHER_SETUP_LOG, "w")
    nice = (lambda: os.nice(19)) if hasattr(os, "nice") else None
    print(f"(setting up {OTHER_VENV.name} from {lock_path(OTHER_END).name} in the background, at low priority: "
          f"{OTHER_SETUP_LOG.relative_to(ROOT)})", flush=True)
    return subprocess.Popen([sys.executable, __file__, "setup", "--other-end"], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=nice, cwd=ROOT)


def finish_other_setup(proc: subprocess.Popen) -> str:
    """Wait for the background set-up; its torch line and result are shown; a failure is its message."""
    rc = proc.wait()
    lines = OTHER_SETUP_LOG.read_text(errors="replace").splitlines()
    for line in lines:
        if line.startswith(("torch: ", "set-up done: ")):
            print(line, flush=True)
    if rc != 0:
        message = "\n".join(lines[-12:])
        raise SetupError(f"set up {OTHER_VENV.name} (in the background; whole log: {OTHER_SETUP_LOG})",
                         "see the message above", None, message)
    return envsetup.installed_torch(OTHER_VENV) or "?"


# A busy process: pure Python spinning at normal priority. It checks every few milliseconds of its
# CPU time that dev.py (its pid given, not read at the spinner's start: dev.py may be gone by then)
# is still its parent and ends once it is not, so a dev.py killed with SIGKILL leaves no spinner behind.
SPINNER = "import os\nwhile os.getppid() == {parent}:\n    for _ in range(200_000): pass\n"


def load_size() -> int:
    """How many busy processes `test --under-load` runs: one per core."""
    return os.cpu_count() or 1


class BusyLoad:
    """`with BusyLoad(n):` n processes keep every core busy while the block runs; they are killed when
    it ends, whatever ends it (a failure, Ctrl-C). Timing claims of the suite must hold beside them."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self) -> "BusyLoad":
        self.procs = [subprocess.Popen([sys.executable, "-c", SPINNER.format(parent=os.getpid())],
                                       stdin=subprocess.DEVNULL)
                      for _ in range(self.n)]
        print(f"(under load: {self.n} busy processes, one per core, run beside the tests at normal priority: "
              f"pids {' '.join(str(p.pid) for p in self.procs)})", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        print(f"(under load: the {self.n} busy processes were stopped)", flush=True)


def test(argv: list[str]) -> int:
    """The whole suite on .venv's torch (2.15 from the lock, or what a cap allows), then, unless
    `--one-torch`, the version-dependent part (torch's API table, the log parser, the reference runs,
    every notebook) on the other end of the supported range, in .venv-torch2.11, whose set-up runs
    in the background during the first leg. Fails if either leg fails. `--under-load`: both legs run
    beside one busy process per core (BusyLoad), started after the set-up and stopped at the end."""
    if "--quick" in argv:
        return quick([a for a in argv if a != "--quick"])
    under_load = "--under-load" in argv
    argv = [a for a in argv if a != "--under-load"]
    if "--one-torch" not in argv:  # room for both environments, before the first one downloads anything
        envsetup.check_room([room_of(VENV, MAIN_TORCH, True), room_of(OTHER_VENV, OTHER_END, False)])
    main_torch = setup()
    ensure_browser()
    if under_load:  # the load starts after every set-up: installing is not what it tests
        if "--one-torch" not in argv:  # the second leg's too, here and now: in the background, at the lowest
            # priority, beside busy processes of normal priority it barely moved (12 minutes for 13 s of CPU)
            setup(OTHER_VENV, OTHER_END, keep_torch=False)
        with BusyLoad(load_size()):
            return test_legs(argv, main_torch, other_ready=True)
    return test_legs(argv, main_torch)


def test_legs(argv: list[str], main_torch: str, other_ready: bool = False) -> int:
    """Leg 1 (tests + notebooks on .venv) in the foreground with live output; leg 2 (the other end of
    the range) after it (beside it with `--legs-beside`, as soon as its background set-up is done),
    its output kept in a log file that is shown when it ends; then the `serial` tests, alone. Each
    leg runs on `test_workers()` pytest workers. Fails if any of them fails."""
    one_torch, beside = "--one-torch" in argv, "--legs-beside" in argv
    argv = [a for a in argv if a not in ("--one-torch", "--legs-beside")]
    workers = test_workers()
    import threading
    leg1_done = threading.Event()
    # leg 2 starts after leg 1 (the CI default: one leg's load at a time, each leg on its workers);
    # `--legs-beside` starts it as soon as its environment is built.
    other = None if one_torch else OtherLeg(argv, workers=workers, after=None if beside else leg1_done, ready=other_ready)
    reset_imports_log(1)
    try:
        main_rc = pytest(VENV, ("tests", "notebooks"), argv, workers)
        leg1_done.set()
        other_rc = other.finish() if other is not None else 0
    except BaseException:
        if other is not None:
            other.kill()
        raise
    print("\n== tests that end, count or time every kit process on the machine (marked serial), alone ==", flush=True)
    serial_rc = pytest(VENV, ("tests", *alone_notebooks()), argv, serial=True)
    serial_rc = 0 if serial_rc == 5 else serial_rc  # none selected (e.g. by -k): nothing to run alone
    if other is not None and other.rc is not None:  # leg 2's serial tests on its torch, alone too
        other_tests = [p for p in OTHER_END_TESTS if p.startswith("tests/")] + alone_notebooks()
        rc = pytest(OTHER_VENV, other_tests, argv, serial=True, leg=2)
        other_rc = other_rc or (0 if rc == 5 else rc)
    verdict = lambda rc: "passed" if rc == 0 else f"FAILED (pytest exit {rc})"  # noqa: E731
    said = f"\nwhole suite on torch {main_torch}: {verdict(main_rc or serial_rc)}"
    if other is not None:
        said += f"; {', '.join(OTHER_END_TESTS)} on torch {other.torch}: {verdict(other_rc)}"
    print(said, flush=True)
    print("processes that imported torch (ranks, torchrun agents, kernels, scripts, pytest itself):", flush=True)
    for leg in (1,) if other is None else (1, 2):
        print("  " + count_imports(leg), flush=True)
    return main_rc or serial_rc or other_rc


OTHER_LEG_LOG = ROOT / "test-artifacts" / f"leg-torch{OTHER_END[0]}.{OTHER_END[1]}.log"


class OtherLeg:
    """The second leg: its set-up (background, low priority), then its tests, in a thread beside the
    first leg. `finish()` waits for it, shows its whole output and returns pytest's exit code; a
    failed set-up is raised there as the SetupError it is. `ready`: its environment is built already
    (`test --under-load` builds it before the load starts): no background set-up."""

    def __init__(self, argv: list[str], workers: int = 1, after=None, ready: bool = False):
        import threading
        self.argv, self.workers, self.torch, self.rc, self.error, self.proc = argv, workers, "?", None, None, None
        self.after = after  # a threading.Event to wait for before the tests start (None: start at once)
        self.setup = None if ready else start_other_setup()
        self.killed = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.torch = (envsetup.installed_torch(OTHER_VENV) or "?") if self.setup is None \
                else finish_other_setup(self.setup)
        except SetupError as e:
            self.error = e
            return
        if self.after is not None:
            self.after.wait()
        cmd = pytest_command(OTHER_VENV, OTHER_END_TESTS, self.argv, workers=self.workers, junit=junit_path(2))
        with open(OTHER_LEG_LOG, "w") as log:
            log.write("+ " + " ".join(cmd) + "\n")
            log.flush()
            if self.killed:
                return
            print(f"(leg 2 started: torch {self.torch}, output in {OTHER_LEG_LOG.relative_to(ROOT)})",
                  flush=True)
            reset_imports_log(2)
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=pytest_env(2), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
            self.rc = self.proc.wait()

    def finish(self) -> int:
        if self.thread.is_alive():
            print(f"\n(waiting for leg 2, torch {OTHER_END[0]}.{OTHER_END[1]}: {OTHER_LEG_LOG.relative_to(ROOT)})",
                  flush=True)
        self.thread.join()
        if self.error is not None:
            raise self.error
        print(f"\n== the other end of the supported range: {lock_path(OTHER_END).name} in {OTHER_VENV.name} ==",
              flush=True)
        print(OTHER_LEG_LOG.read_text(errors="replace"), end="", flush=True)
        return self.rc if self.rc is not None else 1

    def kill(self) -> None:
        self.killed = True
        if self.after is not None:
            self.after.set()
        if self.setup is not None:
            self.setup.kill()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def handouts(argv: list[str]) -> int:
    """Handouts that print cleanly (scripts/handouts.py): HTML with math as MathML, wrapped code and
    widgets as text, and PDFs printed by Chromium when present. `--execute` runs the notebooks again
    first (the committed outputs are used otherwise); names of notebooks limit it to those."""
    setup()
    return subprocess.run([str(vpython(VENV)), str(ROOT / "scripts" / "handouts.py"), *argv], cwd=ROOT).returncode


def bench(argv: list[str]) -> int:
    """The benchmarks: bench/results.json and bench/RESULTS.md (see scripts/bench.py)."""
    setup()
    return subprocess.run([str(vpython(VENV)), str(ROOT / "scripts" / "bench.py"), *argv], cwd=ROOT).returncode


COMMANDS = ("lab", "test", "setup", "handouts", "bench", "lock")


def as_setup_error(e: Exception) -> SetupError:
    """Any failure of a set-up step as the one message users see: a step run with sh() (apt-get, a
    helper; its output is above) or a file the set-up writes (full disk, no permission)."""
    if isinstance(e, subprocess.CalledProcessError):
        return SetupError(f"run {Path(str(e.cmd[0])).name}", "read its output above; fix what it names (disk space, "
                          "network, permissions)", list(e.cmd), f"exit code {e.returncode}")
    if isinstance(e, OSError):
        return SetupError(f"write {e.filename or 'a file'}", "check the disk has room (df -h) and the folder is "
                          "writable", None, f"{type(e).__name__}: {e.strerror or e}")
    return e


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "setup":
            if "--other-end" in rest:  # the second leg's environment (dev.py test builds it in the background)
                setup(OTHER_VENV, OTHER_END, keep_torch=False)
            else:
                setup()
            return 0
        if cmd == "lock":
            return envsetup.lock(ROOT / ".venv-tools", upgrade="--upgrade" in rest)
        return {"lab": lab, "test": test, "handouts": handouts, "bench": bench}[cmd](rest)
    except (SetupError, subprocess.CalledProcessError, OSError) as e:
        print(f"\ndev.py {cmd}: {as_setup_error(e)}", file=sys.stderr, flush=True)
        return 3
    except KeyboardInterrupt:
        print(f"\ndev.py {cmd}: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
