"""Spans: every pipelining action measured at both ends, in every rank the kit starts.

- `record`: inside a rank (imports torch): patches torch's stages and schedules so that each F, B,
  I, W (and each post of / wait for a send or receive) is timed at both ends, CUDA events on GPUs;
  loaded by `boot/sitecustomize.py` in every rank the launcher starts (a user's plain script too);
- `read`: spans files into a `Timeline` whose source is "spans";
- `idle`: every idle moment of a step, by cause, from the spans.

The timeline the kit draws by default (`labkit timeline`, `%%ranks --timeline`, `pool.timeline()`,
the explorer, `labkit.run`) comes from spans where they exist: see `labkit.timeline.compare.load_timeline`.
Taught in notebook 06b.

May import: labkit.core, labkit.logs (idle causes).
"""

from .paths import BOOT_DIR, SPANS_DIR_VAR, span_files

__all__ = ["BOOT_DIR", "SPANS_DIR_VAR", "span_files", "read_spans", "timeline_from_spans", "explain_idle_spans",
           "explain_idle_by_pipeline", "has_spans"]


def __getattr__(name):  # the readers import labkit.core.timeline; keep `import labkit.spans` light for the launcher
    if name in ("read_spans", "timeline_from_spans", "has_spans", "Span"):
        from . import read

        return getattr(read, name)
    if name in ("explain_idle_spans", "explain_idle_by_pipeline"):
        from . import idle

        return getattr(idle, name)
    from ..core import submodules

    return submodules(__name__)(name)  # a module of the package: labkit.spans.read after `import labkit`
