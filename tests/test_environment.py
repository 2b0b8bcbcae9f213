"""environment.yml (conda) and pyproject.toml (pip) must list the same dependencies."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch"}  # pip name -> conda-forge name


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


def test_the_two_locks_agree_outside_torch():
    """Both legs of `dev.py test` run the same packages; only torch and what only torch needs differ."""
    a, b = (envsetup.read_lock(lock) for lock in LOCKS.values())
    fa, fb = envsetup.torch_family(a), envsetup.torch_family(b)
    rest = lambda pins, fam: {n: [p.line for p in e] for n, e in pins.items() if n not in fam}  # noqa: E731
    assert rest(a, fa) == rest(b, fb)
    assert {"torch", "sympy", "triton"} <= fa and "jupyterlab" not in fa and "numpy" not in fa
