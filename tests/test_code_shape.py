"""The package reads as steps: no function or method in labkit/ is longer than MAX_FUNCTION_LINES,
from its `def` line to its last line (docstring included). Orchestration is cut into named steps
(build, step, check, report); a long search heuristic into the steps of its math."""

import ast
from pathlib import Path

import labkit

PKG = Path(labkit.__file__).parent

MAX_FUNCTION_LINES = 80


def long_functions(root: Path = PKG, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line qualified.name (N lines)` of every function or method over `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))

        def walk(node, prefix=""):
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}."
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    n = child.end_lineno - start + 1
                    if n > limit:
                        found.append(f"{path.relative_to(root.parent)}:{child.lineno} {name[:-1]} ({n} lines)")
                walk(child, name)

        walk(tree)
    return found


def test_no_function_is_over_80_lines():
    long = long_functions()
    assert not long, (f"{len(long)} function(s) over {MAX_FUNCTION_LINES} lines; cut each into named steps "
                      f"(a helper per step, state in a small dataclass):\n  " + "\n  ".join(long))


def test_the_length_rule_sees_methods_and_nested_functions(tmp_path):
    six = "".join(f"        x{i} = {i}\n" for i in range(5))  # a def line and 5 of body: 6 lines
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "class C:\n    def method(self):\n" + six + "\n"
        "def outer():\n    def inner():\n" + six + "    return inner\n\n"
        "def short():\n    return 1\n")
    assert long_functions(tmp_path / "pkg", limit=5) == [
        "pkg/m.py:2 C.method (6 lines)", "pkg/m.py:9 outer (8 lines)", "pkg/m.py:10 outer.inner (6 lines)"]
    assert long_functions(tmp_path / "pkg", limit=8) == []
