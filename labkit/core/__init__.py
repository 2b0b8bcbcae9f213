"""The vocabulary every layer shares, importing nothing else of the kit: the timeline data model
(`actions`: Action, Timeline, bubble metrics, interval unions), the kit's error (`errors.ConfigError`) and what
both the launcher and a rank need of processes (`processes`), and progress bars (`progress`: jobs,
sweeps and searches show one); and `exports`, how every package of the kit names what it re-exports.

May import: nothing of labkit."""

import os
import sys
from importlib import import_module


def exports(package: str, homes: dict[str, tuple[str, ...]] | None = None):
    """The one way a labkit package re-exports names: `(__getattr__, __dir__, __all__)` for its `__init__`.

        __getattr__, __dir__, __all__ = exports(__name__, {".read": ("read_spans",), "..logs.gaps": ("CAUSES",)})

    `homes` maps a module (relative to `package`, or absolute) to the names it owns; each is imported
    when first used, so that `import labkit` stays light in every process of a job (no torch). A home
    of "." names submodules exported as modules (`labkit.theory.paper`). Any other attribute is a
    submodule of that name, if any (`labkit.worker.stages` after `import labkit`).

    A name that is also a submodule's name (`labkit.theory.search`, the function, beside
    `labkit/theory/search.py`) is imported now: Python sets a package's attribute to its submodule
    when the submodule is first imported, so a lazy function of that name would turn into the module."""
    homes = homes or {}
    home_of = {name: home for home, names in homes.items() for name in names}
    where = os.path.dirname(sys.modules[package].__file__)
    namespace = vars(sys.modules[package])

    def load(name: str):
        if home_of[name] == ".":
            return import_module(f".{name}", package)
        return getattr(import_module(home_of[name], package), name)

    def __getattr__(name: str):
        if name in home_of:
            return load(name)
        try:
            return import_module(f".{name}", package)
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(home_of))

    namespace["__getattr__"] = __getattr__  # the modules imported below may ask the package for a name
    for name, home in home_of.items():
        submodule = os.path.join(where, name)
        if home != "." and (os.path.exists(submodule + ".py") or os.path.isdir(submodule)):
            namespace[name] = load(name)
    return __getattr__, __dir__, sorted(home_of)


__getattr__, __dir__, __all__ = exports(__name__)  # labkit.core.<module> after `import labkit`
