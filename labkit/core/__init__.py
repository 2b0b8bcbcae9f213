"""The vocabulary every layer shares, importing nothing else of the kit: the timeline data model
(`timeline`: Action, Timeline, bubble metrics), the kit's error (`errors.ConfigError`) and what
both the launcher and a rank need of processes (`processes`), and progress bars (`progress`: jobs,
sweeps and searches show one).

May import: nothing of labkit."""


from importlib import import_module


def submodules(package: str):
    """A module `__getattr__` for `package` (every labkit subpackage uses one, so that `import labkit`
    stays light in every process of a job): an unknown attribute is its submodule of that name, if any."""

    def __getattr__(name: str):
        try:
            return import_module(f".{name}", package)
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = submodules(__name__)  # labkit.core.<module> after `import labkit`
