"""The vocabulary every layer shares, importing nothing else of the kit: the timeline data model
(`timeline`: Action, Timeline, bubble metrics), the kit's error (`errors.ConfigError`) and what
both the launcher and a rank need of processes (`processes`), and progress bars (`progress`: jobs,
sweeps and searches show one).

May import: nothing of labkit."""


def __getattr__(name):  # labkit.core.<module> after `import labkit` (core imports nothing of the kit, lazy.py included)
    from importlib import import_module

    try:
        return import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
