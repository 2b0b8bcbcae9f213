"""Schedules as data: the table of torch's schedules and their shape rules (`table`), orders of
actions (`orders`: torch's `0F1` grammar, checks, in-flight counts, CSV), and whether an order can
finish, from the plan alone (`deadlock`: its wait cycle when it cannot).

May import: labkit.core, labkit.logs (the action grammar of torch's log lines)."""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__)  # labkit.schedules.<module> after `import labkit`
