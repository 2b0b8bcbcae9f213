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
    for f in (PKG / "worker.py", PKG / "spans" / "record.py"):
        assert not [m for m in kit_imports(f) if m.startswith("labkit.launching")], f
