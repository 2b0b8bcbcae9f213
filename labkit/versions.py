"""The versions the kit supports (torch and every other dependency), what each newer torch added, and
the one workaround it applies.

Supported and tested: torch 2.11 through 2.15. `RANGES` declares the range of every dependency in
pyproject.toml: its floor (pyproject.toml's and environment.yml's `>=`, None where they give none)
and the newest release tested (the main lock's). `dev.py test` covers both ends: its first leg runs
the whole suite on the main lock (requirements/lab-torch2.15.txt: the newest of everything), its
second leg the reference runs, the log parser and every notebook on the floors lock
(requirements/lab-torch2.11.txt: torch 2.11 and every package that has a floor at that floor, e.g.
transformers 5.23). tests/test_environment.py keeps these ranges, pyproject.toml and the two locks
in step; `labkit doctor` checks the installed packages against them (`range_problem`). What a lesson
shows only on the torch versions that have it is listed in `FEATURES`; a notebook cell asks
`has(...)` and says so. A lesson that depends on another package's release asks for its version
itself and says what holds on each (notebook 11: transformers 5.23 and 5.24).

The workaround (torch < 2.15, `apply_workarounds`, called by `worker.init_distributed`, so by every
process the kit starts): before a multi-stage schedule's first step, torch 2.11 posts one warm-up
send and receive between every pair of neighbouring stages, also when both stages live on the same
rank, as in the V placement of ZBVZeroBubble and DualPipeV (rank 1 holds stages 1 and 2). gloo has
no connection from a rank to itself, so the first step died with 'Pair is not connected'. The patch
drops the warm-ups a rank would send to itself (they carry a dummy scalar; the runtime already moves
tensors between two stages of one rank without sending them). torch 2.13 replaced that warm-up for
`PipelineStage` (a vote that knows its own rank), but 2.13 and 2.14 keep it for the tracer's stages
(`pipe.build_stage`): a traced model with several stages on one rank (`--nproc 1 --split tracer`)
died the same way there (seen on 2.14.1 with traced BERT and Llama). torch 2.15 removed it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """The supported releases of one dependency. Versions are compared at the precision written:
    "2.15" admits every 2.15.x (a patch release of a tested minor counts as tested)."""

    name: str
    """The distribution's name, as pip knows it."""
    floor: str | None
    """The oldest supported release: pyproject.toml's `>=` (the floors lock pins it, and dev.py test's
    second leg runs on it); None where pyproject.toml gives no floor (no lower end is tested)."""
    newest: str
    """The newest release tested: (major.minor of) the main lock's pin, the first leg of dev.py test."""
    needed_by: str
    """What in the lab needs it (said when it is missing or out of range)."""


RANGES = {r.name: r for r in (
    Range("torch", "2.11", "2.15", "everything"),
    Range("transformers", "5.23", "5.24", "notebook 11 and `labkit run --model` (the models extra)"),
    Range("ortools", "9.15.6755", "9.15", "the exact schedule search (`labkit search --time-limit`; the search extra)"),
    Range("numpy", None, "2.5", "the kit"),
    Range("matplotlib", None, "3.11", "every plot"),
    Range("psutil", None, "7.2", "the launcher"),
    Range("jupyterlab", None, "4.6", "the lab"),
    Range("ipywidgets", None, "8.1", "the explorers"),
    Range("ipykernel", None, "7.4", "the lab"),
    Range("latex2mathml", None, "3.81", "the handouts"),
    Range("pytest", None, "9.2", "the tests"),
    Range("pytest-xdist", None, "3.8", "the tests' parallel workers (dev.py test)"),
    Range("nbval", None, "0.11", "the notebooks' tests"),
    Range("playwright", None, "1.65", "the browser tests"),
)}
"""Every dependency in pyproject.toml (extras included), with its supported range."""

SUPPORTED = tuple(tuple(int(x) for x in v.split(".")) for v in (RANGES["torch"].floor, RANGES["torch"].newest))
"""The oldest and newest (major, minor) torch the kit is tested on (RANGES["torch"])."""

FEATURES = {
    "pre-split microbatches": ((2, 14), "schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)"),
    "activation liveness": ((2, 15), "torch.distributed.pipelining.analyze_pipeline_activation_liveness"),
    "WAIT actions": ((2, 15), "the runtime's WAIT_SEND_F, WAIT_SEND_B and WAIT_REDUCE_GRAD actions"),
    "deferred FSDP gradients": ((2, 15), "schedule.step(..., finalize_gradients=False): FSDP stages keep their "
                                         "gradients unreduced and parameters gathered until a step with True"),
}
"""What a torch version added that a lesson shows: name -> (first version, what it is)."""

SELF_P2P_FIXED = (2, 15)
"""From this torch on, no stage posts a warm-up send to its own rank (see the module docstring)."""


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.15.0+cu132'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def installed() -> tuple[int, int]:
    """(major, minor) of the installed torch."""
    import torch

    return parse(torch.__version__)


def text(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def has(feature: str) -> bool:
    """Whether the installed torch has `feature` (a key of FEATURES)."""
    if feature not in FEATURES:
        raise KeyError(f"Unknown feature {feature!r}; the kit knows {', '.join(FEATURES)}.")
    return installed() >= FEATURES[feature][0]


def release(version: str) -> tuple[int, ...]:
    """The numbers of a release: '2.15.0+cu132' -> (2, 15, 0), '5.24.0rc1' -> (5, 24, 0)."""
    return tuple(int(re.match(r"\d+", part).group()) for part in version.split("+")[0].split(".")
                 if re.match(r"\d+", part))


def range_problem(name: str, version: str) -> tuple[str, str] | None:
    """None for a release of `name` (a key of RANGES) inside its range, else ("older", message) (below
    the floor: a problem, with the pip command that fixes it) or ("newer", message) (past the newest
    tested: a warning, it may work)."""
    r = RANGES[name]
    have = release(version)
    tested = f"{r.floor} to {r.newest}" if r.floor else f"up to {r.newest}"
    if r.floor and have[:len(release(r.floor))] < release(r.floor):
        return "older", (f"{name} {version} is older than {r.floor}, the oldest the kit supports: "
                         f"pip install '{name}>={r.floor}' (the kit is tested on {tested})")
    if have[:len(release(r.newest))] > release(r.newest):
        return "newer", (f"{name} {version} is newer than {r.newest}, the newest the kit was tested on: it may "
                         f"work; if a notebook disagrees, pip install '{name}=={r.newest}.*'")
    return None


def support_problem(version: str) -> str | None:
    """None for a torch in the supported range, else what is wrong and how to fix it."""
    found = range_problem("torch", version)
    return found[1] if found else None


def drop_self_p2p(ops: list, group_rank: int) -> list:
    """The warm-up ops (`dist.P2POp`) without those whose peer is this rank itself (ranks in the
    pipeline's group, as `op.group_peer` and the stage's `group_rank` are)."""
    return [op for op in ops if op.group_peer != group_rank]


@functools.cache
def apply_workarounds() -> list[str]:
    """Patch the installed torch where the kit needs it (see the module docstring); the names of the
    patches applied. Idempotent; does nothing on torch >= 2.15."""
    if installed() >= SELF_P2P_FIXED:
        return []
    from torch.distributed.pipelining import stage as pp_stage

    base = pp_stage._PipelineStageBase
    original = getattr(base, "_get_init_p2p_neighbors_ops", None)
    if original is None:
        return []

    @functools.wraps(original)
    def without_self(self):
        return drop_self_p2p(original(self), self.group_rank)

    base._get_init_p2p_neighbors_ops = without_self
    return ["no warm-up send of a rank to itself (V schedules on gloo with torch < 2.13, traced stages "
            "sharing a rank with torch < 2.15)"]
