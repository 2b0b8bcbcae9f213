"""Timelines read and compared: a measured run beside its fitted ideal (`compare`), matplotlib
drawings that take an `ax` (`plot`), Chrome/Perfetto export (`perfetto`). The data model itself is
`labkit.core.timeline`.

May import: labkit.core, labkit.logs, labkit.spans, labkit.schedules, labkit.theory, labkit.config."""

from ..core import submodules as _submodules

__getattr__ = _submodules(__name__)  # labkit.timeline.<module> after `import labkit`
