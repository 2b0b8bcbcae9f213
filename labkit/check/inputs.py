"""What each stage received, per microbatch, against the reference's cut of the whole batch: the first
place a failed check names when a stage was fed the wrong thing (labkit.spans.received keeps a
fingerprint of every forward's inputs and output on the stage during the step).

    stage 0's input for microbatch i   against the whole batch x cut into microbatches (its i-th part)
    stage k's activation for i (k > 0) against what stage k - 1 returned for i (what it sent)
    a kwarg `name` on any stage, for i   against the check's kwargs[name] cut as the step cuts it

A part that differs is named with the microbatch whose part it is when it is one ("stage 2 received, as
microbatch 1's `pad_mask`, microbatch 0's cut"), else as no microbatch's. The comparisons are of the
same bytes (data, or what one stage sent and the next received), so they are exact up to the order of a
float64 sum: no float noise to measure. They only place a failure; the verdict stays the figures'.

May import: torch, labkit.spans (received), labkit.check.noise."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..spans import received
from .noise import chunk_kwargs

RTOL = 1e-9


def gather(stages, group=None) -> dict:
    """Collective over the pipeline: every rank's record, {stage index: {microbatch: record}}."""
    mine = received.of_stages(stages)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {k: v for rec in everyone for k, v in rec.items()}


def same(a, b) -> bool:
    """Two fingerprints of the same value (a tensor's shape, dtype and sums; a non-tensor's repr)."""
    if a is None or b is None or a[0] != b[0]:
        return False
    if a[0] != "tensor":
        return a == b
    if a[1] != b[1]:
        return False
    x, y = a[3].double().cpu(), b[3].double().cpu()
    scale = float(torch.maximum(x.abs(), y.abs()).max()) if x.numel() else 0.0
    return bool(x.shape == y.shape and ((x - y).abs() <= RTOL * max(scale, 1e-300)).all())


def findings(rec: dict, x, kwargs: dict | None, n_microbatches: int, chunk_dim: int = 0) -> tuple[list[str], set]:
    """Sentences for the stages that received a part other than the reference's, and those stages' indices."""
    m = n_microbatches
    said, stages = [], set()
    if not rec:
        return said, stages
    size = x.shape[chunk_dim] if torch.is_tensor(x) and x.dim() > chunk_dim else 0
    x_parts = [received.on_host(received.fingerprint(p)) for p in x.chunk(m, dim=chunk_dim)] \
        if torch.is_tensor(x) and size >= m else []
    kw_parts = chunk_kwargs(kwargs or {}, size, m, chunk_dim) if kwargs else []
    kw_fps = {name: [received.on_host(received.fingerprint(p[name])) for p in kw_parts] for name in (kwargs or {})}
    for k in sorted(rec):
        got = rec[k]
        if any(i not in got for i in range(m)):
            continue  # not this step's record (a step with another microbatch count): nothing to say
        if k == 0:
            refs = x_parts
            what = "input (its cut of the whole batch)"
        else:
            prev = rec.get(k - 1)
            refs = [prev[i]["out"] for i in range(m)] if prev and all(i in prev for i in range(m)) else []
            what = f"activation (what stage {k - 1} sent)"
        if refs:
            s = _wrong(k, [got[i]["args"][0] if got[i]["args"] else None for i in range(m)], refs, what)
            if s:
                said.append(s)
                stages.add(k)
        for name, refs in kw_fps.items():
            parts = [got[i]["kwargs"].get(name) for i in range(m)]
            if all(p is None for p in parts):
                continue
            s = _wrong(k, parts, refs, f"`{name}`")
            if s:
                said.append(s)
                stages.add(k)
    return said, stages


def _wrong(k: int, parts: list, refs: list, what: str) -> str:
    """One stage's parts of one input against the reference's: '' when each is its own microbatch's."""
    moved, foreign = [], []
    for i, p in enumerate(parts):
        if p is None or same(p, refs[i]):
            continue
        j = next((j for j, r in enumerate(refs) if same(p, r)), None)
        (moved if j is not None else foreign).append((i, j))
    if not moved and not foreign:
        return ""
    out = []
    if moved:
        i, j = moved[0]
        more = "".join(f", {a} got {b}'s" for a, b in moved[1:4]) + (" and more" if len(moved) > 4 else "")
        out.append(f"stage {k} received another microbatch's {what}: microbatch {i} got microbatch {j}'s{more}")
    if foreign:
        which = ", ".join(str(i) for i, _ in foreign[:6]) + (" and more" if len(foreign) > 6 else "")
        shape = _shape_note(parts[foreign[0][0]], refs[foreign[0][0]])
        out.append(f"stage {k}'s {what} for microbatch{'es' if len(foreign) > 1 else ''} {which} "
                   f"{'are' if len(foreign) > 1 else 'is'} no microbatch's{shape}")
    return "; ".join(out)


def _shape_note(a, b) -> str:
    if a and b and a[0] == b[0] == "tensor" and a[1] != b[1]:
        return f" (shape {list(a[1])} against {list(b[1])})"
    return ""
