"""Distributed checkpoints of a pipelined run (torch.distributed.checkpoint, DCP), and clipping.

- `save(stages, dir)`: every rank contributes its stages' state (parameters under the unsplit
  model's names: the manual split keeps them), as plain tensors or DTensor shards (FSDP2, TP). DCP
  writes each tensor once: replicated copies (data-parallel replicas without FSDP, TP-replicated
  layers) are deduplicated, shards are written by their owners. So the checkpoint holds every
  parameter of the unsplit model exactly once, whatever shape saved it.
- `load_stages(stages, dir)`: loads into this rank's stages in place, whatever shape they have now
  (another pp size, stages per rank, with or without FSDP or TP): DCP reads the slices each tensor
  needs (resharding on load).
- `load_full(model, dir)`: the unsplit model from the same checkpoint (the check's reference).
- `clip_grad_norm(stages, max_norm, par)`: gradient-norm clipping over the whole mesh: each
  parameter's squared norm once (DTensor shards summed over their mesh, replicated tensors counted
  once), summed over the pipeline's stages; the same factor on every rank, as the unsplit model's
  `torch.nn.utils.clip_grad_norm_` would apply.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def stage_state_dict(stages: list) -> dict:
    """This rank's stages' parameters and buffers, under the unsplit model's names."""
    out = {}
    for st in stages:
        out.update(st.submod.state_dict())
    return out


def save(stages: list, path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(stage_state_dict(stages), checkpoint_id=str(path))


def load_stages(stages: list, path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = stage_state_dict(stages)
    dcp.load(sd, checkpoint_id=str(path))  # in place: into the tensors (or shards) the stages hold


def load_full(model: torch.nn.Module, path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(path))
    model.load_state_dict(sd)


def saved_names(path) -> list[str]:
    """The tensors a checkpoint holds (its metadata), sorted."""
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _squared_norm(g) -> float:
    if hasattr(g, "full_tensor"):  # a DTensor: the local squares summed over its mesh (a collective)
        return float((g.float() * g.float()).sum().full_tensor())
    return float(g.float().pow(2).sum())


def clip_grad_norm(stages: list, max_norm: float, pp_group=None, device="cpu", copies=frozenset()) -> float:
    """Clip every gradient of the pipeline by the global norm (over all stages and shards); returns
    the norm before clipping. Collective over the job: every rank calls it.

    copies: (stage index, parameter name) of the extra copies of a tied weight (GPT-2's lm_head and
    token embedding on two stages, `TiedWeights.extra_copies`): after the tied gradients are summed
    every copy holds the same gradient, and the unsplit model has ONE parameter, so only the first
    copy counts in the norm; every copy is scaled."""
    params = [p for st in stages for p in st.submod.parameters() if p.grad is not None]
    counted = [p for st in stages for n, p in st.submod.named_parameters()
               if p.grad is not None and (st.stage_index, n) not in copies]
    local = sum(_squared_norm(p.grad) for p in counted)
    t = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=pp_group)  # the stages of this pipeline
    total = math.sqrt(float(t[0]))
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for p in params:
            p.grad.mul_(coef)
    return total
