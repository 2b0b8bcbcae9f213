"""The lab's environment: installed from the lock files, surviving a pip cap, failing with one message.

Owns how `scripts/dev.py` builds a virtual environment (standard library only: it runs before
anything is installed):

- the locks, `requirements/lab-torch<X.Y>.txt`, made by `uv pip compile` from pyproject.toml (extras
  lab, test, models, search) and `requirements/torch-<X.Y>.in` (`python3 scripts/dev.py lock` refreshes them). The
  main environment `.venv` gets torch 2.15.0's lock (the newest release of everything), `dev.py test`'s
  second leg the floors lock, torch 2.11.0's (torch-2.11.in pins every package that has a floor at it,
  e.g. transformers 5.23.0; labkit/versions/ declares the ranges).
- torch and the packages only torch needs ("the torch family": CUDA libraries, triton, sympy, ...) are
  installed apart from the rest, so that another torch can stand in for the locked one: a torch
  already in the venv (GPU nodes put a CUDA build there first), `PPLAB_TORCH`, or the newest
  supported torch that pip's configuration allows when it caps torch below the lock (a `constraint`
  in `pip config list`, as managed laptops and workshop images have). That case is said in one line.
- every failing step ends in `SetupError`: the step, the command, what pip said, and the fix; dev.py
  prints it and exits 3, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import venv as venv_mod
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements"
MIN_PYTHON = (3, 11)  # torch 2.15.0 publishes wheels for 3.11+ only; the lock is resolved for 3.11+
SUPPORTED_TORCH = ((2, 11), (2, 15))  # = labkit.versions.SUPPORTED; this file cannot import labkit
SUPPORTED_RANGE = "torch>=2.11,<2.16"
EXTRAS = "lab,test,models,search"  # what the lab and its tests use; every one is in the locks


class SetupError(Exception):
    """A set-up step failed: `str()` is the whole message a user sees (no traceback)."""

    def __init__(self, step: str, fix: str, command: list[str] | None = None, said: str = ""):
        self.step, self.fix, self.command, self.said = step, fix, command, said
        lines = [f"set-up failed at step '{step}'."]
        if command:
            lines.append("  command: " + " ".join(map(str, command)))
        if said:
            lines.append("  it said: " + said)
        lines.append("  fix: " + fix)
        lines.append("  Then run the same dev.py command again: finished steps are skipped.")
        super().__init__("\n".join(lines))


# ---------------------------------------------------------------------------------------------- locks
@dataclass
class Pin:
    name: str          # normalised (lower case, '-' for '_' and '.')
    line: str          # the requirement as written in the lock: 'torch==2.15.0 ; sys_platform == ...'
    version: str
    via: list[str] = field(default_factory=list)  # what asked for it ('torch', 'labkit (pyproject.toml)', '-r ...')


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_path(torch_minor: tuple[int, int]) -> Path:
    return REQUIREMENTS / f"lab-torch{torch_minor[0]}.{torch_minor[1]}.txt"


def read_lock(path: Path) -> dict[str, list[Pin]]:
    """name -> its pins (a package can have two, one per Python version marker) of a `uv pip compile`
    lock with its `# via` annotations."""
    pins: dict[str, list[Pin]] = {}
    current: Pin | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line:
            continue
        if not line.startswith("#"):
            m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)", line)
            if not m:
                raise SetupError("read the lock", f"{path} has a line that is not 'name==version': {line!r}; "
                                 "refresh the lock with `python3 scripts/dev.py lock`")
            current = Pin(norm(m.group(1)), line, m.group(3))
            pins.setdefault(current.name, []).append(current)
        elif current is not None:
            text = line.lstrip("#").strip()
            if text.startswith("via "):
                current.via.append(text[4:].strip())
            elif text and text != "via":
                current.via.append(text)
    return pins


def torch_family(pins: dict[str, list[Pin]]) -> set[str]:
    """torch and every package that is in the lock only because torch (or another of these) needs it:
    what changes with the torch release. The rest of the lock fits any supported torch."""
    return family(pins, {"torch"})


def family(pins: dict[str, list[Pin]], roots: set[str]) -> set[str]:
    """`roots` and every package that is in the lock only because one of them (or another of these)
    needs it."""
    found = set(roots)
    changed = True
    while changed:
        changed = False
        for name, entries in pins.items():
            if name in found:
                continue
            vias = {norm(v.split(" ")[0]) for p in entries for v in p.via}
            if vias and vias <= found:
                found.add(name)
                changed = True
    return found


def locked_torch(pins: dict[str, list[Pin]]) -> str:
    return pins["torch"][0].version


# ------------------------------------------------------------------------------------ running pip
def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def classify(output: str) -> tuple[str, str]:
    """(the line that says what went wrong, the fix) from a failed pip's output."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]

    def find(*needles: str) -> str | None:
        for ln in reversed(lines):
            if any(n.lower() in ln.lower() for n in needles):
                return ln
        return None

    if said := find("No space left on device", "Errno 28"):
        return said, ("free disk space (the environment needs about 6 GB on Linux, where torch's wheel is a CUDA "
                      "build), or put the environment on a disk with room: PPLAB_VENV=/big/disk/pplab-venv")
    if said := find("Failed to establish a new connection", "Temporary failure in name resolution",
                    "Name or service not known", "Network is unreachable", "Connection refused",
                    "Read timed out", "ProxyError", "Could not fetch URL", "SSLError", "ConnectTimeout"):
        return said, ("the package index could not be reached: check the network connection (or HTTPS_PROXY), "
                      "or point pip at a mirror (PIP_INDEX_URL=https://mirror/simple)")
    if said := find("(from versions: none)"):
        return said, ("pip saw no release at all: the package index could not be reached (check the network "
                      "connection or HTTPS_PROXY, or point pip at a mirror: PIP_INDEX_URL=https://mirror/simple) "
                      "or it has no such package")
    if said := find("requires a different Python", "Requires-Python"):
        return said, (f"use Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer: "
                      f"python{MIN_PYTHON[0]}.{MIN_PYTHON[1]} scripts/dev.py ...")
    if said := find("ResolutionImpossible", "conflict is caused by", "Could not find a version that satisfies",
                    "No matching distribution found", "(constraint)"):
        return said, ("pip refused a package: a pin in your pip configuration (`pip config list`: constraint, "
                      "index-url) or an index without it. Raise or remove that pin, or choose the torch "
                      "yourself: PPLAB_TORCH='torch==2.13.0'")
    tail = lines[-1] if lines else "(no output)"
    return tail, "read pip's output above; fix what it names"


def _stream(cmd: list[str], env: dict | None, cwd: Path | None, quiet: bool) -> tuple[int, str]:
    """Run `cmd` with its output shown live (through a pseudo-terminal when ours is one, so that pip
    draws its download progress bars); return its exit code and the tail of its output."""
    tail: deque[str] = deque(maxlen=400)
    use_pty = not quiet and os.name == "posix" and sys.stdout.isatty()
    if use_pty:
        import pty
        master, slave = pty.openpty()
        proc = subprocess.Popen(cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        os.close(slave)
        buf = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            buf = (buf + chunk)[-200_000:]
        os.close(master)
        tail.extend(buf.decode(errors="replace").replace("\r", "\n").splitlines(keepends=True))
        return proc.wait(), "".join(tail)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, env=env, cwd=cwd, errors="replace")
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)
        if not quiet:
            sys.stdout.write(line)
            sys.stdout.flush()
    return proc.wait(), "".join(tail)


def run_step(step: str, cmd: list, env: dict | None = None, quiet: bool = False, cwd: Path | None = None) -> str:
    """Run a set-up command with its output shown live; on failure raise SetupError naming the step."""
    cmd = [str(c) for c in cmd]
    print("+ " + " ".join(cmd), flush=True)
    try:
        rc, output = _stream(cmd, env, cwd, quiet)
    except OSError as e:
        raise SetupError(step, f"check that {cmd[0]} exists and can run", cmd, str(e)) from None
    if rc != 0:
        said, fix = classify(output)
        raise SetupError(step, fix, cmd, said)
    return output


def pip(vpy: Path) -> list[str]:
    """pip install, without pip's cache: a CUDA torch's wheels are ~3 GB, and the cache would keep a
    second copy of them beside the environment (a CI machine's disk ran out that way)."""
    return [str(vpy), "-m", "pip", "install", "--disable-pip-version-check", "--no-cache-dir"]


# ------------------------------------------------------------------------------------------ pip caps
@dataclass
class Cap:
    spec: str    # 'torch<=2.14.1'
    file: str    # the constraints file that holds it
    where: str   # where that file is named: 'global.constraint in /etc/xdg/pip/pip.conf', 'PIP_CONSTRAINT'

    def describe(self) -> str:
        return f"{self.spec} ({self.file}, set by {self.where})"


def constraint_settings(config_debug: str, environ: dict[str, str]) -> list[tuple[str, str]]:
    """(constraints file, where it is set) for every constraint in pip's configuration, strongest first
    (pip: PIP_CONSTRAINT, then PIP_CONFIG_FILE's file, then site, user, global files)."""
    found: dict[str, list[tuple[str, str]]] = {}
    kind, source = "", ""
    for line in config_debug.splitlines():
        if re.match(r"^\S.*:$", line):
            kind = line[:-1]
            continue
        m = re.match(r"^  (\S.*), exists: (True|False)$", line)
        if m:
            source = m.group(1)
            continue
        m = re.match(r"^    ([\w-]+)\.constraints?:\s*(.+)$", line)
        if m and m.group(1) in ("global", "install"):
            for f in m.group(2).split():
                found.setdefault(kind, []).append((f, f"{m.group(1)}.constraint in {source}"))
    out = [(f, "PIP_CONSTRAINT") for f in environ.get("PIP_CONSTRAINT", "").split()]
    for kind in ("env", "site", "user", "global"):
        out += found.get(kind, [])
    return out


def torch_caps(settings: list[tuple[str, str]]) -> list[Cap]:
    """The torch lines of those constraints files."""
    caps = []
    for file, where in settings:
        try:
            text = Path(file.removeprefix("file://")).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            line = line.split("#")[0].strip()
            if re.match(r"^torch\s*([<>=!~]|$)", line):
                caps.append(Cap(line.replace(" ", ""), file, where))
    return caps


def find_caps(vpy: Path) -> list[Cap]:
    r = subprocess.run([str(vpy), "-m", "pip", "config", "debug"], capture_output=True, text=True)
    return torch_caps(constraint_settings(r.stdout, dict(os.environ)))


def newest_allowed_torch(vpy: Path) -> str:
    """The newest supported torch that pip, with its own configuration (caps included), would install:
    asked of pip's resolver itself (a dry run reading metadata only, no download of torch)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [*pip(vpy), "--dry-run", "--no-deps", "--ignore-installed", "--report", str(report), SUPPORTED_RANGE]
        try:
            run_step("find the newest torch pip allows", cmd, quiet=True)
        except SetupError as e:
            caps = find_caps(vpy)
            if caps and ("resolution" in e.said.lower() or "constraint" in e.said.lower()
                         or "no matching distribution" in e.said.lower()):
                raise SetupError(
                    "find the newest torch pip allows",
                    f"pip's configuration caps torch at {caps[0].describe()}, which allows no supported torch "
                    f"({SUPPORTED_RANGE}): raise that cap to at least torch 2.11, or give the torch yourself "
                    "with PPLAB_TORCH='torch==2.11.0'", cmd, e.said) from None
            raise
        return json.loads(report.read_text())["install"][0]["metadata"]["version"]


# ------------------------------------------------------------------------------------------ disk room
GB = 1e9
# What a built environment takes, measured with du on Linux, where PyPI's torch is a CUDA build:
# .venv 6.2 GB (torch 2.15: CUDA libraries 3.0, torch 1.2, triton 1.0, the rest 1.0), .venv-torch2.11
# 5.5 GB; plus the largest wheel (torch's, 0.54 GB) in pip's temporary folder while it installs.
# Elsewhere (macOS, Windows) torch is a CPU build: about 2 GB in all.
FULL_BYTES = {"linux": 6.8 * GB}
OTHER_FULL_BYTES = 2.0 * GB
REST_BYTES = 1.3 * GB  # everything but torch's own family (JupyterLab, transformers, ortools, the kit)
TORCH_DIRS = ("torch", "triton", "nvidia")


def tree_bytes(path: Path) -> int:
    """Disk used by the files under `path` (0 if it is not there)."""
    total, todo = 0, [path]
    while todo:
        try:
            entries = os.scandir(todo.pop())
        except OSError:
            continue
        with entries:
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        todo.append(Path(e.path))
                    else:
                        total += e.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    pass
    return total


def site_packages(venv_dir: Path) -> Path | None:
    found = sorted(venv_dir.glob("lib/python3*/site-packages")) + sorted(venv_dir.glob("Lib/site-packages"))
    return found[0] if found else None


def torch_there(venv_dir: Path) -> str | None:
    """The torch version installed in the venv, read from its dist-info (no import: this is fast)."""
    sp = site_packages(venv_dir)
    infos = sorted(sp.glob("torch-*.dist-info")) if sp else []
    return infos[0].name[len("torch-"):-len(".dist-info")] if infos else None


def room_needed(venv_dir: Path, want: str, keep_torch: bool, platform: str = sys.platform) -> float:
    """Bytes the set-up of `venv_dir` still needs: the whole environment less what is there, or only
    the rest (not torch's family) when the torch there is the one that will be kept."""
    have = torch_there(venv_dir)
    kept = have is not None and (supported(have) if keep_torch else version_tuple(have) == version_tuple(want))
    sp = site_packages(venv_dir)
    there = tree_bytes(venv_dir)
    if kept:
        family = sum(tree_bytes(sp / d) for d in TORCH_DIRS) if sp else 0
        return max(0.0, REST_BYTES - (there - family))
    return max(0.0, FULL_BYTES.get(platform, OTHER_FULL_BYTES) - there)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_room(envs: list[tuple[Path, str, bool]], free_bytes=None) -> None:
    """Before anything downloads: fail with one message if the disk cannot hold the environments
    still to build (`(venv_dir, the lock's torch, keep_torch)` each). A set-up that runs out of room
    fails minutes later, in the middle of a wheel, and may leave a broken environment behind."""
    free_of = free_bytes or (lambda p: shutil.disk_usage(p).free)
    by_disk: dict[int, list[tuple[Path, float]]] = {}
    for venv_dir, want, keep in envs:
        where = _existing(venv_dir)
        by_disk.setdefault(where.stat().st_dev, []).append((venv_dir, room_needed(venv_dir, want, keep)))
    for items in by_disk.values():
        need = sum(n for _, n in items)
        where = _existing(items[0][0])
        free = free_of(where)
        if need > free:
            names = ", ".join(str(v) for v, _ in items)
            raise SetupError(
                "check the disk has room",
                f"free {(need - free) / GB:.1f} GB more on that disk (`df -h {where}`: delete old environments, "
                "caches or clones), or build the environments on a disk with room: PPLAB_VENV=/big/disk/pplab-venv "
                "(and PPLAB_OTHER_VENV for the torch 2.11 leg of `dev.py test`, which `--one-torch` skips, "
                "PPLAB_MIDDLE_VENV for its middle release's leg, which `--no-middle` skips)",
                None, f"{names} still need about {need / GB:.1f} GB (torch's wheel on Linux is a CUDA build), "
                      f"and {free / GB:.1f} GB are free there")


# ------------------------------------------------------------------------------------------ set-up
def vpython(venv_dir: Path) -> Path:
    return venv_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def installed_torch(venv_dir: Path) -> str | None:
    r = subprocess.run([str(vpython(venv_dir)), "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def supported(version: str) -> bool:
    v = version_tuple(version)[:2]
    return SUPPORTED_TORCH[0] <= v <= SUPPORTED_TORCH[1]


def check_python() -> None:
    if sys.version_info[:2] < MIN_PYTHON:
        need = f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]}"
        raise SetupError("check Python", f"run dev.py with Python {need} or newer (torch 2.15.0, the locked "
                         f"release, has no wheel for {sys.version_info[0]}.{sys.version_info[1]}): "
                         f"python{need} scripts/dev.py ...; or use the conda route (README)")


def write_lab_settings(venv_dir: Path) -> None:
    """JupyterLab opens on the notebooks without asking about news or checking for updates (both
    would reach the network and cover the page with a toast): settings overrides inside the venv."""
    target = venv_dir / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(target.read_text()) if target.exists() else {}
    data["@jupyterlab/apputils-extension:notification"] = {"fetchNews": "false", "checkForUpdates": False}
    target.write_text(json.dumps(data, indent=2) + "\n")


@dataclass
class TorchPlan:
    message: str                 # one line: which torch and why
    install: list[str]           # pip arguments installing torch on its own ([] when none)
    from_lock: bool = False      # torch and its family come from the lock with the rest


def plan_torch(vpy: Path, pins: dict[str, list[Pin]], have: str | None, keep_torch: bool = True,
               torch_spec: str | None = None, spec_from: str = "PPLAB_TORCH") -> TorchPlan:
    """Which torch to install: `torch_spec` if given (where it came from: `spec_from`, said); else a
    supported torch already there when `keep_torch` (or exactly the lock's when not); else the lock's,
    or the newest supported one that pip's configuration allows when it caps torch below the lock."""
    want = locked_torch(pins)
    if torch_spec:
        return TorchPlan(f"torch: {torch_spec} ({spec_from}), instead of the lock's torch=={want}",
                         torch_spec.split())
    if have and (supported(have) if keep_torch else version_tuple(have) == version_tuple(want)):
        return TorchPlan(f"torch: keeping torch {have}, already installed (the lock has torch=={want})", [])
    caps = find_caps(vpy)
    if not caps:  # nothing in pip's configuration caps torch: the lock decides, pip is not asked
        return TorchPlan(f"torch: torch=={want} from the lock", [], from_lock=True)
    allowed = newest_allowed_torch(vpy)
    if version_tuple(allowed) < version_tuple(want):
        cap = caps[0].describe()
        return TorchPlan(f"torch: the lock wants torch=={want}, but pip's configuration caps it: {cap}; "
                         f"installing torch=={allowed}, the newest supported release the cap allows",
                         [f"torch=={allowed}"])
    return TorchPlan(f"torch: torch=={want} from the lock", [], from_lock=True)


def pip_check(vpy: Path) -> None:
    """`pip check`: every installed package's requirements are met."""
    cmd = [str(vpy), "-m", "pip", "check", "--disable-pip-version-check"]
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    problems = [line for line in r.stdout.splitlines() if line.strip() and not line.startswith("No broken")]
    if problems:
        raise SetupError("check that the installed packages agree (pip check)",
                         "refresh the locks (`python3 scripts/dev.py lock`) or report it: the lock should pin every "
                         "package that another one needs", cmd, "\n".join(problems[:5]))
    print("the installed packages agree (pip check)", flush=True)


def install_one_by_one(vpy: Path, lines: list[str], stop: threading.Event | None = None) -> None:
    """The torch family's big pins (torch, triton, the CUDA libraries: ~3 GB of wheels), one pip call
    each: pip downloads every wheel of a call before it installs any, so one call needs the space of
    all the wheels on top of the installed environment; one at a time needs only the largest. Quiet:
    one line per package (it runs beside the rest's install, whose output is shown); `stop` set: no
    further package is started."""
    have = _installed_versions(vpy)
    for line in lines:
        name, version = (x.strip() for x in re.split(r"==", line.split(";")[0].strip(), maxsplit=1))
        if have.get(norm(name)) == version or (stop is not None and stop.is_set()):
            continue
        start = time.monotonic()
        run_step(f"install {name} (the lock's torch family, one at a time)", [*pip(vpy), "--no-deps", line],
                 quiet=True)
        print(f"(torch's family: {name}=={version} installed in {time.monotonic() - start:.0f} s)", flush=True)


def install_locked(vpy: Path, lines: list[str], extras: str, step: str, *flags: str) -> None:
    """One pip call for the lock's `lines` (as a requirements file) and the kit, editable."""
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text("\n".join(lines) + "\n")
        run_step(step, [*pip(vpy), *flags, "-r", req, "-e", f"{ROOT}[{extras}]"])


def install_beside(vpy: Path, big: list[str], rest: list[str], extras: str, lock_name: str) -> None:
    """The lock's torch family (`big`, one wheel at a time, quiet) in a thread, beside one pip call for
    everything else and the kit (its output live). Both with `--no-deps`: the lock pins every package
    (uv's universal resolution), so neither call needs the other's; `pip check` then proves the whole
    agrees. On 2 cores a fresh .venv took 181 s against ~210 s one after the other (downloads and
    unpacking overlap). The first failure is the one raised; the other call stops after its current package."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def family() -> None:
        try:
            install_one_by_one(vpy, big, stop)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread)
            errors.append(e)

    worker = threading.Thread(target=family, name="torch-family", daemon=True)
    worker.start()
    try:
        install_locked(vpy, rest, extras, f"install the locked packages ({lock_name}) and the kit, beside torch's "
                       "family", "--no-deps")
    except BaseException:
        stop.set()
        raise
    finally:
        worker.join()
    if errors:
        raise errors[0]


def _installed_versions(vpy: Path) -> dict[str, str]:
    r = subprocess.run([str(vpy), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
                       capture_output=True, text=True)
    try:
        return {norm(d["name"]): d["version"] for d in json.loads(r.stdout)}
    except (ValueError, KeyError, TypeError):
        return {}


def setup(venv_dir: Path, lock: Path, keep_torch: bool = True, torch_spec: str | None = None,
          extras: str = EXTRAS, spec_from: str = "PPLAB_TORCH") -> str:
    """A virtual environment with the lock's packages and the kit (editable); returns torch's version.
    Which torch: `plan_torch` (said in one line)."""
    check_python()
    vpy = vpython(venv_dir)
    if not vpy.exists():
        print(f"creating virtual environment {venv_dir}", flush=True)
        try:
            venv_mod.EnvBuilder(with_pip=True).create(venv_dir)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SetupError("create the virtual environment", "check the disk has room and the folder is "
                             "writable, or choose another place with PPLAB_VENV=/path/to/venv",
                             [sys.executable, "-m", "venv", str(venv_dir)], str(e)) from None
    if not lock.exists():
        raise SetupError("read the lock", f"{lock} is missing: refresh the locks with `python3 scripts/dev.py lock`")
    pins = read_lock(lock)
    plan = plan_torch(vpy, pins, installed_torch(venv_dir), keep_torch, torch_spec, spec_from)
    print(plan.message, flush=True)
    if plan.install:
        run_step("install torch", [*pip(vpy), *plan.install])
    family = torch_family(pins)
    if plan.from_lock:
        big = {name for name in family if name in ("torch", "triton") or name.startswith("nvidia-")}
        install_beside(vpy, [p.line for name, entries in sorted(pins.items()) for p in entries if name in big],
                       [p.line for name, entries in sorted(pins.items()) for p in entries if name not in big],
                       extras, lock.name)
        pip_check(vpy)  # both calls had --no-deps: prove the whole agrees
    else:
        install_locked(vpy, [p.line for name, entries in sorted(pins.items()) for p in entries if name not in family],
                       extras, f"install the locked packages ({lock.name}) and the kit")
    write_lab_settings(venv_dir)
    return installed_torch(venv_dir) or "?"


# ------------------------------------------------------------------------------------ refreshing locks
UV = "uv==0.13.9"  # the lock tool, pinned so that a refresh gives the same file format


def lock(tools_venv: Path, upgrade: bool = False) -> int:
    """Re-resolve every lock from pyproject.toml + requirements/torch-X.Y.in with uv (fetched into
    .venv-tools), for every platform (`--universal`) and Python 3.11+. Pins already in a lock are
    kept where they still fit (a new dependency is added, nothing else moves); `upgrade` moves every
    package to its newest release."""
    check_python()
    if not vpython(tools_venv).exists():
        venv_mod.EnvBuilder(with_pip=True).create(tools_venv)
    run_step("install the lock tool", [*pip(vpython(tools_venv)), "-q", UV])
    uv = tools_venv / ("Scripts/uv.exe" if os.name == "nt" else "bin/uv")
    for src in sorted(REQUIREMENTS.glob("torch-*.in")):
        minor = tuple(int(x) for x in src.stem.split("-")[1].split("."))
        out = lock_path(minor)  # type: ignore[arg-type]
        extras = [a for e in EXTRAS.split(",") for a in ("--extra", e)]
        cmd = [uv, "pip", "compile", "pyproject.toml", src.relative_to(ROOT), *extras,
               "--universal", "--python-version", f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]}", *(["--upgrade"] * upgrade),
               "--custom-compile-command", "python3 scripts/dev.py lock", "-o", out.relative_to(ROOT)]
        run_step(f"lock {out.name}", cmd, env=dict(os.environ, UV_NO_CONFIG="1"), cwd=ROOT)
    return 0
