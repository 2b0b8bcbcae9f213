"""Who may import whom: the kit's packages form layers, and no package imports one above it (every
pair of modules is checked, lazy imports inside functions included). The layers, bottom first, are
`LAYERS` (docs/layout.md, "The package"); within a package, modules import each other freely."""

import ast
import re
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
    ("labkit.worker",),  # what runs a rank
    ("labkit.check",),  # the verdict, on those ranks: uses worker's collectives and shared references
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
    inside = [*(PKG / "worker").glob("*.py"), *(PKG / "check").glob("*.py"), *(PKG / "jobs").glob("*.py"),
              PKG / "spans" / "record.py", PKG / "ranks" / "rank.py"]
    for f in inside:
        assert not [m for m in kit_imports(f) if m.startswith("labkit.launching")], f


def test_a_model_does_not_launch():
    for f in (PKG / "models").glob("*.py"):
        assert not [m for m in kit_imports(f) if m.startswith(("labkit.launching", "labkit.ranks"))], f


def test_no_module_is_over_420_lines():
    long = {module_name(f): n for f in every_module() if (n := len(f.read_text().splitlines())) > 420}
    assert not long, f"split these by what they own: {long}"


def test_no_module_name_is_used_twice():
    """One name, one home: `frontier.py` in theory/ and timeline/, `controlled.py` in launching/ and
    jobs/ read as one concept in two places (a drawing module is named for what it draws: `*_plot`)."""
    homes: dict[str, list[str]] = {}
    for f in every_module():
        if f.name not in ("__init__.py", "__main__.py"):
            homes.setdefault(f.name, []).append(module_name(f))
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    assert not twice, f"rename one of each (a module name says its concept): {twice}"


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


# The layering is written once, in LAYERS; the table in docs/layout.md (read with README.md and every docs
# page) and each package's "May import" line are checked against it here rather than kept by hand beside it.

README = PKG.parent / "README.md"
DOCS = PKG.parent / "docs"


def readme_and_docs() -> str:
    """README.md and every docs/*.md page as one text: the layer table lives in docs/layout.md."""
    return "\n".join(p.read_text() for p in [README, *sorted(DOCS.glob("*.md"))])


_ROW = re.compile(r"^\| (\d+) \| `labkit/([\w./]+)` \| (.*) \|$", re.M)


def unit_of_path(path: str) -> str:
    """`core/` -> labkit.core, `doctor.py` -> labkit.doctor, `__init__.py` -> labkit."""
    if path == "__init__.py":
        return "labkit"
    return "labkit." + path.rstrip("/").removesuffix(".py")


def below(unit: str) -> set[str]:
    """The units a unit may import: every one in a layer before its own (LAYERS)."""
    layer = next(i for i, group in enumerate(LAYERS) if unit in group)
    return {u for group in LAYERS[:layer] for u in group}


def test_readme_layer_table_is_layers():
    """The table "The package, layer by layer" (docs/layout.md): one row per unit of LAYERS, in its order,
    numbered by its layer."""
    rows = [(int(n), unit_of_path(p)) for n, p, _ in _ROW.findall(readme_and_docs())]
    want = [(i, unit) for i, group in enumerate(LAYERS) for unit in group]
    assert rows == want, ("The layer table (docs/layout.md) differs from tests/test_layers.py's LAYERS:\n"
                          f"docs: {rows}\nLAYERS: {want}")


def test_readme_layer_table_names_every_module_of_a_package():
    missing = []
    for _, path, text in _ROW.findall(readme_and_docs()):
        if path.endswith("/"):
            for f in sorted((PKG / path).glob("*.py")):
                named = any(re.search(rf"(?<![\w]){f.stem}(?![\w])", span) for span in re.findall(r"`([^`]+)`", text))
                if f.stem != "__init__" and not named:
                    missing.append(f"labkit/{path}{f.name}")
    assert not missing, "The layer table (docs/layout.md) does not name: " + ", ".join(missing)


def may_import_line(doc: str) -> tuple[set[str], set[str]]:
    """(units a package's "May import" line names, units its "Never" clause names). "everything
    below it" names every unit below the package; "nothing of labkit", none."""
    text = " ".join(doc.split("May import:", 1)[1].split())
    allowed, _, never = text.partition("Never")
    names = set(re.findall(r"labkit\.\w+", allowed))
    return names, {n.split(".")[0] + "." + n.split(".")[1] for n in re.findall(r"labkit\.\w+", never)}


def test_each_package_may_import_line_agrees_with_layers():
    """Each package's "May import" line names only units below it in LAYERS (and every one its code
    imports); what its "Never" clause names is not below it."""
    wrong = []
    uses = {}
    for f in every_module():
        _, unit = layer_of(module_name(f))
        uses.setdefault(unit, set()).update(layer_of(o)[1] for o in kit_imports(f))
    for d in sorted(p for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        unit = f"labkit.{d.name}"
        doc = ast.get_docstring(ast.parse((d / "__init__.py").read_text())) or ""
        named, never = may_import_line(doc)
        allowed = below(unit)
        if "everything below it" in doc.split("May import:", 1)[1]:
            named |= allowed
        for n in sorted(named - allowed):
            wrong.append(f"{unit} says it may import {n}, which LAYERS puts at or above it")
        for n in sorted(uses.get(unit, set()) - {unit} - named):
            wrong.append(f"{unit} imports {n} but its May import line does not name it")
        for n in sorted(never & allowed):
            wrong.append(f"{unit} says never {n}, which LAYERS puts below it")
    assert not wrong, "\n".join(wrong)


def _sibling_imports(path: Path, siblings: set) -> set:
    """The modules of the same package that `path` imports (`from .x import`, `from . import x`), at
    run time: an import under `if TYPE_CHECKING:` is for annotations only and makes no circle."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.level == 1 and id(n) not in typing_only:
            names = [n.module.split(".")[0]] if n.module else [a.name for a in n.names]
            found.update(x for x in names if x in siblings and x != path.stem)
    return found


def test_no_package_imports_itself_in_a_circle():
    """Inside a package the modules import each other one way (issue 43: search, exact, polish and
    simulate imported each other; spans' record and recorder did too)."""
    for pkg in sorted(p for p in PKG.iterdir() if (p / "__init__.py").exists()):
        mods = {p.stem: p for p in pkg.glob("*.py") if p.stem != "__init__"}
        graph = {m: _sibling_imports(p, set(mods)) for m, p in mods.items()}
        done, on_path = set(), []

        def visit(m):
            assert m not in on_path, f"{pkg.name}: import circle {' -> '.join(on_path[on_path.index(m):] + [m])}"
            if m in done:
                return
            on_path.append(m)
            for n in sorted(graph[m]):
                visit(n)
            on_path.pop()
            done.add(m)

        for m in sorted(graph):
            visit(m)
