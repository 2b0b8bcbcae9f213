"""One home for torch's internals: `labkit/versions/` owns every use of torch's private API and every
difference between torch releases, each behind a named function that says which releases it covers.
No other module of the kit imports a private torch name, reaches a private attribute of a torch
module, or probes a torch module for what it has. Run on both ends of the supported range."""

import ast
import re
from pathlib import Path

import labkit
from labkit import versions

PKG = Path(labkit.__file__).parent
HOME = PKG / "versions" / "__init__.py"  # its facts.py (the release table) holds data only, checked as any module


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _torch_aliases(tree: ast.AST) -> set[str]:
    """The local names a file binds to torch modules (`import torch`, `import torch.x as y`,
    `from torch.distributed import pipelining`, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names if a.name[:1].islower()}
    return names


def private_torch_uses(path: Path, root: Path = PKG.parent) -> list[str]:
    """Where a file imports a private torch name or module, or reaches a private attribute through a
    name bound to a torch module (`torch._C`, `schedules._batch_p2p`); paths relative to `root`."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            if _private(node.module) or any(_private(a.name) for a in node.names):
                found.append(f"{where}:{node.lineno} from {node.module} import "
                             f"{', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and _private(a.name)]
    aliases = _torch_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_but_the_home_uses_a_private_torch_name():
    wrong = [use for f in sorted(PKG.rglob("*.py")) if f != HOME for use in private_torch_uses(f)]
    assert not wrong, "torch's private API belongs in labkit/versions/, behind a named function:\n" + "\n".join(wrong)


def test_the_check_sees_what_it_looks_for(tmp_path):
    f = tmp_path / "example.py"
    f.write_text("import torch\nfrom torch.distributed.pipelining import schedules\n"
                 "from torch.distributed.pipelining.schedules import _PipelineSchedule\n"
                 "import torch._dynamo\nfrom torch._C import _distributed_c10d\n"
                 "x = schedules._batch_p2p\ny = torch._C\nz = torch.float32\nw = object()._stages\n")
    uses = private_torch_uses(f, root=tmp_path)
    assert len(uses) == 5, uses
    assert not any("float32" in u or "_stages" in u for u in uses)


MODULE_INTERNALS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_backward_hooks", "_state_dict_hooks")


def test_no_module_reaches_into_nn_modules_private_dicts():
    """nn.Module's own dicts (`_parameters`, `_modules`...) are torch's internals too: the kit goes
    through register_parameter, named_children, get_submodule, delattr (models/hf.py did not)."""
    wrong = [f"{f.relative_to(PKG.parent)}:{node.lineno} {ast.unparse(node)}"
             for f in sorted(PKG.rglob("*.py")) if f != HOME
             for node in ast.walk(ast.parse(f.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in MODULE_INTERNALS]
    assert not wrong, "use nn.Module's public methods (or a named function in labkit/versions/):\n" + "\n".join(wrong)


def test_no_module_but_the_home_probes_a_torch_module_for_what_it_has():
    """`hasattr` / `getattr` on a torch module (a feature probe) goes through labkit.versions (`has`,
    `schedule_class`, ...). `getattr(torch, "bfloat16")`, a dtype by name, is not a probe."""
    wrong = []
    for f in sorted(PKG.rglob("*.py")):
        if f == HOME:
            continue
        tree = ast.parse(f.read_text())
        aliases = _torch_aliases(tree) - {"torch"}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                    and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases):
                wrong.append(f"{f.relative_to(PKG.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not wrong, "feature probes on torch belong in labkit/versions/:\n" + "\n".join(wrong)


def _touches_torch(fn: ast.FunctionDef, touching: set[str]) -> bool:
    """A function of the home that imports torch, names something private, or calls one that does."""
    body = fn.body[1:] if ast.get_docstring(fn) else fn.body
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] == "torch" for m in mods):
                return True
        if isinstance(node, ast.Attribute) and _private(node.attr):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"_[a-z]\w*", node.value):
            return True
        if isinstance(node, ast.Name) and node.id in touching:
            return True
    return False


def test_each_function_of_the_home_that_touches_torch_says_which_releases_it_covers():
    functions = [n for n in ast.parse(HOME.read_text()).body if isinstance(n, ast.FunctionDef)]
    touching: set[str] = set()
    for _ in range(3):  # calls of calls
        touching |= {fn.name for fn in functions if _touches_torch(fn, touching)}
    assert {"apply_workarounds", "stage_base_class", "runtime_with_order", "planning_stages", "wrap_p2p",
            "schedule_state"} <= touching, touching
    low, high = versions.SUPPORTED
    for fn in functions:
        if fn.name not in touching:
            continue
        doc = ast.get_docstring(fn) or ""
        stated = [(2, int(m)) for m in re.findall(r"torch 2\.(\d+)", " ".join(doc.split()))]
        assert stated, f"versions.{fn.name}: its docstring says which torch releases it covers ('torch 2.11 to 2.15')"
        assert all(low <= v <= high for v in stated), f"versions.{fn.name} names a release outside {low}..{high}"


# ---- the named functions against the installed torch ----
def test_planning_stages_let_torch_plan_and_the_state_reads_back():
    from labkit.theory.plans import mock_schedule

    multi = mock_schedule("Interleaved1F1B", 2, 4, 2)
    assert versions.is_schedule(multi) and not versions.is_schedule(object())
    m, stages = versions.schedule_state(multi)
    assert m == 4 and [s.stage_index for s in stages] == [0, 2]
    m, stages = versions.schedule_state(mock_schedule("1F1B", 2, 4))
    assert m == 4 and [s.stage_index for s in stages] == [0]
    assert versions.schedule_state(object()) == (None, [])


def test_the_runtime_loads_an_order_from_its_csv(tmp_path):
    from labkit.schedules.orders import order_csv

    order = {0: [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)],
             1: [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)]}
    path = tmp_path / "order.csv"
    path.write_text(order_csv(order))
    runtime = versions.runtime_with_order(versions.planning_stages([0], 2, 2), 2, path)
    assert versions.is_schedule(runtime) and type(runtime).__name__ == versions.RUNTIME.rpartition(".")[2]
    assert str(runtime.pipeline_order[0][0]) == "0F0"


def test_every_schedule_the_kit_names_is_in_this_torch():
    from labkit.schedules.table import SCHEDULES

    for info in SCHEDULES.values():
        cls = versions.schedule_class(info.cls)
        assert cls is not None and cls in versions.schedule_classes(), info.cls
        assert versions.accepts_kwargs_chunk_spec(cls) == (info.cls != "ScheduleLoopedBFS"), info.cls
    assert versions.schedule_class("ScheduleTeleport") is None
    assert set(versions.stage_reduce_grad_methods()) >= {"perform_reduce_grad"}
    # start_gradient_reduction / wait_for_gradient_reduction run the REDUCE_GRAD / WAIT_REDUCE_GRAD actions
    assert ("start_gradient_reduction" in versions.stage_reduce_grad_methods()) == versions.has("WAIT actions")
