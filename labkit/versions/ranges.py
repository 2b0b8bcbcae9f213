"""Every dependency's supported range (data only): `RANGES`, read by labkit.versions (the ranges part
of its docstring says how they are kept in step with pyproject.toml and the locks).

May import: nothing of labkit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """The supported releases of one dependency. Versions are compared at the precision written:
    "2.15" admits every 2.15.x (a patch release of a tested minor counts as tested)."""

    name: str
    """The distribution's name, as pip knows it."""
    floor: str | None
    """The oldest supported release: pyproject.toml's `>=` (the floors lock pins it, and dev.py test's
    second leg runs on it); None where pyproject.toml gives no floor (no lower end is tested)."""
    newest: str
    """The newest release tested: (major.minor of) the main lock's pin, the first leg of dev.py test."""
    needed_by: str
    """What in the lab needs it (said when it is missing or out of range)."""


RANGES = {r.name: r for r in (
    Range("torch", "2.11", "2.15", "everything"),
    Range("transformers", "5.23", "5.24", "notebook 11 and `labkit run --model` (the models extra)"),
    Range("ortools", "9.15.6755", "9.15", "the exact schedule search (`labkit search --time-limit`; the search extra)"),
    Range("numpy", None, "2.5", "the kit"),
    Range("matplotlib", None, "3.11", "every plot"),
    Range("psutil", None, "7.2", "the launcher"),
    Range("tqdm", None, "4.70", "the progress bars"),
    Range("jupyterlab", None, "4.6", "the lab"),
    Range("ipywidgets", None, "8.1", "the explorers"),
    Range("ipykernel", None, "7.4", "the lab"),
    Range("latex2mathml", None, "3.81", "the handouts"),
    Range("pytest", None, "9.2", "the tests"),
    Range("pytest-xdist", None, "3.8", "the tests' parallel workers (dev.py test)"),
    Range("nbval", None, "0.11", "the notebooks' tests"),
    Range("playwright", None, "1.65", "the browser tests"),
)}
"""Every dependency in pyproject.toml (extras included), with its supported range."""
