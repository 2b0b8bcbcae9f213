"""environment.yml (conda) and pyproject.toml (pip) must list the same dependencies."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch", "ortools": "ortools-python"}  # pip name -> conda-forge name


def _name(req: str) -> str:
    return re.split(r"[<>=!~ \[;]", req.strip(), maxsplit=1)[0].lower()


def _pyproject() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(data["dependencies"])
    for extra in data["optional-dependencies"].values():
        reqs += extra
    return {CONDA_NAMES.get(_name(r), _name(r)): r for r in reqs}


def _conda() -> dict[str, str]:
    deps = {}
    in_deps = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if line.startswith("dependencies:"):
            in_deps = True
            continue
        m = re.match(r"^  - (\S.*)$", line)
        if in_deps and m and not m.group(1).startswith("pip:"):
            deps[_name(m.group(1))] = m.group(1)
    return deps


def test_same_packages_both_ways():
    conda = {k: v for k, v in _conda().items() if k not in ("python", "pip")}
    assert set(conda) == set(_pyproject()), (set(conda) ^ set(_pyproject()))


def test_same_torch_floor():
    floor = re.search(r">=\s*([\d.]+)", _pyproject()["pytorch"]).group(1)
    assert _conda()["pytorch"] == f"pytorch>={floor}"


def test_environment_installs_the_kit():
    assert "- -e ." in (ROOT / "environment.yml").read_text()


# ---- the locks (requirements/lab-torch*.txt, `python3 scripts/dev.py lock`) ----
import sys  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import dev  # noqa: E402
import envsetup  # noqa: E402

LOCKS = {minor: envsetup.lock_path(minor) for minor in (dev.MAIN_TORCH, dev.OTHER_END)}


def _requirements() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(data["dependencies"]) + [r for name in envsetup.EXTRAS.split(",")
                                     for r in data["optional-dependencies"][name]]


def test_every_lock_pins_torch_as_its_input_says_and_both_ends_of_the_range():
    from labkit.versions import SUPPORTED
    assert dev.MAIN_TORCH == SUPPORTED[1] and dev.OTHER_END == SUPPORTED[0]
    assert envsetup.SUPPORTED_TORCH == SUPPORTED
    for minor, lock in LOCKS.items():
        pins = envsetup.read_lock(lock)
        src = (ROOT / "requirements" / f"torch-{minor[0]}.{minor[1]}.in").read_text()
        assert f"torch=={envsetup.locked_torch(pins)}\n" in src
        assert envsetup.version_tuple(envsetup.locked_torch(pins))[:2] == minor


def test_every_lock_holds_exactly_what_pyproject_asks_for():
    """A dependency added to pyproject.toml (or dropped) without refreshing the locks fails here."""
    wanted = {envsetup.norm(_name(r)) for r in _requirements()}
    for lock in LOCKS.values():
        pins = envsetup.read_lock(lock)
        direct = {n for n, entries in pins.items() if any("labkit (pyproject.toml)" in v for p in entries for v in p.via)}
        assert direct == wanted, (lock.name, direct ^ wanted)
        assert "python3 scripts/dev.py lock" in lock.read_text().splitlines()[1]


def test_locked_versions_meet_pyproject_and_environment_yml():
    """Where pyproject.toml or environment.yml give a floor, the locked release meets it."""
    floors = {}
    for req in list(_requirements()) + list(_conda().values()):
        m = re.search(r">=\s*([\d.]+)", req)
        if m:
            name = {v: k for k, v in CONDA_NAMES.items()}.get(_name(req), _name(req))
            floors[envsetup.norm(name)] = envsetup.version_tuple(m.group(1))
    assert "torch" in floors
    for lock in LOCKS.values():
        pins = envsetup.read_lock(lock)
        for name, floor in floors.items():
            if name == "python":
                continue
            for pin in pins[name]:
                assert envsetup.version_tuple(pin.version) >= floor, (lock.name, name, pin.version)


def _floors() -> dict[str, str]:
    """name -> the floor pyproject.toml gives it (`>=`), for every dependency that has one."""
    out = {}
    for req in _requirements():
        m = re.search(r">=\s*([\d.]+)", req)
        if m:
            out[envsetup.norm(_name(req))] = m.group(1)
    return out


def test_the_ranges_declared_are_pyprojects_floors_and_the_main_locks_newest():
    """labkit.versions.RANGES has every dependency of pyproject.toml: its floor is pyproject.toml's (and
    environment.yml's), its newest is the main lock's release (a lock refresh that moves a package to
    a new minor without declaring it fails here)."""
    from labkit.versions import RANGES, release
    assert {envsetup.norm(n) for n in RANGES} == {envsetup.norm(_name(r)) for r in _requirements()}
    floors = _floors()
    conda = {k: v for k, v in _conda().items()}
    main = envsetup.read_lock(LOCKS[dev.MAIN_TORCH])
    for name, r in RANGES.items():
        assert r.floor == floors.get(envsetup.norm(name)), (name, r.floor, floors.get(envsetup.norm(name)))
        if r.floor:
            assert conda[CONDA_NAMES.get(name, name)].endswith(f">={r.floor}"), (name, "environment.yml")
        newest = max(release(p.version) for p in main[envsetup.norm(name)])
        assert newest[:len(release(r.newest))] == release(r.newest), (name, r.newest, newest)


def test_the_floors_lock_pins_every_floor_and_the_main_lock_the_newest():
    """Leg 2 of `dev.py test` runs on the floors: requirements/torch-2.11.in pins exactly the declared
    floors (their first release: X.Y.0, or the floor itself where it names a release, as OR-Tools'
    9.15.6755), and the floors lock holds them; the main lock holds none of them older than its newest
    tested release."""
    from labkit.versions import RANGES, release
    first = lambda f: f if f.count(".") >= 2 else f + ".0"  # noqa: E731
    floored = {envsetup.norm(n): first(r.floor) for n, r in RANGES.items() if r.floor}
    assert set(floored) == set(_floors()) and "torch" in floored and "transformers" in floored
    src = (ROOT / "requirements" / f"torch-{dev.OTHER_END[0]}.{dev.OTHER_END[1]}.in").read_text()
    pinned = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+)$", src, re.M))
    assert {envsetup.norm(n): v for n, v in pinned.items()} == floored
    floors_lock = envsetup.read_lock(LOCKS[dev.OTHER_END])
    main = envsetup.read_lock(LOCKS[dev.MAIN_TORCH])
    for name, floor in floored.items():
        assert [p.version for p in floors_lock[name]] == [floor], (name, "floors lock")
        newest = RANGES[name].newest if name in RANGES else None
        assert all(release(p.version)[:2] == release(newest) for p in main[name]), (name, "main lock")


def test_the_two_locks_agree_outside_the_declared_floors():
    """Both legs of `dev.py test` run the same packages; only what has a declared floor (torch, transformers:
    the floors lock pins them at it) and what only those need differ."""
    from labkit.versions import RANGES
    floored = {envsetup.norm(n) for n, r in RANGES.items() if r.floor}
    a, b = (envsetup.read_lock(lock) for lock in LOCKS.values())
    fa, fb = envsetup.family(a, floored), envsetup.family(b, floored)
    rest = lambda pins, fam: {n: [p.line for p in e] for n, e in pins.items() if n not in fam}  # noqa: E731
    assert rest(a, fa) == rest(b, fb)
    ta, tb = envsetup.torch_family(a), envsetup.torch_family(b)
    assert {"torch", "sympy", "triton"} <= ta and "jupyterlab" not in ta and "numpy" not in ta
    assert {"transformers", "tokenizers", "safetensors"} <= fa and "jupyterlab" not in fa and "numpy" not in fa
