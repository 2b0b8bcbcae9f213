"""The set-up (scripts/envsetup.py, scripts/dev.py): which torch under a pip cap, and failures that end
in one message. pip's own resolver is asked for real (metadata only: no torch is downloaded here)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import envsetup  # noqa: E402

PY = Path(sys.executable)  # this environment's python has pip: pip's resolver answers for it


def _pip_config(tmp_path: Path, constraint: str) -> dict[str, str]:
    """An environment whose pip configuration (PIP_CONFIG_FILE) caps torch with `constraint`."""
    cap = tmp_path / "constraints.txt"
    cap.write_text(f"# a workshop image's pins\n{constraint}\n")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nconstraint = {cap}\n")
    return {"PIP_CONFIG_FILE": str(conf), "PIP_CONSTRAINT": ""}  # a cap set in the environment would win


@pytest.fixture(autouse=True)
def _artifacts_in_tmp(tmp_path, monkeypatch):
    """dev.py's test logs (the count of torch-importing processes) go to tmp_path here: a test of
    test_legs() must not reset the log of the suite that is running it."""
    import dev

    monkeypatch.setattr(dev, "ARTIFACTS", tmp_path / "test-artifacts")

def test_a_cap_below_the_lock_installs_the_newest_supported_torch_it_allows(tmp_path, monkeypatch, capsys):
    for k, v in _pip_config(tmp_path, "torch<=2.13.0").items():
        monkeypatch.setenv(k, v)
    pins = envsetup.read_lock(envsetup.lock_path((2, 15)))
    plan = envsetup.plan_torch(PY, pins, have=None)
    assert [envsetup.version_tuple(a.split("==")[1]) for a in plan.install] == [(2, 13, 0)]
    assert not plan.from_lock
    # one line: what it wanted, what the cap allows, where the cap is set
    assert "\n" not in plan.message
    for part in ("torch==2.15.0", "torch<=2.13.0", str(tmp_path / "constraints.txt"),
                 f"global.constraint in {tmp_path / 'pip.conf'}", "torch==2.13.0"):
        assert part in plan.message, (part, plan.message)


def test_without_a_cap_the_lock_decides(monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # pip reads no configuration file at all
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    pins = envsetup.read_lock(envsetup.lock_path((2, 15)))
    plan = envsetup.plan_torch(PY, pins, have=None)
    assert plan.from_lock and plan.install == []
    assert plan.message == "torch: torch==2.15.0 from the lock"


def test_a_torch_already_there_is_kept_or_replaced():
    pins = envsetup.read_lock(envsetup.lock_path((2, 11)))
    assert envsetup.plan_torch(PY, pins, have="2.13.0+cu126").install == []          # a GPU node's build
    plan = envsetup.plan_torch(PY, pins, have="2.13.0", keep_torch=False, torch_spec="torch==2.12.0")
    assert plan.install == ["torch==2.12.0"] and "PPLAB_TORCH" in plan.message


def test_cap_sources_strongest_first():
    debug = ("env_var:\n  PIP_CONFIG_FILE='/t/pip.conf'\nenv:\n  /t/pip.conf, exists: True\n"
             "    global.constraint: /t/a.txt\nglobal:\n  /etc/xdg/pip/pip.conf, exists: True\n"
             "    global.constraint: /etc/xdg/pip/constraints.txt\n    global.cert: /x\n"
             "site:\n  /v/pip.conf, exists: False\n")
    assert envsetup.constraint_settings(debug, {"PIP_CONSTRAINT": "/e.txt"}) == [
        ("/e.txt", "PIP_CONSTRAINT"), ("/t/a.txt", "global.constraint in /t/pip.conf"),
        ("/etc/xdg/pip/constraints.txt", "global.constraint in /etc/xdg/pip/pip.conf")]


@pytest.mark.parametrize("output, wanted", [
    ("ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device", "free disk space"),
    ("WARNING: Retrying ... Failed to establish a new connection: [Errno 111] Connection refused",
     "the package index could not be reached"),
    ("ERROR: Cannot install torch==2.15.0 because these package versions have conflicting dependencies.\n"
     "The conflict is caused by:\n    The user requested torch==2.15.0\n    The user requested (constraint) "
     "torch<=2.14.1\nERROR: ResolutionImpossible: for help visit https://pip.pypa.io", "pip refused a package"),
    ("ERROR: Package 'labkit' requires a different Python: 3.10.12 not in '>=3.11'", "use Python 3.11"),
])
def test_failures_are_named_with_their_fix(output, wanted):
    said, fix = envsetup.classify(output)
    assert wanted in fix and said in output


def _dev(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PPLAB_VENV=str(tmp_path / "venv"), **env)
    for k in ("PPLAB_TORCH", "PIP_CONSTRAINT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "dev.py"), *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.launches
def test_a_cap_that_allows_no_supported_torch_fails_with_one_message(tmp_path):
    r = _dev(tmp_path, _pip_config(tmp_path, "torch<2.11"), "setup")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "set-up failed at step 'find the newest torch pip allows'" in r.stderr
    assert "torch<2.11" in r.stderr and "raise that cap" in r.stderr and "command: " in r.stderr


@pytest.mark.launches
def test_no_network_fails_with_one_message(tmp_path):
    # an index nobody answers, no local wheels: pip cannot find any torch
    r = _dev(tmp_path, {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                        "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "0",
                        "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}, "setup")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "set-up failed at step" in r.stderr and "the package index could not be reached" in r.stderr, r.stderr


def test_lab_listens_on_loopback_only_and_asks_nothing(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import dev
    args = dev.lab_command(tmp_path / "venv")
    assert args[args.index("--ip") + 1] == "127.0.0.1"
    assert "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate" in args
    assert dev.lab(["--ip", "0.0.0.0"]) == 2  # refused before any set-up
    envsetup.write_lab_settings(tmp_path / "venv")
    import json
    data = json.loads((tmp_path / "venv/share/jupyter/lab/settings/overrides.json").read_text())
    assert data["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"


def test_the_lab_opens_without_the_news_prompt(tmp_path):
    """JupyterLab started as dev.py starts it, in this environment (whose settings overrides dev.py's
    set-up wrote): its settings API says news are never fetched, so no toast asks about them."""
    import json
    import time
    import urllib.request
    envsetup.write_lab_settings(Path(sys.prefix))
    home = tmp_path / "home"
    dirs = {n: home / n for n in ("config", "data", "runtime", "settings", "workspaces")}
    for d in dirs.values():
        d.mkdir(parents=True)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(dirs["config"]), JUPYTER_DATA_DIR=str(dirs["data"]),
               JUPYTER_RUNTIME_DIR=str(dirs["runtime"]), JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]),
               JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]))
    sys.path.insert(0, str(ROOT / "scripts"))
    import dev
    token = os.urandom(8).hex()
    cmd = [sys.executable, *dev.lab_command(Path(sys.prefix))[1:], "--no-browser", "--port=0",
           f"--IdentityProvider.token={token}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        settings = None
        while settings is None and time.monotonic() < deadline:
            assert server.poll() is None, "JupyterLab exited"
            for f in dirs["runtime"].glob("jpserver-*.json"):
                try:
                    port = json.loads(f.read_text())["port"]
                    url = (f"http://127.0.0.1:{port}/lab/api/settings/"
                           f"@jupyterlab/apputils-extension:notification?token={token}")
                    with urllib.request.urlopen(url, timeout=5) as r:
                        data = json.loads(r.read())
                    # the user's own settings over the schema's defaults (where overrides.json lands)
                    settings = {k: v.get("default") for k, v in data["schema"]["properties"].items()}
                    settings.update(data["settings"])
                except (OSError, ValueError, KeyError):
                    pass
            time.sleep(0.5)
        assert settings is not None, "JupyterLab did not answer within 90 s"
        assert settings["fetchNews"] == "false" and settings["checkForUpdates"] is False
    finally:
        server.terminate()
        server.wait(timeout=30)


def _dev_module():
    sys.path.insert(0, str(ROOT / "scripts"))
    import dev
    return dev


def test_lab_stops_with_one_message_when_doctor_finds_a_problem(tmp_path, monkeypatch, capsys):
    dev = _dev_module()
    fake = tmp_path / "python"  # a venv python whose `labkit doctor` reports a problem (exit 1)
    fake.write_text("#!/bin/sh\necho 'problem: torch cannot be imported. fix: run dev.py setup'\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(dev, "setup", lambda *a, **k: "2.15.0")
    monkeypatch.setattr(dev, "vpython", lambda venv_dir: fake)
    assert dev.main(["lab"]) == 3  # never reaches JupyterLab
    err = capsys.readouterr().err
    assert "set-up failed at step 'check the environment (labkit doctor)'" in err
    assert f"command: {fake} -m labkit doctor" in err and "fix: fix what doctor reported above" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("error, step", [
    (OSError(28, "No space left on device", "/v/share/jupyter/lab/settings/overrides.json"),
     "write /v/share/jupyter/lab/settings/overrides.json"),
    (subprocess.CalledProcessError(100, ["apt-get", "install", "-y", "chromium"]), "run apt-get"),
])
def test_any_other_set_up_failure_ends_in_one_message(monkeypatch, capsys, error, step):
    dev = _dev_module()

    def fail(*a, **k):
        raise error
    monkeypatch.setattr(dev, "setup", fail)
    assert dev.main(["test", "--one-torch"]) == 3
    err = capsys.readouterr().err
    assert f"set-up failed at step '{step}'" in err and "fix: " in err and "Traceback" not in err


@pytest.mark.parametrize("outcome", ["passes", "raises"])
def test_under_load_runs_one_busy_process_per_core_beside_the_tests_and_stops_them(monkeypatch, capsys, outcome):
    """`dev.py test --under-load`: the busy processes run (and spin) while pytest runs, and are gone
    afterwards, whether the tests pass or the run fails; the flag itself never reaches pytest."""
    import psutil

    dev = _dev_module()
    seen = {}

    def fake_pytest(venv_dir, paths, argv, workers=1, serial=False):
        if serial:  # the tests marked serial, alone, after the parallel pass
            seen["serial"] = argv
            return 5  # none selected: not a failure
        load = [psutil.Process(p.pid) for p in seen["load"].procs]
        deadline = time.monotonic() + 60  # a spinner just started may still be loading Python (S or D)
        while [p.status() for p in load] != [psutil.STATUS_RUNNING] * 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        seen.update(argv=argv, state=[p.status() for p in load])
        if outcome == "raises":
            raise KeyboardInterrupt
        return 0

    real = dev.BusyLoad

    def recording(n):
        seen["load"] = real(n)
        return seen["load"]
    monkeypatch.setattr(dev, "BusyLoad", recording)
    monkeypatch.setattr(dev, "load_size", lambda: 2)
    monkeypatch.setattr(dev, "setup", lambda *a, **k: "2.15.0")
    monkeypatch.setattr(dev, "ensure_browser", lambda: None)
    monkeypatch.setattr(dev, "pytest", fake_pytest)
    assert dev.main(["test", "--one-torch", "--under-load", "-x"]) == (0 if outcome == "passes" else 130)
    # they spin: running or runnable (R) once started, however busy the machine is
    assert seen["argv"] == ["-x"] and seen["state"] == [psutil.STATUS_RUNNING] * 2, seen
    assert seen.get("serial") == (["-x"] if outcome == "passes" else None), seen
    assert all(p.poll() is not None for p in seen["load"].procs)  # stopped after the run
    out = capsys.readouterr().out
    assert "under load: 2 busy processes" in out and "busy processes were stopped" in out


def test_under_load_builds_the_second_legs_environment_before_the_load(monkeypatch, capsys):
    """With every leg, `--under-load` builds .venv-torch2.11 and the middle release's environment in the
    foreground before the busy processes start, and the later legs start no background set-up: at the
    lowest priority beside busy processes it barely moved (a fresh-clone run: 12 minutes for 13 s of CPU)."""
    import threading

    dev = _dev_module()
    monkeypatch.setenv("PPLAB_MIDDLE_TORCH", "2.13")
    events = []

    class Load:
        def __init__(self, n):
            events.append("load starts")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append("load stops")

    class Leg:
        def __init__(self, argv, workers=1, after=None, ready=False, spec=None):
            events.append(f"leg {spec.number} ready={ready}")
            self.torch, self.rc, self.spec, self.done = "2.11.0", 0, spec, threading.Event()

        def finish(self):
            return 0

    monkeypatch.setattr(dev, "setup", lambda venv_dir=dev.VENV, *a, **k: events.append(f"set up {Path(venv_dir).name}") or "2.15.0")
    monkeypatch.setattr(dev, "start_setup", lambda spec: pytest.fail("no background set-up under load"))
    monkeypatch.setattr(dev, "BusyLoad", Load)
    monkeypatch.setattr(dev, "OtherLeg", Leg)
    monkeypatch.setattr(dev, "ensure_browser", lambda: None)
    monkeypatch.setattr(dev, "pytest", lambda *a, serial=False, **k: 5 if serial else 0)
    assert dev.main(["test", "--under-load"]) == 0
    assert events == ["set up .venv", f"set up {dev.OTHER_VENV.name}", f"set up {dev.middle_venv((2, 13)).name}",
                      "load starts", "leg 2 ready=True", "leg 3 ready=True", "load stops"], events


def test_the_busy_processes_end_when_dev_py_is_killed(tmp_path):
    """A dev.py killed with SIGKILL (no cleanup runs) leaves no spinner behind: each one watches its
    parent, whose pid it is given (it may start after dev.py is already gone, as here)."""
    import psutil

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import dev, time\n"
            "load = dev.BusyLoad(2).__enter__()\n"
            "print(' '.join(str(p.pid) for p in load.procs), flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, str(ROOT / "scripts")], stdout=subprocess.PIPE, text=True)
    try:
        parent.stdout.readline()  # BusyLoad's own line: "(under load: ...)"
        pids = [int(p) for p in parent.stdout.readline().split()]
    finally:
        parent.kill()  # at once: the spinners may not even have started
        parent.wait()
        parent.stdout.close()
    assert len(pids) == 2
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=120)
    for p in alive:
        p.kill()
    assert not alive, f"spinners still running 120 s after dev.py was killed: {[p.pid for p in alive]}"


def test_the_count_of_torch_importing_processes_by_role(tmp_path):
    """scripts/torch_count's roles from real command lines, and dev.py's one-line sum per leg."""
    sys.path.insert(0, str(ROOT / "scripts" / "torch_count"))
    try:
        import importlib.util
        spec = importlib.util.spec_from_file_location("torch_count", ROOT / "scripts" / "torch_count" / "sitecustomize.py")
        count = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(count)
    finally:
        sys.path.pop(0)
    py = "/v/bin/python"
    assert count.role([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "x.py"], {}) == "agent"
    assert count.role([py, "-u", "x.py"], {"LOCAL_RANK": "0", "RANK": "0"}) == "rank"
    assert count.role([py, "-m", "ipykernel_launcher", "-f", "k.json"], {}) == "kernel"
    assert count.role([py, "/v/lib/site-packages/pytest/__main__.py", "tests"], {}) == "pytest"
    assert count.role([py, "-c", "import torch"], {}) == "script"
    dev = _dev_module()
    dev.reset_imports_log(1)
    dev.imports_log(1).write_text("rank\t1\tt::a\tcmd\nrank\t2\tt::a\tcmd\nagent\t3\tt::a\tcmd\nkernel\t4\tnb\tcmd\n")
    line = dev.count_imports(1)
    assert line.startswith("leg 1: 4 processes imported torch (2 ranks, 1 agent, 1 kernel)"), line


def test_quick_names_a_test_that_started_a_torch_process_and_fails(monkeypatch, capsys):
    dev = _dev_module()
    monkeypatch.setattr(dev, "setup", lambda *a, **k: "2.15.0")

    def fake_run(cmd, cwd=None, env=None):
        assert "-m" in cmd and dev.QUICK_MARKS in cmd and "--nbval" not in cmd
        with open(env["PPLAB_TORCH_IMPORTS"], "a") as f:
            f.write("pytest\t1\t\tpytest\nrank\t2\ttests/test_x.py::test_unmarked\tx.py\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(dev.subprocess, "run", fake_run)
    assert dev.quick([]) == 1
    out = capsys.readouterr().out
    assert "mark them `launches`" in out and "tests/test_x.py::test_unmarked" in out and "left out:" in out


@pytest.mark.parametrize("flags, in_turn", [([], True), (["--legs-beside"], False)])
def test_each_later_leg_runs_after_the_one_before_unless_asked_to_run_beside(monkeypatch, flags, in_turn):
    import threading

    dev = _dev_module()
    legs, serial = [], []

    class Leg:
        def __init__(self, argv, workers=1, after=None, ready=False, spec=None):
            legs.append(self)
            self.argv, self.after, self.workers, self.spec = argv, after, workers, spec
            self.torch, self.rc, self.done = "2.11.0", 0, threading.Event()

        def finish(self):
            return 0

    def fake_pytest(venv, paths, *a, serial=False, **k):
        if serial:
            runs.append((Path(venv).name, list(paths)))
            return 5  # none selected: not a failure
        return 0

    runs = serial
    monkeypatch.setattr(dev, "OtherLeg", Leg)
    monkeypatch.setattr(dev, "pytest", fake_pytest)
    assert dev.test_legs([*flags, "-x"], "2.15.0") == 0
    assert [leg.spec.number for leg in legs] == [2, 3] and [leg.spec.tests for leg in legs] == \
        [dev.OTHER_END_TESTS, dev.MIDDLE_TESTS]
    assert all(leg.argv == ["-x"] and leg.workers == dev.test_workers() for leg in legs)  # each leg on the same workers
    assert (legs[0].after is not None) is in_turn and (legs[1].after is legs[0].done) is in_turn
    # the serial passes: the whole suite's, then each later leg's own test files on its torch
    assert [venv for venv, _ in serial] == [dev.VENV.name, dev.OTHER_VENV.name, legs[1].spec.venv.name], serial
    assert serial[2][1] == ["tests/test_versions.py", *dev.DIAGNOSIS_TESTS]
    legs.clear()
    assert dev.test_legs(["--no-middle", "-x"], "2.15.0") == 0 and [leg.spec.number for leg in legs] == [2]
    legs.clear()
    assert dev.test_legs(["--one-torch"], "2.15.0") == 0 and legs == []


def test_two_workers_get_whole_units_longest_first(monkeypatch):
    """dev.py test's parallel pass: 2 workers on 2 cores, each file one unit (a notebook's cells in
    order on one kernel), every file on the suite's shared pools ONE unit (the pools start once per
    leg), the longest units first; the serial pass runs alone without workers."""
    import conftest

    dev = _dev_module()
    monkeypatch.delenv("PPLAB_TEST_WORKERS", raising=False)
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 2)
    assert dev.test_workers() == 2
    monkeypatch.setattr(dev.os, "cpu_count", lambda: 1)
    assert dev.test_workers() == 1
    cmd = dev.pytest_command(dev.VENV, ("tests",), [], workers=2)
    assert cmd[cmd.index("-n") + 1] == "2" and cmd[cmd.index("--dist") + 1] == "loadgroup"
    assert "--no-loadscope-reorder" in cmd and "not serial" in cmd
    serial = dev.pytest_command(dev.VENV, ("tests",), [], workers=2, serial=True)
    assert "-n" not in serial and serial[len(serial) - 1 - serial[::-1].index("-m") + 1] == "serial"
    unit = conftest.work_unit
    assert unit("tests/test_noise.py::test_x") == unit("tests/test_reference_runs.py::test_y[a]") == conftest.POOLS_UNIT
    assert unit("tests/test_bench.py::test_live_ranks_bench") == "tests/test_bench.py"  # bench.live_ranks( is no pool
    assert unit("notebooks/05_schedules_multistage.ipynb::Cell 3") == "notebooks/05_schedules_multistage.ipynb"
    assert max(conftest.UNIT_SECONDS, key=conftest.UNIT_SECONDS.get) == conftest.POOLS_UNIT


def test_a_notebook_that_compares_a_quiet_machine_with_a_busy_one_runs_alone():
    """Notebook 06b times steps beside busy loops against quiet steps: beside a second worker its
    quiet steps were not quiet (CI: quiet shares 0.26, 0.11, 0.24 against 0.21, 0.17, 0.24 busy). Its
    metadata says so; its cells are marked `serial` and both legs' serial passes run it alone. Notebook
    13 (one fitted cost per action explains five measured steps) takes each step less the machine's load
    and runs beside the other worker."""
    import conftest

    dev = _dev_module()
    alone = dev.alone_notebooks()
    assert alone == ["notebooks/06b_measuring_a_step.ipynb"]
    assert conftest.runs_alone(ROOT / alone[0]) and not conftest.runs_alone(ROOT / "notebooks/05_schedules_multistage.ipynb")
    assert not conftest.runs_alone(ROOT / "tests/test_load.py")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--nbval", "--collect-only", "-q",
                        "-m", "serial", "tests/test_load.py", *alone], cwd=ROOT, capture_output=True, text=True)
    picked = [line for line in r.stdout.splitlines() if "::" in line]
    for nb in alone:
        assert any(line.startswith(nb + "::Cell") for line in picked), r.stdout[-2000:]
        assert len([line for line in picked if line.startswith(nb)]) > 30   # every cell, not some
    assert all(line.startswith(tuple(alone)) or "test_a_busy_machine" in line or "test_compare_names_busy_loops" in line
               for line in picked), picked


def _fake_venv(path: Path, torch: str | None, family_bytes: int = 0, rest_bytes: int = 0) -> Path:
    """A venv-shaped folder: a torch dist-info (if `torch`), files of the given sizes in torch/ and beside."""
    sp = path / "lib" / "python3.11" / "site-packages"
    sp.mkdir(parents=True)
    if torch:
        (sp / f"torch-{torch}.dist-info").mkdir()
    (sp / "torch").mkdir()
    (sp / "torch" / "lib.so").write_bytes(os.urandom(family_bytes))
    (sp / "rest.py").write_bytes(os.urandom(rest_bytes))
    return path


def test_the_room_an_environment_still_needs(tmp_path):
    full = envsetup.FULL_BYTES["linux"]
    assert envsetup.room_needed(tmp_path / "none", "2.15.0", True, "linux") == full
    assert envsetup.room_needed(tmp_path / "none", "2.15.0", True, "darwin") == envsetup.OTHER_FULL_BYTES
    half = _fake_venv(tmp_path / "half", None, family_bytes=2_000_000)  # a set-up cut off in torch's family
    assert full - 2_200_000 < envsetup.room_needed(half, "2.15.0", True, "linux") <= full - 2_000_000
    kept = _fake_venv(tmp_path / "kept", "2.13.0", family_bytes=3_000_000, rest_bytes=1_000_000)
    assert envsetup.torch_there(kept) == "2.13.0"
    # a supported torch is kept (.venv): only the rest is still to come, torch's own bytes do not count
    assert envsetup.REST_BYTES - 1_100_000 < envsetup.room_needed(kept, "2.15.0", True, "linux") <= envsetup.REST_BYTES - 1_000_000
    # the floors' environment wants exactly its lock's torch: 2.13.0 is replaced, the whole needed
    assert envsetup.room_needed(kept, "2.11.0", False, "linux") > full - 4_200_000


def test_too_little_room_fails_before_anything_downloads(tmp_path):
    envs = [(tmp_path / ".venv", "2.15.0", True), (tmp_path / ".venv-torch2.11", "2.11.0", False)]
    need = sum(envsetup.room_needed(v, w, k) for v, w, k in envs)
    envsetup.check_room(envs, free_bytes=lambda p: need + 1)  # enough: nothing said
    with pytest.raises(envsetup.SetupError) as e:
        envsetup.check_room(envs, free_bytes=lambda p: 5.5e9)
    text = str(e.value)
    assert "set-up failed at step 'check the disk has room'" in text
    assert f"still need about {need / 1e9:.1f} GB" in text and "5.5 GB are free" in text
    assert f"free {(need - 5.5e9) / 1e9:.1f} GB more" in text and "PPLAB_VENV=" in text and "PPLAB_OTHER_VENV" in text
    assert str(tmp_path / ".venv-torch2.11") in text


def test_dev_py_test_checks_the_room_for_both_environments_first(monkeypatch, capsys, tmp_path):
    dev = _dev_module()
    monkeypatch.setattr(dev, "VENV", tmp_path / ".venv")
    monkeypatch.setattr(dev, "OTHER_VENV", tmp_path / ".venv-torch2.11")
    monkeypatch.setenv("PPLAB_MIDDLE_VENV", str(tmp_path / ".venv-torch2.13"))
    monkeypatch.setattr(envsetup.shutil, "disk_usage", lambda p: type("U", (), {"free": int(8e9)})())
    monkeypatch.setattr(dev, "setup", lambda *a, **k: pytest.fail("set-up started without room"))
    assert dev.main(["test"]) == 3  # 8 GB hold one environment, not both
    err = capsys.readouterr().err
    assert "set-up failed at step 'check the disk has room'" in err and ".venv-torch2.11" in err
    assert "Traceback" not in err


def test_torch_family_installs_beside_the_rest_and_the_first_failure_is_the_message(monkeypatch, tmp_path):
    calls, started = [], __import__("threading").Event()

    def fake_run_step(step, cmd, env=None, quiet=False, cwd=None):
        calls.append((step, quiet))
        if "-r" in cmd:  # the rest's call: it waits until the family has started beside it
            assert started.wait(10)
            if fail == "rest":
                raise envsetup.SetupError(step, "fix it", cmd, "ERROR: boom")
        else:
            started.set()
            if fail == "family" and "torch==9.9" in cmd:
                raise envsetup.SetupError(step, "fix it", cmd, "ERROR: No space left on device")
        return ""
    monkeypatch.setattr(envsetup, "run_step", fake_run_step)
    monkeypatch.setattr(envsetup, "_installed_versions", lambda vpy: {"nvidia-b": "2"})
    big = ["nvidia-a==1 ; sys_platform == 'linux'", "nvidia-b==2", "torch==9.9"]
    for fail in (None, "family", "rest"):
        calls.clear()
        started.clear()
        if fail is None:
            envsetup.install_beside(tmp_path / "python", big, ["numpy==2"], "lab", "lab-torch9.9.txt")
        else:
            with pytest.raises(envsetup.SetupError) as e:
                envsetup.install_beside(tmp_path / "python", big, ["numpy==2"], "lab", "lab-torch9.9.txt")
            assert ("No space" if fail == "family" else "boom") in str(e.value)
        steps = [s for s, _ in calls]
        assert "install nvidia-a (the lock's torch family, one at a time)" in steps
        assert not any("nvidia-b" in s for s in steps)  # installed already: skipped
        assert all(quiet for s, quiet in calls if "family" in s and "beside" not in s)  # one line each, not pip's output
        if fail != "rest":
            assert "install torch (the lock's torch family, one at a time)" in steps


def test_pip_check_failing_is_one_message(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'nbval 0.11.0 requires ipykernel, which is not installed.'\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(envsetup.SetupError) as e:
        envsetup.pip_check(fake)
    assert "nbval 0.11.0 requires ipykernel" in str(e.value) and "dev.py lock" in str(e.value)
    fake.write_text("#!/bin/sh\necho 'No broken requirements found.'\n")
    envsetup.pip_check(fake)


# ---- leg 3: one middle release, for what asks labkit.versions what a release does ----
def test_the_middle_leg_runs_every_notebook_and_test_that_asks_what_a_release_does():
    """MIDDLE_TESTS is exactly the files that ask `versions.fact` (or still compare releases by hand),
    with the table's own tests, and the hang diagnosis (DIAGNOSIS_TESTS: it reads torch's logs and stacks,
    which differ between releases). A file that only asks `versions.has` is left out: a feature's two paths
    both run on the ends (2.11 without, 2.15 with), and which one a middle release takes is the table's
    feature probe, in tests/test_versions.py."""
    import re

    import test_versions

    dev = _dev_module()
    asking = {path for path, code in test_versions.release_sources().items()
              if re.search(r"versions\.fact\(", code) or test_versions.HAND_WRITTEN_RELEASE.search(code)}
    assert set(dev.MIDDLE_TESTS) == asking | {"tests/test_versions.py"} | set(dev.DIAGNOSIS_TESTS), sorted(asking)
    assert dev.DIAGNOSIS_TESTS == ("tests/test_hangs.py",)
    assert all((ROOT / p).exists() for p in dev.MIDDLE_TESTS)


def test_the_middle_releases_are_the_supported_ones_between_the_ends_each_pinned():
    from labkit import versions

    dev = _dev_module()
    assert sorted(dev.MIDDLE) == list(versions.MINORS[1:-1])
    for minor, spec in dev.MIDDLE.items():
        name, version = spec.split("==")
        assert name == "torch" and versions.parse(version) == minor, spec


def test_the_middle_release_can_be_chosen_and_otherwise_rotates_with_the_commit(monkeypatch):
    dev = _dev_module()
    monkeypatch.setenv("PPLAB_MIDDLE_TORCH", "2.12")
    assert dev.middle_release() == (2, 12)
    monkeypatch.setenv("PPLAB_MIDDLE_TORCH", "2.16")
    with pytest.raises(envsetup.SetupError, match="set it to one of 2.12, 2.13, 2.14"):
        dev.middle_release()
    monkeypatch.delenv("PPLAB_MIDDLE_TORCH")
    picked = set()
    for head in ("000000000000", "000000000001", "000000000002", "000000000003"):
        monkeypatch.setattr(dev.subprocess, "run", lambda *a, head=head, **k: subprocess.CompletedProcess(a, 0, head + "\n", ""))
        picked.add(dev.middle_release())
    assert picked == set(dev.MIDDLE)  # successive commits go round all three

    def no_git(*a, **k):
        raise FileNotFoundError("git")
    monkeypatch.setattr(dev.subprocess, "run", no_git)
    assert dev.middle_release() == (2, 13)


def test_the_middle_leg_installs_its_torch_over_the_floors_lock(monkeypatch, tmp_path):
    dev = _dev_module()
    monkeypatch.delenv("PPLAB_MIDDLE_VENV", raising=False)
    leg = dev.middle_leg((2, 14))
    assert (leg.number, leg.venv.name, leg.tests, leg.setup_args) == (3, ".venv-torch2.14", dev.MIDDLE_TESTS, ["--middle", "2.14"])
    assert leg.room() == (leg.venv, "2.14.1", False)
    assert dev.other_end_leg().room()[1:] == ("2.11.0", False) and dev.other_end_leg().setup_args == ["--other-end"]
    assert dev.serial_paths(dev.other_end_leg())[-1] == "notebooks/06b_measuring_a_step.ipynb"  # "notebooks" holds it
    assert dev.serial_paths(leg) == ["tests/test_versions.py", *dev.DIAGNOSIS_TESTS]
    calls = []  # what envsetup is asked: the floors lock, that torch instead of its own, and where that came from
    monkeypatch.setattr(dev.envsetup, "setup", lambda venv, lock, **k: calls.append((venv, lock.name, k)) or "2.14.1")
    monkeypatch.setattr(dev.envsetup, "check_room", lambda envs: None)
    assert dev.main(["setup", "--middle", "2.14"]) == 0
    assert calls == [(leg.venv, "lab-torch2.11.txt", {"keep_torch": False, "torch_spec": "torch==2.14.1",
                                                      "spec_from": "the middle release's leg of dev.py test"})], calls


def test_lab_on_another_torch_is_one_command(monkeypatch):
    """`dev.py lab --torch 2.13` (README: one command line for a lab on another supported release) sets up
    that release's environment beside .venv and starts JupyterLab from it; a release outside the range is
    refused with the ones it takes."""
    dev = _dev_module()
    built = []
    monkeypatch.setattr(dev.LegSpec, "build", lambda self: built.append((self.minor, self.torch_spec)) or "x")
    venv, rest = dev.lab_venv(["--torch", "2.13", "--port", "9999"])
    assert venv.name == ".venv-torch2.13" and rest == ["--port", "9999"] and built == [((2, 13), "torch==2.13.0")]
    venv, _ = dev.lab_venv(["--torch", "2.11"])
    assert venv.name == ".venv-torch2.11" and built[-1] == ((2, 11), None)
    with pytest.raises(dev.SetupError, match="2.11, 2.12, 2.13, 2.14, 2.15"):
        dev.lab_venv(["--torch", "2.9"])
