"""What the notebooks import: one setup call, and deterministic views of runs for nbval.

`setup()` is the first cell of every notebook (seeds, print options, PNG figures, quiet warnings),
as fastbook's `setup_book()`. `tree(run_dir)`, `facts(run)`, `pipe_summary(pipe)` and the readers of
a hung job's stacks (`rank_locations`, `stack_frames`) print what does not change from run to run
(file names, statuses, counts, rounded ratios, file:line without folders), so those cells can be
compared by nbval. `solution(notebook, name)` loads an exercise's reference answer from the
`solutions/` folder next to the notebook. Taught along the way in notebooks 00-09.

The notebooks also import order and memory helpers from here; their owners are `labkit.schedules.orders`
(notebooks 04, 05, 08) and `labkit.worker.memory` (notebooks 01, 02, 04), and `shown` (a command, a log
tail or a path without this machine's folders: `labkit.core.shown`; notebooks 00, 02, 09, 12).
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import warnings
from pathlib import Path

from ..core.shown import shown
from ..launching.diagnose import parse_frames
from ..worker.memory import param_groups, saved_activation_bytes
from ..schedules.orders import format_order, order_csv, peak_in_flight, rank_orders, torch_actions

__all__ = [
    "setup", "default_device", "pick_preset", "tree", "facts", "solution", "compress_names", "pipe_summary",
    "rank_locations", "stack_frames", "wrapped",
    # owned by labkit.schedules.orders and labkit.worker.memory, imported from here by the notebooks
    "format_order", "order_csv", "peak_in_flight", "rank_orders", "torch_actions", "param_groups",
    "saved_activation_bytes", "shown",
]


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
    from ..doctor import doctor

    report = doctor()
    return {"device": report["default_device"], "gpus": report["gpus"], "torch": report["packages"]["torch"]}


def wrapped(text: str, width: int = 110, indent: str = "  ") -> str:
    """A long sentence of the kit's (a verdict, a slowdown's explanation) as lines of at most `width`
    characters, each line of `text` wrapped on its own and continued with `indent`, so a stored output
    reads on a page (notebooks 06b, 11, 14: their test holds every stored line to 160 characters)."""
    import textwrap

    return "\n".join(textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False) or line
                     for line in str(text).splitlines())


def default_device() -> str:
    """`cuda` when this machine has a GPU, else `cpu` (the notebooks pick bigger presets on GPUs)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


_VOLATILE = re.compile(r"^[0-9a-f]{8}-[0-9a-f-]{27}.*$|^labkit-.*_[a-z0-9_]{8}$")  # torchrun: mkdtemp suffix, [a-z0-9_]


def tree(run_dir: str | os.PathLike, max_depth: int = 5) -> str:
    """The run directory as an indented tree, with torchrun's random ids shown as `<id>`."""
    root = Path(run_dir)
    name = root.name
    if name[:8].isdigit():  # runs/<stamp>-<time>-<name>-<hex>: show only <name>
        name = re.sub(r"-[0-9a-f]{6}$", "", name.split("-", 2)[-1])
    lines = [f"{name}/"]

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


def solution(notebook: str, name: str):
    """The reference answer `name` of an exercise, from `solutions/<notebook>.py` next to the running notebook.

    An exercise cell checks what you wrote; left as None, it checks this reference answer instead,
    so CI runs every check. Look at the file only after trying. Only the notebook's own folder (the
    kernel's working directory) is searched: an installed kit never reads a repository's folders.
    """
    path = Path.cwd() / "solutions" / f"{notebook}.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"No {path}: the reference answers live in a solutions/ folder next to the notebooks "
            f"(notebooks/solutions/ in the repository). Start the notebook from its own folder (JupyterLab "
            f"and nbval do), or copy that solutions/ folder into {Path.cwd()}.")
    spec = importlib.util.spec_from_file_location(f"solutions_{notebook}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


# --------------------------------------------------------------------------------------------------
# Stages, Pipes and failed runs, shown deterministically (notebooks 01, 02 and 09)

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def compress_names(names) -> list[str]:
    """`["layers.0", "layers.1", "layers.2", "norm"]` -> `["layers.0-2", "norm"]` (runs of consecutive indices)."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # (prefix, first, last)

    def flush():
        if run is not None:
            prefix, first, last = run
            out.append(f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}")

    for name in names:
        m = _NUMBERED.match(name)
        if m and "." in name:
            prefix, i = m.group(1), int(m.group(2))
            if run is not None and run[0] == prefix and i == run[2] + 1:
                run = (prefix, run[1], i)
                continue
            flush()
            run = (prefix, i, i)
            continue
        flush()
        run = None
        out.append(name)
    flush()
    return out


def pipe_summary(pipe) -> str:
    """One line per stage of a `Pipe` (from `pipeline()`): the blocks whose parameters it holds, and how many
    parameter elements. Deterministic, unlike `print(pipe)` (notebook 02)."""
    lines = []
    for i in range(pipe.num_stages):
        groups = param_groups(pipe.get_stage_module(i))
        blocks = ", ".join(compress_names(groups)) or "(no parameters)"
        lines.append(f"stage {i}: {blocks}  [{sum(groups.values()):,} parameter elements]")
    return "\n".join(lines)


_RANK_WHERE = re.compile(r"^\s*rank (\d+): (.+?):(\d+) in (\S+)", re.M)


def rank_locations(run_or_text) -> dict[int, str]:
    """Where each rank was when a timed-out job was stopped, as `{rank: "hang.py:26 in load_next_batch"}`.

    Reads the `rank N: FILE:LINE in FUNCTION` lines of a timed-out `Run`'s error (or of that text);
    file names without their folders, so the result does not depend on where the repository lives.
    """
    text = run_or_text if isinstance(run_or_text, str) else (run_or_text.error or "")
    return {int(r): f"{Path(f).name}:{line} in {func}" for r, f, line, func in _RANK_WHERE.findall(text)}



_RANK_HEADER = re.compile(r"^=== rank (\d+) ===")  # how diagnose.stack_report heads each rank in stacks.txt


def _current_threads(stacks_text: str) -> dict[int, str]:
    """Each rank's current-thread part of a `stacks.txt`: faulthandler dumps every thread, and the
    current one is where the rank was (from its `Current thread` line to the next `Thread` line)."""
    out: dict[int, list[str]] = {}
    rank, keep = None, False
    for line in stacks_text.splitlines():
        m = _RANK_HEADER.match(line)
        if m:
            rank, keep = int(m.group(1)), False
            out[rank] = []
        elif line.startswith(("Current thread", "Thread ")):
            keep = line.startswith("Current thread")
        elif keep and rank is not None:
            out[rank].append(line)
    return {r: "\n".join(lines) for r, lines in out.items()}


def stack_frames(stacks_text: str, file_contains: str | None = None) -> dict[int, list[str]]:
    """Each rank's current-thread frames from a `stacks.txt` (innermost first), as `"hang.py:26 in load_next_batch"`.

    Frames are read by the launcher's own parser (`labkit.launching.diagnose.parse_frames`).
    `file_contains` keeps only frames whose file name contains it (e.g. your script's name), which
    leaves out torch's own frames and their version-dependent line numbers (notebook 09).
    """
    out: dict[int, list[str]] = {}
    for rank, text in _current_threads(stacks_text).items():
        names = ((Path(f).name, line, func) for f, line, func in parse_frames(text))
        out[rank] = [f"{name}:{line} in {func}" for name, line, func in names
                     if file_contains is None or file_contains in name]
    return out
