"""Helpers for the notebooks: one setup call, and deterministic views of runs for nbval.

`setup()` is the first cell of every notebook (seeds, print options, PNG figures, quiet warnings),
as fastbook's `setup_book()`. `tree(run_dir)` and `facts(run)` print what does not change from run
to run (file names, statuses, counts, rounded ratios), so those cells can be compared by nbval.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from pathlib import Path


def setup(seed: int = 0) -> dict:
    """Seeds, print options, inline PNG figures, quiet warnings; returns what the kit sees (labkit doctor)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_printoptions(precision=4, sci_mode=False)
    np.set_printoptions(precision=4, suppress=True)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            ip.run_line_magic("matplotlib", "inline")
            ip.run_line_magic("config", "InlineBackend.figure_formats = ['png']")
    except Exception:
        pass
    from .doctor import doctor

    report = doctor()
    return {"device": report["default_device"], "gpus": report["gpus"], "torch": report["packages"]["torch"]}


def default_device() -> str:
    """`cuda` when this machine has a GPU, else `cpu` (the notebooks pick bigger presets on GPUs)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_VOLATILE = re.compile(r"^[0-9a-f]{8}-[0-9a-f-]{27}.*$|^labkit-.*_[a-z0-9]{8}$")


def tree(run_dir: str | os.PathLike, max_depth: int = 5) -> str:
    """The run directory as an indented tree, with torchrun's random ids shown as `<id>`."""
    root = Path(run_dir)
    lines = [f"{root.name.split('-', 2)[-1] if root.name[:8].isdigit() else root.name}/"]

    def walk(d: Path, depth: int):
        for p in sorted(d.iterdir()):
            name = "<id>" if _VOLATILE.match(p.name) else p.name
            lines.append("  " * depth + name + ("/" if p.is_dir() else ""))
            if p.is_dir() and depth < max_depth:
                walk(p, depth + 1)

    walk(root, 1)
    return "\n".join(lines)


def facts(run) -> dict:
    """Deterministic facts of a Run (no paths, times or pids): safe to print in a tested cell."""
    return run.summary()


def pick_preset(pp_size: int = 2, cpu: str = "tiny") -> str:
    """The model preset for a lab cell: the tutorial's sizes when every rank gets its own GPU
    (nccl, `--device auto` picks cuda), else a small CPU preset (a step well under a second)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "tutorial" if gpus >= pp_size else cpu
