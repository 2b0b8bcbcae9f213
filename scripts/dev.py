#!/usr/bin/env python3
"""Set-up and everyday commands for PP Lab, on a machine that has only python3 (3.11+) and pip.

    python3 scripts/dev.py lab        # create .venv from the lock, start JupyterLab on notebooks/ (127.0.0.1)
    python3 scripts/dev.py lab --torch 2.13   # the same on another supported torch, in .venv-torch2.13
    python3 scripts/dev.py test       # same set-up, then the whole test suite (pytest + nbval notebooks), and
                                      # the reference runs, log parser and notebooks again on torch 2.11,
                                      # then what asks labkit.versions' release table, and the hang
                                      # diagnosis, on a middle release
    python3 scripts/dev.py test --quick        # the inner loop: the tests that start no job, pool or kernel
    python3 scripts/dev.py test --under-load   # every set-up, then the same beside one busy process per core
    python3 scripts/dev.py test --legs-beside  # the later legs beside the first, not after it
    python3 scripts/dev.py test --no-middle    # without leg 3 (a middle release; PPLAB_MIDDLE_TORCH=2.12 picks one)
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
other end of the range, and .venv-torch2.1X for one middle release (2.12, 2.13 or 2.14: the commit
picks it, PPLAB_MIDDLE_TORCH=2.13 chooses; the floors lock with that torch) for the notebooks and
tests that ask what a release does (`test --no-middle` skips that leg, `--one-torch` both). Any
failing set-up step ends with one message (step, command, fix) and exit code 3.
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
MIDDLE = {(2, 12): "torch==2.12.1", (2, 13): "torch==2.13.0", (2, 14): "torch==2.14.1"}
"""The supported releases between the two ends, each as the patch release its table row was measured on."""
DIAGNOSIS_TESTS = ("tests/test_hangs.py",)
"""Where a hung or failed job is stuck, and why (labkit.timeline.stuck): it reads torch's pipelining logs and
the ranks' stacks, whose lines and waits move between releases (torch 2.13's Schedule1F1B waits for its
previous send inline, 2.15 in a helper it names), so leg 3 runs it on a middle release too (issue 63)."""
MIDDLE_TESTS = ("tests/test_versions.py", "notebooks/02_tracer_split.ipynb", "notebooks/06_reading_pp_logs.ipynb",
                "notebooks/09_gotchas.ipynb", "notebooks/11_your_own_model.ipynb",
                "notebooks/14_pipelining_in_practice.ipynb") + DIAGNOSIS_TESTS
"""Leg 3, on one middle release: every notebook and test that asks labkit.versions.fact what a release does
(or still compares releases by hand), and the table's own tests (its feature probes: what a notebook asks
with versions.has takes one of the two paths the ends run); and the hang diagnosis (DIAGNOSIS_TESTS).
tests/test_setup.py keeps it complete."""


def sh(*cmd, **kw) -> None:
    print("+ " + " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def setup(venv_dir: Path = VENV, torch_minor: tuple[int, int] = MAIN_TORCH, keep_torch: bool = True,
          torch_spec: str | None = None) -> str:
    """The environment from the lock of `torch_minor` (scripts/envsetup.py); returns torch's version.
    `torch_spec`: this torch instead of the lock's (the middle release's leg); else $PPLAB_TORCH for .venv,
    $PPLAB_OTHER_TORCH for another."""
    spec_from = "the middle release's leg of dev.py test"
    if torch_spec is None:
        spec_from = "PPLAB_TORCH" if venv_dir == VENV else "PPLAB_OTHER_TORCH"
        torch_spec = os.environ.get(spec_from)
    envsetup.check_room([room_of(venv_dir, torch_minor, keep_torch)])
    version = envsetup.setup(venv_dir, lock_path(torch_minor), keep_torch=keep_torch, torch_spec=torch_spec,
                             spec_from=spec_from)
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


def lab_venv(argv: list[str]) -> tuple[Path, list[str]]:
    """`lab --torch X.Y`: the environment of that supported release beside the lab's own (2.11: the floors
    lock, .venv-torch2.11; 2.12-2.14: the floors lock with that torch, .venv-torch2.1X; the newest: .venv),
    set up if needed; the other arguments go to JupyterLab."""
    if "--torch" not in argv:
        setup()
        return VENV, argv
    i = argv.index("--torch")
    wanted = argv[i + 1] if i + 1 < len(argv) else ""
    rest = argv[:i] + argv[i + 2:]
    known = {minor_text(OTHER_END): other_end_leg, **{minor_text(m): (lambda m=m: middle_leg(m)) for m in MIDDLE}}
    if wanted == minor_text(MAIN_TORCH):
        setup()
        return VENV, rest
    if wanted not in known:
        raise SetupError("read --torch", f"give one supported release: {', '.join([*known, minor_text(MAIN_TORCH)])} "
                         f"(e.g. `python3 scripts/dev.py lab --torch 2.13`), got {wanted!r}")
    leg = known[wanted]()
    print(f"dev.py lab: torch {wanted} in {leg.venv.name} (beside .venv, which keeps the lab's own)", flush=True)
    leg.build()
    return leg.venv, rest


def lab(argv: list[str]) -> int:
    """`dev.py lab [--torch X.Y] [--port N] [--no-browser] [any JupyterLab option]`."""
    if any(a == "--ip" or a.startswith("--ip=") for a in argv):
        print("dev.py lab: JupyterLab listens on 127.0.0.1 only; reach a remote node with an SSH tunnel "
              "(README, 'A lab on a remote node') instead of --ip", file=sys.stderr)
        return 2
    venv, argv = lab_venv(argv)
    doctor = [str(vpython(venv)), "-m", "labkit", "doctor"]
    print("+ " + " ".join(doctor), flush=True)
    if subprocess.run(doctor).returncode != 0:
        raise SetupError("check the environment (labkit doctor)",
                         "fix what doctor reported above (each problem names its fix), then run the same command again",
                         doctor)
    (ROOT / "notebooks").mkdir(exist_ok=True)
    args = lab_command(venv)
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


def minor_text(minor: tuple[int, int]) -> str:
    return f"{minor[0]}.{minor[1]}"


def shown(path: Path) -> str:
    """A path as said to the user: from the repository's root when it lies inside."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def middle_release() -> tuple[int, int]:
    """The middle release (a key of MIDDLE) that leg 3 runs on: $PPLAB_MIDDLE_TORCH ("2.12", "2.13" or
    "2.14"), else the commit checked out picks one (its hash, modulo 3): a run repeats on the same
    release, and successive commits go round all three. Without git (an exported tree): 2.13."""
    chosen = os.environ.get("PPLAB_MIDDLE_TORCH")
    if chosen:
        by_text = {minor_text(m): m for m in MIDDLE}
        if chosen not in by_text:
            raise SetupError("read PPLAB_MIDDLE_TORCH", f"set it to one of {', '.join(by_text)} (a supported release "
                             f"between the two ends), got {chosen!r}")
        return by_text[chosen]
    minors = sorted(MIDDLE)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return minors[int(head[:12], 16) % len(minors)]
    except (OSError, ValueError):  # no git, or not a checkout
        return (2, 13)


def middle_venv(minor: tuple[int, int]) -> Path:
    """Leg 3's environment for the middle release `minor`: $PPLAB_MIDDLE_VENV, else .venv-torch<X.Y>."""
    return Path(os.environ.get("PPLAB_MIDDLE_VENV", ROOT / f".venv-torch{minor_text(minor)}"))


class LegSpec:
    """A leg after the first: which torch (the release, and the pip spec that installs it over the
    floors lock, or None: the lock's own), where its environment is, what it runs, and its logs."""

    def __init__(self, number: int, minor: tuple[int, int], venv: Path, tests: tuple[str, ...], torch_spec=None):
        self.number, self.minor, self.venv, self.tests, self.torch_spec = number, minor, venv, tests, torch_spec

    @property
    def setup_args(self) -> list[str]:
        """`dev.py setup`'s arguments that build this leg's environment."""
        return ["--other-end"] if self.torch_spec is None else ["--middle", minor_text(self.minor)]

    @property
    def setup_log(self) -> Path:
        return ARTIFACTS / f"setup-torch{minor_text(self.minor)}.log"

    @property
    def log(self) -> Path:
        return ARTIFACTS / f"leg-torch{minor_text(self.minor)}.log"

    def room(self) -> tuple[Path, str, bool]:
        """What envsetup.check_room needs to know of this leg's environment."""
        want = self.torch_spec.split("==")[1] if self.torch_spec else \
            envsetup.locked_torch(envsetup.read_lock(lock_path(OTHER_END)))
        return self.venv, want, False

    def build(self) -> str:
        """Set up this leg's environment in the foreground; returns torch's version."""
        return setup(self.venv, OTHER_END, keep_torch=False, torch_spec=self.torch_spec)


def other_end_leg() -> LegSpec:
    """Leg 2: the oldest supported release, the floors lock as it is."""
    return LegSpec(2, OTHER_END, OTHER_VENV, OTHER_END_TESTS)


def middle_leg(minor: tuple[int, int] | None = None) -> LegSpec:
    """Leg 3: a middle release (`middle_release()` unless given) over the floors lock, for MIDDLE_TESTS."""
    minor = minor or middle_release()
    return LegSpec(3, minor, middle_venv(minor), MIDDLE_TESTS, MIDDLE[minor])


def start_setup(spec: LegSpec) -> subprocess.Popen:
    """A later leg's environment, built in the background while the first leg's tests run: at the
    lowest CPU priority (it is mostly a download), its output in a log file, not among the tests'."""
    spec.setup_log.parent.mkdir(parents=True, exist_ok=True)
    log = open(spec.setup_log, "w")
    nice = (lambda: os.nice(19)) if hasattr(os, "nice") else None
    what = lock_path(OTHER_END).name + (f" with {spec.torch_spec}" if spec.torch_spec else "")
    print(f"(setting up {spec.venv.name} from {what} in the background, at low priority: {shown(spec.setup_log)})",
          flush=True)
    return subprocess.Popen([sys.executable, __file__, "setup", *spec.setup_args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=nice, cwd=ROOT)


def finish_setup(spec: LegSpec, proc: subprocess.Popen) -> str:
    """Wait for the background set-up; its torch line and result are shown; a failure is its message."""
    rc = proc.wait()
    lines = spec.setup_log.read_text(errors="replace").splitlines()
    for line in lines:
        if line.startswith(("torch: ", "set-up done: ")):
            print(line, flush=True)
    if rc != 0:
        message = "\n".join(lines[-12:])
        raise SetupError(f"set up {spec.venv.name} (in the background; whole log: {spec.setup_log})",
                         "see the message above", None, message)
    return envsetup.installed_torch(spec.venv) or "?"


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
        # each in its own session, as other programs on a laptop are: Linux's autogroup shares the CPU
        # between sessions first, and spinners in dev.py's one session weighed as a single program
        self.procs = [subprocess.Popen([sys.executable, "-c", SPINNER.format(parent=os.getpid())],
                                       stdin=subprocess.DEVNULL, start_new_session=True)
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
    every notebook) on the other end of the supported range, in .venv-torch2.11, and, unless
    `--no-middle` too, what asks labkit.versions what a release does (MIDDLE_TESTS) on one middle
    release (`middle_release()`); their set-ups run in the background during the first leg. Fails if
    any leg fails. `--under-load`: the legs run beside one busy process per core (BusyLoad), started
    after the set-up and stopped at the end."""
    if "--quick" in argv:
        return quick([a for a in argv if a != "--quick"])
    under_load = "--under-load" in argv
    argv = [a for a in argv if a != "--under-load"]
    later = later_legs(argv)
    if later:  # room for every environment, before the first one downloads anything
        envsetup.check_room([room_of(VENV, MAIN_TORCH, True)] + [leg.room() for leg in later])
    main_torch = setup()
    ensure_browser()
    if under_load:  # the load starts after every set-up: installing is not what it tests
        for leg in later:  # the later legs' too, here and now: in the background, at the lowest priority,
            leg.build()    # beside busy processes of normal priority, it barely moved (12 minutes for 13 s of CPU)
        with BusyLoad(load_size()):
            return test_legs(argv, main_torch, other_ready=True)
    return test_legs(argv, main_torch)


def later_legs(argv: list[str]) -> list[LegSpec]:
    """The legs after the first that `dev.py test argv` runs: none with `--one-torch`; the other end
    (leg 2); the middle release (leg 3) unless `--no-middle`."""
    if "--one-torch" in argv:
        return []
    return [other_end_leg()] + ([] if "--no-middle" in argv else [middle_leg()])


def serial_paths(spec: LegSpec) -> list[str]:
    """What a later leg's serial pass runs: its test files, and the notebooks it runs that run alone."""
    alone = [nb for nb in alone_notebooks() if any(nb == p or nb.startswith(p.rstrip("/") + "/") for p in spec.tests)]
    return [p for p in spec.tests if p.startswith("tests/")] + alone


def test_legs(argv: list[str], main_torch: str, other_ready: bool = False) -> int:
    """Leg 1 (tests + notebooks on .venv) in the foreground with live output; leg 2 (the other end of
    the range) after it, then leg 3 (a middle release) after leg 2 (with `--legs-beside`, each as soon
    as its background set-up is done), their output kept in log files that are shown when they end;
    then the `serial` tests, alone. Each leg runs on `test_workers()` pytest workers. Fails if any of
    them fails."""
    beside = "--legs-beside" in argv
    later = later_legs(argv)
    argv = [a for a in argv if a not in ("--one-torch", "--legs-beside", "--no-middle")]
    workers = test_workers()
    import threading
    leg1_done = threading.Event()
    # each later leg starts after the one before it (the CI default: one leg's load at a time, each leg on
    # its workers); `--legs-beside` starts each as soon as its environment is built.
    others: list = []
    try:
        for spec in later:
            after = None if beside else (others[-1].done if others else leg1_done)
            others.append(OtherLeg(argv, workers=workers, after=after, ready=other_ready, spec=spec))
        reset_imports_log(1)
        main_rc = pytest(VENV, ("tests", "notebooks"), argv, workers)
        leg1_done.set()
        other_rcs = [leg.finish() for leg in others]
    except BaseException:
        for leg in others:
            leg.kill()
        raise
    print("\n== tests that end, count or time every kit process on the machine (marked serial), alone ==", flush=True)
    serial_rc = pytest(VENV, ("tests", *alone_notebooks()), argv, serial=True)
    serial_rc = 0 if serial_rc == 5 else serial_rc  # none selected (e.g. by -k): nothing to run alone
    for i, leg in enumerate(others):  # each later leg's serial tests on its torch, alone too
        if leg.rc is not None:
            rc = pytest(leg.spec.venv, serial_paths(leg.spec), argv, serial=True, leg=leg.spec.number)
            other_rcs[i] = other_rcs[i] or (0 if rc == 5 else rc)
    verdict = lambda rc: "passed" if rc == 0 else f"FAILED (pytest exit {rc})"  # noqa: E731
    said = f"\nwhole suite on torch {main_torch}: {verdict(main_rc or serial_rc)}"
    for leg, rc in zip(others, other_rcs):
        said += f"; {', '.join(leg.spec.tests)} on torch {leg.torch}: {verdict(rc)}"
    print(said, flush=True)
    print("processes that imported torch (ranks, torchrun agents, kernels, scripts, pytest itself):", flush=True)
    for n in [1] + [leg.spec.number for leg in others]:
        print("  " + count_imports(n), flush=True)
    return main_rc or serial_rc or next((rc for rc in other_rcs if rc), 0)


class OtherLeg:
    """A leg after the first (`spec`; leg 2, the other end, unless given): its set-up (background, low
    priority), then its tests, in a thread beside the first leg. `finish()` waits for it, shows its
    whole output and returns pytest's exit code; a failed set-up is raised there as the SetupError it
    is. `ready`: its environment is built already (`test --under-load` builds it before the load
    starts): no background set-up. `done` is set once its tests ended (or it stopped): the next leg's
    `after`."""

    def __init__(self, argv: list[str], workers: int = 1, after=None, ready: bool = False, spec: LegSpec | None = None):
        import threading
        self.spec = spec or other_end_leg()
        self.argv, self.workers, self.torch, self.rc, self.error, self.proc = argv, workers, "?", None, None, None
        self.after = after  # a threading.Event to wait for before the tests start (None: start at once)
        self.done = threading.Event()
        self.setup = None if ready else start_setup(self.spec)
        self.killed = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._run_tests()
        finally:
            self.done.set()

    def _run_tests(self) -> None:
        spec = self.spec
        try:
            self.torch = (envsetup.installed_torch(spec.venv) or "?") if self.setup is None \
                else finish_setup(spec, self.setup)
        except SetupError as e:
            self.error = e
            return
        if self.after is not None:
            self.after.wait()
        cmd = pytest_command(spec.venv, spec.tests, self.argv, workers=self.workers, junit=junit_path(spec.number))
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log, "w") as log:
            log.write("+ " + " ".join(cmd) + "\n")
            log.flush()
            if self.killed:
                return
            print(f"(leg {spec.number} started: torch {self.torch}, output in {shown(spec.log)})", flush=True)
            reset_imports_log(spec.number)
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=pytest_env(spec.number), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self.rc = self.proc.wait()

    def finish(self) -> int:
        spec = self.spec
        if self.thread.is_alive():
            print(f"\n(waiting for leg {spec.number}, torch {minor_text(spec.minor)}: {shown(spec.log)})", flush=True)
        self.thread.join()
        if self.error is not None:
            raise self.error
        title = ("the other end of the supported range" if spec.torch_spec is None else
                 f"a middle release (the tests that ask labkit.versions what a release does; PPLAB_MIDDLE_TORCH="
                 f"{'/'.join(minor_text(m) for m in MIDDLE)} picks it)")
        with_torch = f" with {spec.torch_spec}" if spec.torch_spec else ""
        print(f"\n== leg {spec.number}, {title}: {lock_path(OTHER_END).name}{with_torch} in {spec.venv.name} ==",
              flush=True)
        print(spec.log.read_text(errors="replace"), end="", flush=True)
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
                other_end_leg().build()
            elif "--middle" in rest:  # the third leg's: `setup --middle [2.13]` (default: middle_release())
                chosen = rest[rest.index("--middle") + 1:][:1]
                if chosen and not chosen[0].startswith("-"):
                    os.environ["PPLAB_MIDDLE_TORCH"] = chosen[0]
                middle_leg().build()
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
