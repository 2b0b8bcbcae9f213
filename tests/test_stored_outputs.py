"""No notebook's stored output holds a machine path (issue 42): a learner opening a notebook sees
`python`, `<site-packages>/`, `runs/...`, not the author's checkout, home, temporary folder or
virtual environment. The kit prints paths through `labkit.core.shown`; these tests hold every stored
output of notebooks/*.ipynb (compared by nbval or not: a learner reads both) and `shown` itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from labkit.core.shown import shown

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

# an absolute folder of some machine, an installed package's folder, or a virtual environment
MACHINE_PATH = re.compile(r"(?<![\w.<>-])/(?:work|tmp|home|root|Users|private/var)/"
                          r"|(?<!<)\b(?:site|dist)-packages\b|(?<![\w-])\.venv\b")


def _texts(output: dict):
    if "text" in output:
        yield "".join(output["text"])
    for kind, value in output.get("data", {}).items():
        if kind.startswith("text/") or kind.endswith("json"):
            yield "".join(value) if isinstance(value, list) else json.dumps(value)
    if "traceback" in output:
        yield "\n".join(output["traceback"])


def machine_paths(notebook: Path) -> list[str]:
    """'cell N: line' for every line of a stored output that holds a machine path."""
    found = []
    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for output in cell.get("outputs", []):
            for text in _texts(output):
                found += [f"cell {i}: {line.strip()[:160]}" for line in text.splitlines() if MACHINE_PATH.search(line)]
    return found


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_stored_output_holds_a_machine_path(notebook):
    found = machine_paths(notebook)
    assert not found, (f"{notebook.name}: stored outputs hold this machine's paths; print them through "
                       f"labkit.notebook.helpers.shown (labkit.core.shown) and store the outputs again:\n  "
                       + "\n  ".join(found))


def test_the_check_finds_what_the_issue_saw(tmp_path):
    nb = {"cells": [{"cell_type": "code", "source": [], "outputs": [
        {"output_type": "stream", "name": "stdout", "text": ["/tmp/v215/bin/python3 -m torch.distributed.run\n"]},
        {"output_type": "stream", "name": "stdout", "text": ["run dir: /work/main/notebooks/runs/x\n"]},
        {"output_type": "stream", "name": "stdout", "text": ["File \"<site-packages>/torch/x.py\", runs/y\n"]}]}]}
    p = tmp_path / "x.ipynb"
    p.write_text(json.dumps(nb))
    assert [f.split(":")[0] for f in machine_paths(p)] == ["cell 0", "cell 0"]


def test_shown_cuts_this_machines_folders(tmp_path, monkeypatch):
    checkout = Path(__file__).resolve().parents[1]
    here = checkout / "notebooks"
    text = "\n".join([
        f"Command: /somewhere/.venv/bin/python3.11 -m torch.distributed.run --log-dir runs/r/logs {here}/scripts_09/hang.py",
        '  File "/x/.venv/lib/python3.11/site-packages/torch/distributed/pipelining/stage.py", line 3',
        f'  File "{checkout}/labkit/spans/record.py", line 278, in wrapper',
        f"run dir: {here}/runs/20261124-193415-ranks-cd8a0f",
        "    # File: /tmp/ipykernel_6182/889793550.py:9 in forward",
        "/tmp/pplab-live-flffgnc0/ckpt",
        f"{here} and {checkout}",
    ])
    assert shown(text, cwd=here).splitlines() == [
        "Command: python -m torch.distributed.run --log-dir runs/r/logs scripts_09/hang.py",
        '  File "<site-packages>/torch/distributed/pipelining/stage.py", line 3',
        '  File "../labkit/spans/record.py", line 278, in wrapper',
        "run dir: runs/20261124-193415-ranks-cd8a0f",
        "    # File: <cell>:9 in forward",
        "<tmp>/pplab-live-flffgnc0/ckpt",
        ". and ..",
    ]
    assert shown(Path(here) / "runs", cwd=here) == "runs"
    assert shown("/elsewhere/notebooksX/y and runs/z", cwd=here) == "/elsewhere/notebooksX/y and runs/z"
    assert not MACHINE_PATH.search(shown(text, cwd=here))


def test_launch_errors_and_pool_status_show_no_machine_path(tmp_path, monkeypatch):
    from labkit.launching.diagnose import error_message
    from labkit.launching.rundir import Run
    from labkit.ranks.magics import status_text

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "20261125-204957-hang-ccb578"
    run_dir.mkdir(parents=True)
    (run_dir / "launcher.log").write_text('  File "/x/.venv/lib/python3.11/site-packages/torch/run.py", line 9\n')
    run = Run(run_dir, ["/x/.venv/bin/python", "-m", "torch.distributed.run", str(tmp_path / "hang.py")], 2,
              status="failed")
    msg = error_message(run, f"The job failed: {tmp_path}/hang.py:38 in main")
    assert "Command: python -m torch.distributed.run hang.py" in msg and "hang.py:38 in main" in msg
    assert "Run directory: runs/20261125-204957-hang-ccb578" in msg and "<site-packages>/torch/run.py" in msg
    assert not MACHINE_PATH.search(msg), msg
    st = {"running": True, "nproc": 1, "device": "cpu", "backend": "gloo", "run_dir": str(run_dir), "cells_run": 0,
          "restarts": 0, "ranks": []}
    assert "run dir: runs/20261125-204957-hang-ccb578" in status_text(st)
