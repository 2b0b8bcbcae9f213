"""Named tensors sent from one rank of a check to the others as flat buffers, one broadcast per dtype, with
no pickling: the run watch sends each rank's weights at a check, and each reference's gradients from the
rank that made it (labkit.check.gradients), some MB each; `all_gather_object` pickled them, copied them
twice more and padded every rank's part to the largest (bench/RESULTS.md, "The run watch").

Where they travel: the group's backend decides (gloo: the host; nccl alone: the check's device).

May import: torch."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def layout(tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple]]:
    """What the receivers need to know to take `tensors` apart: (name, dtype, shape), names sorted (each
    process orders a set of names its own way)."""
    return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in sorted(tensors.items())]


def wire_device(group, device) -> torch.device:
    """Where a broadcast's buffer lives: the host where the group's backend carries host tensors (gloo, alone
    or beside nccl: "cpu:gloo,cuda:nccl"), else the check's device (nccl alone)."""
    return torch.device("cpu") if "gloo" in str(dist.get_backend(group)) else torch.device(device)


def share(group, src: int, meta: list[tuple[str, str, tuple]], tensors: dict[str, torch.Tensor] | None,
          device) -> dict[str, torch.Tensor]:
    """The tensors `meta` lists, rank `src`'s (its index in `group`; `tensors` there, None elsewhere), on
    every rank of the group, on `device` (`wire_device`): one broadcast per dtype, in `meta`'s order.
    Collective: every rank of the group calls it with the same `src` and `meta`."""
    me = dist.get_rank(group)
    root = dist.get_global_rank(group, src) if group is not None else src
    out: dict[str, torch.Tensor] = {}
    for dtype in sorted({d for _, d, _ in meta}):
        rows = [(n, shape) for n, d, shape in meta if d == dtype]
        sizes = [math.prod(shape) for _, shape in rows]
        if me == src:
            flat = torch.cat([tensors[n].detach().reshape(-1).to(device) for n, _ in rows])
        else:
            flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype), device=device)
        dist.broadcast(flat, src=root, group=group)
        for (n, shape), piece in zip(rows, flat.split(sizes)):
            out[n] = piece.view(shape)
    return out

