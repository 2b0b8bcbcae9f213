"""The torch versions the kit supports, what each newer one added, and the one workaround it applies.

Supported and tested: torch 2.11 through 2.15 (the README's test command runs the whole suite on
2.15 and the reference runs, the log parser and every notebook on 2.11). What a lesson shows only
on the versions that have it is listed in `FEATURES`; a notebook cell asks `has(...)` and says so.

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

SUPPORTED = ((2, 11), (2, 15))
"""The oldest and newest (major, minor) torch the kit is tested on."""

FEATURES = {
    "pre-split microbatches": ((2, 14), "schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)"),
    "activation liveness": ((2, 15), "torch.distributed.pipelining.analyze_pipeline_activation_liveness"),
    "WAIT actions": ((2, 15), "the runtime's WAIT_SEND_F, WAIT_SEND_B and WAIT_REDUCE_GRAD actions"),
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


def support_problem(version: str) -> str | None:
    """None for a torch in the supported range, else what is wrong and how to fix it."""
    low, high = SUPPORTED
    have = parse(version)
    if have < low:
        return (f"torch {version} is older than {text(low)}, the oldest the kit supports: "
                f"pip install 'torch>={text(low)}' (the kit is tested on {text(low)} to {text(high)})")
    if have > high:
        return (f"torch {version} is newer than {text(high)}, the newest the kit was tested on: it may work; "
                f"if a notebook disagrees, pip install 'torch=={text(high)}.*'")
    return None


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
