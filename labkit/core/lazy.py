"""Modules of a package reached as attributes (`labkit.notebook.helpers` after `import labkit`) without
importing them up front: `import labkit` runs in every process of a job (the torchrun agent, every
rank, `labkit launch`), which should pay only for what it uses."""

from __future__ import annotations

from importlib import import_module


def submodules(package: str):
    """A module `__getattr__` for `package`: an unknown attribute is its submodule of that name, if any."""

    def __getattr__(name: str):
        try:
            return import_module(f".{name}", package)
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
