"""How the kit shows this machine's paths to a learner: `shown(text)` cuts the folders that only
this machine has, so a message, a command or a log tail reads the same on every machine (and a
notebook's stored output holds no one's home, checkout or virtual environment).

    /work/me/.venv/bin/python -m torch.distributed.run ...   ->  python -m torch.distributed.run ...
    File "/work/me/.venv/lib/python3.11/site-packages/torch/distributed/pipelining/stage.py"
        ->  File "<site-packages>/torch/distributed/pipelining/stage.py"
    /work/me/pp-lab/notebooks/runs/2026...-ranks-1a2b3c      ->  runs/2026...-ranks-1a2b3c   (from notebooks/)
    /work/me/pp-lab/labkit/spans/record.py                   ->  ../labkit/spans/record.py
    /tmp/ipykernel_6182/889793550.py                         ->  <cell>
    /tmp/x, /home/me/x                                       ->  <tmp>/x, ~/x

Display only: the files on disk (command.txt, the rank logs, stacks.txt) keep the exact paths.
The `<site-packages>/` form is the one notebooks/sanitize.cfg writes. Used by the launcher's error
messages, `%ranks status`, and notebooks 00, 02, 09, 12.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

__all__ = ["shown"]

_EDGE = r"(?<![\w./~<>-])"  # a path starts here: not inside a longer name or path
_INTERPRETER = re.compile(_EDGE + r"/[^\s'\"]*/bin/python[0-9.]*(?![\w./-])")
_SITE = re.compile(_EDGE + r"/[^\s'\"(\[=]*/(?:site|dist)-packages/")
_KERNEL_CELL = re.compile(_EDGE + r"/[^\s'\"]*/ipykernel_\d+/\d+\.py")
_CHECKOUT = Path(__file__).resolve().parents[2]  # the folder that holds labkit/ (a checkout, or site-packages)


def _prefix(folder: str, replacement: str, text: str) -> str:
    """`folder/...` -> `replacement...`, and `folder` alone -> `replacement` without its slash (or '.')."""
    folder = folder.rstrip("/")
    if not folder:
        return text
    edge = re.escape(folder)
    text = re.sub(_EDGE + edge + r"/", lambda _: replacement, text)
    return re.sub(_EDGE + edge + r"(?![\w./-])", lambda _: replacement.rstrip("/") or ".", text)


def shown(text, cwd: str | os.PathLike | None = None) -> str:
    """`text` (a str or a path) with this machine's folders cut (see the module docstring); paths
    under the current folder (`cwd`) and under the kit's checkout become relative to the current folder."""
    text = str(text)
    given = os.path.abspath(cwd if cwd is not None else os.getcwd())
    here = os.path.realpath(given)
    text = _INTERPRETER.sub("python", text)
    text = _SITE.sub("<site-packages>/", text)
    text = _KERNEL_CELL.sub("<cell>", text)
    for folder in dict.fromkeys((here, given)):  # both spellings of a folder reached through a link
        if folder != "/":
            text = _prefix(folder, "", text)
    checkout = str(_CHECKOUT)
    if checkout != "/" and here.startswith(checkout + "/") and _CHECKOUT.name != "site-packages":
        text = _prefix(checkout, os.path.relpath(checkout, here) + "/", text)  # ../labkit/... from notebooks/
    for folder, replacement in ((os.path.realpath(tempfile.gettempdir()), "<tmp>/"), ("/tmp", "<tmp>/"),
                                (os.path.expanduser("~"), "~/")):
        if folder not in ("/", ""):
            text = _prefix(folder, replacement, text)
    return text
