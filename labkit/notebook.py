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


# --------------------------------------------------------------------------------------------------
# Orders and in-flight microbatches (notebooks 04, 05 and 08)


def rank_orders(timeline) -> dict[int, list[tuple[str, int, int]]]:
    """Each rank's compute actions `(kind, stage, microbatch)` in the order they ran (by start, then end).

    Comparable with `labkit.theory.planned_actions` and with an order written by hand (notebook 08):
    a measured run holds exactly the planned actions when both are equal.
    """
    out: dict[int, list[tuple[str, int, int]]] = {}
    for a in sorted(timeline.compute(), key=lambda a: (a.rank, a.start, a.end)):
        out.setdefault(a.rank, []).append((a.kind, a.stage, a.microbatch))
    return out


def peak_in_flight(order) -> dict[int, int]:
    """Per stage, the most microbatches whose activations it holds at once (notebook 04: why 1F1B exists).

    A microbatch's activations stay on a stage from its forward (F) until its last backward action
    frees them: B, or W when the backward is split (I computes the input gradient, W still needs the
    saved inputs). `order` is a Timeline or `{rank: [(kind, stage, microbatch), ...]}`; a stage's
    actions run one after another on its rank, so the order alone decides the count.
    """
    order = _as_tuples(order)
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for acts in order.values():
        for kind, stage, _mb in acts:
            if kind == "F":
                held[stage] = held.get(stage, 0) + 1
            elif kind in ("B", "W"):
                held[stage] = held.get(stage, 0) - 1
            peak[stage] = max(peak.get(stage, 0), held.get(stage, 0))
    return dict(sorted(peak.items()))


def saved_activation_bytes(module, *inputs) -> int:
    """Bytes autograd saves for the backward during one forward of `module` on `inputs`.

    That is the activation memory one microbatch holds on a stage until its backward runs.
    Storages are counted once, and the module's own parameters (saved by e.g. Linear) are left
    out: they are there whatever the schedule does. Notebook 04.
    """
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(seen.values())


def torch_actions(order) -> dict[int, list[str]]:
    """`{rank: ["0F0", "1I2", ...]}`: an order (or a Timeline) in torch's short form, stage kind microbatch."""
    return {r: [f"{s}{k}{mb}" for k, s, mb in acts] for r, acts in sorted(_as_tuples(order).items())}


_SHORT_ACTION = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


def _as_tuples(order) -> dict[int, list[tuple[str, int, int]]]:
    """A Timeline, or `{rank: [actions]}` with `(kind, stage, mb)` tuples or torch's `"0F1"` strings."""
    if hasattr(order, "compute"):
        return rank_orders(order)
    out = {}
    for r, acts in order.items():
        row = []
        for a in acts:
            if isinstance(a, str):
                m = _SHORT_ACTION.match(a.upper())
                if m is None:
                    raise ValueError(f"Cannot read action {a!r} of rank {r}: write torch's short form like '0F1' "
                                     f"(stage, kind, microbatch) or a tuple ('F', 0, 1).")
                a = (m.group(2), int(m.group(1)), int(m.group(3)))
            row.append(tuple(a))
        out[r] = row
    return out


def format_order(order) -> str:
    """One line per rank, as torch writes actions: `rank 0: 0F0 0F1 0B0 ...` (order or Timeline)."""
    return "\n".join(f"rank {r}: " + " ".join(acts) for r, acts in torch_actions(order).items())


def order_csv(order) -> str:
    """The CSV torch's `_PipelineScheduleRuntime._load_csv` reads: one row per rank (notebook 08)."""
    return "".join(",".join(acts) + "\n" for acts in torch_actions(order).values())


def solution(notebook: str, name: str):
    """The reference answer `name` of an exercise, from `solutions/<notebook>.py` next to the notebooks.

    An exercise cell checks what you wrote; left as None, it checks this reference answer instead,
    so CI runs every check. Look at the file only after trying.
    """
    import importlib.util

    here = Path(__file__).resolve().parent.parent / "notebooks" / "solutions"
    for folder in (Path.cwd() / "solutions", here):
        path = folder / f"{notebook}.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(f"solutions_{notebook}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return getattr(module, name)
    raise FileNotFoundError(f"No solutions/{notebook}.py next to the notebooks (looked in {Path.cwd()} and {here}).")


# --------------------------------------------------------------------------------------------------
# Stages, Pipes and failed runs, shown deterministically (notebooks 01, 02 and 09)

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def param_groups(module) -> dict[str, int]:
    """Parameter elements of `module` per owning block, in model order: `{"tok_embeddings": 2048, "layers.0": ...}`.

    A block is the first component of a parameter's name, plus the index when that component is a
    numbered container (`layers.0`); the names are those of the unsplit model, which a manual split
    and the tracer both keep (notebooks 01 and 02).
    """
    out: dict[str, int] = {}
    for name, p in module.named_parameters():
        parts = name.split(".")
        key = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
        out[key] = out.get(key, 0) + p.numel()
    return out


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


_STACK_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')


def stack_frames(stacks_text: str, file_contains: str | None = None) -> dict[int, list[str]]:
    """Each rank's current-thread frames from a `stacks.txt` (innermost first), as `"hang.py:26 in load_next_batch"`.

    `file_contains` keeps only frames whose file name contains it (e.g. your script's name), which
    leaves out torch's own frames and their version-dependent line numbers (notebook 09).
    """
    out: dict[int, list[str]] = {}
    rank = None
    in_current = False
    for line in stacks_text.splitlines():
        m = re.match(r"^=== rank (\d+) ===", line)
        if m:
            rank, in_current = int(m.group(1)), False
            out[rank] = []
            continue
        if line.startswith("Current thread"):
            in_current = True
            continue
        if line.startswith("Thread ") or not line.strip():
            in_current = False if line.startswith("Thread ") else in_current
            continue
        f = _STACK_FRAME.match(line)
        if f and rank is not None and in_current:
            name = Path(f.group(1)).name
            if file_contains is None or file_contains in name:
                out[rank].append(f"{name}:{f.group(2)} in {f.group(3)}")
    return out
