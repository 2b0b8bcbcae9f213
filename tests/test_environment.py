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
