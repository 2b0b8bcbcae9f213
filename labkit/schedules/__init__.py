"""Schedules as data: the table of torch's schedules and their shape rules (`table`), and orders of
actions (`orders`: torch's `0F1` grammar, checks, in-flight counts, CSV).

May import: labkit.core, labkit.logs (the action grammar of torch's log lines)."""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__)  # labkit.schedules.<module> after `import labkit`
