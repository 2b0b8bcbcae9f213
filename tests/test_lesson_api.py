"""What a lesson may import: the modules and names of "The lesson API" (docs/layout.md), and nothing else.

That table (found in README.md or a docs/*.md page) is the one list: each row a public module and its
`__all__`. Checked here: the table and each module's `__all__` agree and every name resolves; the
notebooks (every code cell, the `%%ranks` cells that run on the ranks, and the rank code a cell sends
as a string), their solutions and their scripts import only those names from only those modules; the
package re-exports obey the layers of tests/test_layers.py; `import labkit` stays cheap.
"""

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_layers import PKG, layer_of

ROOT = PKG.parent
NOTEBOOKS = ROOT / "notebooks"
ROW = re.compile(r"^\| `(labkit[\w.]*)` \| .* \| ((?:`\w+`(?:, )?)+) \|$")


def lesson_api() -> dict[str, list[str]]:
    """The "The lesson API" table (README.md or a docs/*.md page: docs/layout.md): {public module: its names}."""
    pages = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             if "\n## The lesson API\n" in p.read_text()]
    assert len(pages) == 1, f"one page has the section '## The lesson API', not {len(pages)}: {pages}"
    section = pages[0].read_text().split("\n## The lesson API\n", 1)[1].split("\n## ", 1)[0]
    rows = [ROW.match(line) for line in section.splitlines() if line.startswith("| `labkit")]
    assert rows and all(rows), "The lesson API table: | `module` | for | `name`, `name` | on each row"
    return {m.group(1): re.findall(r"`(\w+)`", m.group(2)) for m in rows}


API = lesson_api()


def lesson_code() -> list[tuple[str, str]]:
    """(where, code) for every code cell of every notebook, magics blanked, and every learner's .py beside them."""
    found = []
    for nb in sorted(NOTEBOOKS.glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "code":
                lines = "".join(cell["source"]).split("\n")
                found.append((f"{nb.name} cell {i}", "\n".join("" if l.lstrip().startswith("%") else l for l in lines)))
    for py in sorted(NOTEBOOKS.glob("*/*.py")):
        found.append((str(py.relative_to(ROOT)), py.read_text()))
    return found


def wrong_imports(code: str) -> list[str]:
    """Each labkit import in `code` (string literals of rank code included) outside the lesson API."""
    wrong = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            wrong += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "labkit" and a.name not in API]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "labkit":
            names = API.get(node.module, [])
            if node.module not in API or any(a.name not in names for a in node.names):
                wrong.append(ast.unparse(node))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "labkit":
            if node.attr not in API["labkit"] and f"labkit.{node.attr}" not in API:
                wrong.append(f"labkit.{node.attr}")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and isinstance(node.value.value, ast.Name) and node.value.value.id == "labkit"):
            module = f"labkit.{node.value.attr}"
            if module in API and node.attr not in API[module]:
                wrong.append(f"{module}.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "labkit" in node.value:
            try:
                wrong += wrong_imports(node.value)
            except SyntaxError:
                pass  # prose, not code
    return wrong


def test_the_table_is_each_modules_all_and_every_name_resolves():
    assert {"labkit", "labkit.notebook"} <= set(API)
    for module, names in API.items():
        mod = importlib.import_module(module)
        assert names == sorted(mod.__all__), f"The lesson API row for {module} != its __all__: {sorted(mod.__all__)}"
        for name in names:
            assert getattr(mod, name) is not None, f"{module}.{name}"
    owners = [name for names in API.values() for name in names]
    assert len(owners) == len(set(owners)), "a name in two public modules: give it one home"


def test_the_checks_are_public_at_the_top():
    import labkit
    from labkit.check.noise import autocast
    from labkit.check.reference import check_step
    from labkit.check.stagewise import check_stages

    assert (labkit.check_step, labkit.check_stages, labkit.autocast) == (check_step, check_stages, autocast)


@pytest.mark.parametrize("where, code", lesson_code(), ids=lambda v: v if " cell " in v or v.endswith(".py") else "")
def test_lessons_import_only_the_lesson_api(where, code):
    wrong = wrong_imports(code)
    assert not wrong, (f"{where} imports outside the lesson API (docs/layout.md, 'The lesson API'): {wrong}; import "
                       "the name from its public module, or make it public there (its package's exports and "
                       "the lesson API table)")


def test_the_check_catches_a_private_import():
    private = "from labkit.check.reference import check_step"
    assert wrong_imports(private) == [private]
    assert wrong_imports("s = '''\nfrom labkit.schedules.table import SCHEDULES\n'''")  # rank code sent as a string
    assert wrong_imports("labkit.notebook.helpers.setup()") == ["labkit.notebook.helpers"]
    assert wrong_imports("import labkit\nfrom labkit import check_step, versions\nlabkit.notebook.setup()") == []


def export_homes(init: Path) -> dict[str, str]:
    """{absolute home module: package} of the `_exports(__name__, {...})` call in a package's __init__."""
    package = "labkit" if init.parent == PKG else "labkit." + ".".join(init.parent.relative_to(PKG).parts)
    homes = {}
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_exports" and len(node.args) == 2:
            for home in ast.literal_eval(node.args[1]):
                homes[importlib.util.resolve_name(home if home != "." else ".", package)] = package
    return homes


def test_re_exports_point_down_the_layers():
    wrong = []
    for init in sorted(PKG.rglob("__init__.py")):
        for home, package in export_homes(init).items():
            if package == "labkit":
                continue  # the top level is the last layer
            (mine, my_unit), (theirs, their_unit) = layer_of(package), layer_of(home)
            if their_unit != my_unit and theirs >= mine:
                wrong.append(f"{package} re-exports from {home}")
    assert not wrong, wrong


def test_import_labkit_stays_light_and_names_survive_their_submodules():
    code = ("import sys, labkit; print(sorted(m for m in sys.modules if m.startswith(('labkit', 'torch'))))\n"
            "import labkit.theory.search, labkit.theory.frontier, labkit.models.balance, inspect\n"
            "from labkit.theory import search, frontier\nfrom labkit.models import balance\n"
            "print(all(inspect.isfunction(f) for f in (search, frontier, balance)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["['labkit', 'labkit.core', 'labkit.core.startup']", "True"], out.stdout
