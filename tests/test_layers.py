"""Who may import whom: the timeline model depends on nothing else in the kit, and code that runs
inside a rank does not import the launcher's side."""

import ast
from pathlib import Path

import labkit

PKG = Path(labkit.__file__).parent


def kit_imports(path: Path) -> set[str]:
    """Modules of the kit that a file imports (at any depth: lazy imports inside functions count)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = path.relative_to(PKG.parent).with_suffix("").parts[:-node.level]
                found.add(".".join([*base, *(node.module.split(".") if node.module else [])]))
            elif node.module and node.module.startswith("labkit"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("labkit")}
    return found


def test_the_timeline_model_imports_nothing_of_the_kit():
    assert kit_imports(PKG / "timeline.py") == set()


def test_code_inside_a_rank_does_not_import_the_launcher():
    for f in (PKG / "worker.py", PKG / "spans" / "record.py", PKG / "ranks" / "rank.py"):
        assert not [m for m in kit_imports(f) if m.startswith("labkit.launching")], f


def test_the_log_format_has_one_home_both_sides_use():
    """The kit's PP log format is defined once, beside its reader (labkit.logs.parse): the launcher
    sets it for a job's ranks and a live rank formats its cell's log with it, and what it writes
    parses back with its microsecond stamp."""
    import logging

    from labkit.launch import PP_LOG_FORMAT as exported
    from labkit.launching import command
    from labkit.logs.parse import PP_LOG_FORMAT, parse_lines

    assert command.PP_LOG_FORMAT is PP_LOG_FORMAT and exported is PP_LOG_FORMAT
    assert "labkit.logs.parse" in kit_imports(PKG / "ranks" / "rank.py")
    assert "PP_LOG_FORMAT =" not in (PKG / "launching" / "command.py").read_text()
    record = logging.LogRecord("torch.distributed.pipelining.stage", logging.DEBUG, "stage.py", 1,
                               "[Stage 1] Forwarded chunk 2, outputs: x", None, None)
    record.created = 1732241358.636123
    (event,) = parse_lines([logging.Formatter(PP_LOG_FORMAT).format(record)], rank=1)
    assert (event.rank, event.kind, event.stage, event.microbatch) == (1, "F", 1, 2)
    assert abs(event.time - 1732241358.636123) < 1e-6
