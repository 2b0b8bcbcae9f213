"""Spans: every pipelining action measured at both ends, in every rank the kit starts.

- `record`: inside a rank (imports torch): patches torch's stages and schedules so that each F, B,
  I, W (and each post of / wait for a send or receive) is timed at both ends, CUDA events on GPUs;
  loaded by `boot/sitecustomize.py` in every rank the launcher starts (a user's plain script too);
- `numbers`: what each step computed (its losses, each stage's gradient norm), on its `end_step` line;
- `received`: what each stage's forward received and returned, fingerprinted for the step check;
- `held`: torch's pipelining records held, on CPU, and written where the rank would idle;
- `read`: spans files into a `Timeline` whose source is "spans";
- `quiet`: when a timing may be compared (the quiet-baseline rule, stated once);
- `idle`: every idle moment of a step, by cause, from the spans;
- `compiled`: what torch.compile did in each step, per rank (dynamo's counts: graphs, graph breaks,
  recompiles, frames that fell back to eager), and `compile_notes`, which says it in words.

The timeline the kit draws by default (`labkit timeline`, `%%ranks --timeline`, `pool.timeline()`,
the explorer, `labkit.run`) comes from spans where they exist: see `labkit.timeline.compare.load_timeline`.
Taught in notebook 06b.

May import: labkit.core, labkit.versions (torch's private API), labkit.logs (idle causes).
"""

from ..core import exports as _exports

# the readers import labkit.core.actions and `record` imports torch: `import labkit.spans` stays light for the launcher
__getattr__, __dir__, __all__ = _exports(__name__, {
    ".paths": ("BOOT_DIR", "SPANS_DIR_VAR", "span_files"),
    ".read": ("Span", "has_spans", "read_spans", "time_by_kind", "timeline_from_spans", "without_descheduling",
              "makespan_without_load", "compile_counts"),
    ".idle": ("DESCHEDULED", "explain_idle_by_pipeline", "explain_idle_spans"),
    ".compiled": ("compile_notes",),
    ".quiet": ("Quiet", "quiet_baseline"),
})
