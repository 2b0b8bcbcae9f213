"""Who may import whom: the kit's packages form layers, and no package imports one above it (every
pair of modules is checked, lazy imports inside functions included). The layers, bottom first, are
`LAYERS` (README, "The package"); within a package, modules import each other freely."""

import ast
from pathlib import Path

import labkit

PKG = Path(labkit.__file__).parent

LAYERS = (
    ("labkit.core", "labkit.versions"),  # the shared vocabulary: imports nothing of the kit
    ("labkit.doctor",),
    ("labkit.logs",),
    ("labkit.schedules",),
    ("labkit.theory", "labkit.spans"),
    ("labkit.config",),
    ("labkit.worker",),
    ("labkit.models", "labkit.parallel", "labkit.practice"),
    ("labkit.jobs", "labkit.timeline"),
    ("labkit.launching",),
    ("labkit.ranks",),
    ("labkit.notebook",),
    ("labkit.cli",),  # the command line
    ("labkit.__main__", "labkit"),  # `python -m labkit`, and the public API (labkit/__init__.py)
)
"""Each group may import the groups before it, never one after it nor a sibling of its own group."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kit_imports(path: Path) -> set[str]:
    """Modules of the kit that a file imports (at any depth: lazy imports inside functions count);
    `from labkit import versions` counts as labkit.versions."""
    tree = ast.parse(path.read_text())
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.split(".")[0] == "labkit":
                mod = node.module
            else:
                continue
            for alias in node.names:  # `from . import worker` names a module
                sub = f"{mod}.{alias.name}"
                found.add(sub if (PKG.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                          or (PKG.parent / sub.replace(".", "/")).is_dir() else mod)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "labkit"}
    return found


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the unit of the layering: a subpackage or a top-level module) of a module."""
    best = None
    for i, group in enumerate(LAYERS):
        for unit in group:
            if (module == unit or (unit != "labkit" and module.startswith(unit + "."))) and (best is None or len(unit) > len(best[1])):
                best = (i, unit)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS"
    return best


def every_module() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "boot" not in p.parts)


def test_every_import_points_down_the_layers():
    wrong = []
    for f in every_module():
        me = module_name(f)
        my_layer, my_unit = layer_of(me)
        for other in sorted(kit_imports(f)):
            layer, unit = layer_of(other)
            if unit == my_unit:
                continue
            if layer >= my_layer:
                wrong.append(f"{me} imports {other} ({unit}, layer {layer} >= {my_unit}'s {my_layer})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_every_package_is_placed_and_says_what_it_may_import():
    for d in sorted(p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        name = f"labkit.{d.name}"
        layer_of(name)
        doc = ast.get_docstring(ast.parse((d / "__init__.py").read_text())) or ""
        assert "May import" in doc, f"{name}/__init__.py: its docstring says what it owns and what it may import"


def test_the_top_level_holds_the_entry_points_only():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 6, top
    assert set(top) <= {"__init__.py", "__main__.py", "cli.py", "versions.py", "doctor.py"}, top


def test_the_shared_vocabulary_imports_nothing_of_the_kit():
    for f in (PKG / "core").glob("*.py"):
        assert kit_imports(f) == set(), f


def test_code_inside_a_rank_does_not_import_the_launcher():
    inside = [*(PKG / "worker").glob("*.py"), *(PKG / "jobs").glob("*.py"), PKG / "spans" / "record.py",
              PKG / "ranks" / "rank.py"]
    for f in inside:
        assert not [m for m in kit_imports(f) if m.startswith("labkit.launching")], f


def test_a_model_does_not_launch():
    for f in (PKG / "models").glob("*.py"):
        assert not [m for m in kit_imports(f) if m.startswith(("labkit.launching", "labkit.ranks"))], f


def test_no_module_is_over_420_lines():
    long = {module_name(f): n for f in every_module() if (n := len(f.read_text().splitlines())) > 420}
    assert not long, f"split these by what they own: {long}"


def test_the_log_format_has_one_home_both_sides_use():
    """The kit's PP log format is defined once, beside its reader (labkit.logs.parse): the launcher
    sets it for a job's ranks and a live rank formats its cell's log with it, and what it writes
    parses back with its microsecond stamp."""
    import logging

    from labkit.launching import command
    from labkit.launching.launch import PP_LOG_FORMAT as exported
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
