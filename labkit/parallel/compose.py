"""A pipeline inside a (pp, dp, tp) DeviceMesh: what `labkit run --dp-size D --tp-size T [--fsdp]` runs.

Ranks are laid out as torch's `init_device_mesh(type, (pp, dp, tp), mesh_dim_names=("pp", "dp",
"tp"))` lays them out: tp varies fastest, so the ranks of one stage's tensor-parallel group are
neighbours (on a real node: the GPUs with the fastest links), and a pipeline is the ranks that share
their (dp, tp) coordinates. Each stage is built on its pipeline's process group (`mesh["pp"]`).

- **tensor parallelism** (`tp_size`): inside each stage, every decoder layer's MLP is cut with
  DTensor plans: `linear1` by columns (`ColwiseParallel`: each rank holds a slice of the hidden
  units), `linear2` by rows (`RowwiseParallel`: partial sums, all-reduced). The activations sent
  between stages stay whole tensors. (The tutorial's attention is `nn.MultiheadAttention`, one packed
  projection: it stays replicated.)
- **data parallelism** (`dp_size`): each replica steps its own contiguous share of the global batch;
  gradients are averaged over the replicas, either by an all-reduce after the step (replicated) or
  by FSDP2 (`fully_shard` on each stage module over `mesh["dp"]`: parameters, gradients and optimizer
  state sharded; `reshard_after_forward=False`, because a stage runs several microbatches' forwards
  before their backwards and resharding would all-gather the parameters again for each one; torch's
  pipelining defers the gradient reduction to the last microbatch's backward).
- **the check**: every replica's losses and every gradient (DTensors gathered with `full_tensor()`)
  against ONE step of the unsplit model on the WHOLE global batch, cut into dp x m microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Parallel:
    mesh: object          # torch.distributed.device_mesh.DeviceMesh, dims ("pp", "dp", "tp")
    pp_rank: int
    dp_rank: int
    tp_rank: int
    dp_size: int
    tp_size: int
    fsdp: bool

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group()

    @property
    def dp_group(self):
        return self.mesh["dp"].get_group()

    def global_rank(self, pp: int, dp: int = 0, tp: int = 0) -> int:
        return int(self.mesh.mesh[pp, dp, tp].item())


def build_mesh(cfg, device: torch.device) -> Parallel:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (cfg.pp_size, cfg.dp_size, cfg.tp_size), mesh_dim_names=("pp", "dp", "tp"))
    return Parallel(mesh, mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank(),
                    cfg.dp_size, cfg.tp_size, cfg.fsdp)


def tp_plan(module: nn.Module) -> dict:
    """The tensor-parallel plan of a stage: the tutorial model's decoder layers (the MLP: linear1 by
    columns, linear2 by rows; the packed attention stays replicated), or a Llama-layout block's
    attention (q/k/v projections by columns: each rank computes heads/tp of the heads, kv heads
    too; o_proj by rows) and MLP (gate/up by columns, down by rows), as torchtitan plans Llama."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.TransformerDecoderLayer):
            plan[f"{name}.linear1"] = ColwiseParallel()
            plan[f"{name}.linear2"] = RowwiseParallel()
        elif all(hasattr(sub, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
            plan.update({f"{name}.{a}": ColwiseParallel() for a in ("q_proj", "k_proj", "v_proj")})
            plan[f"{name}.o_proj"] = RowwiseParallel()
        elif all(hasattr(sub, a) for a in ("gate_proj", "up_proj", "down_proj")):
            plan.update({f"{name}.gate_proj": ColwiseParallel(), f"{name}.up_proj": ColwiseParallel(),
                         f"{name}.down_proj": RowwiseParallel()})
    return plan


def parallelize(stages: list, par: Parallel) -> None:
    """Tensor parallelism inside each stage, then FSDP2 over the replicas (in place: the stages keep
    their modules)."""
    if par.tp_size > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        for st in stages:
            parallelize_module(st.submod, par.mesh["tp"], tp_plan(st.submod))
    if par.fsdp:
        from torch.distributed.fsdp import fully_shard

        for st in stages:
            fully_shard(st.submod, mesh=par.mesh["dp"], reshard_after_forward=False)


def replica_share(par: Parallel, *tensors):
    """This replica's contiguous share of each whole-batch tensor (batch along dim 0)."""
    out = []
    for t in tensors:
        n = t.shape[0] // par.dp_size
        out.append(t[par.dp_rank * n:(par.dp_rank + 1) * n])
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def replicated_average(par: Parallel, inner=None):
    """after_backward for replicated data parallelism: every gradient averaged over the replicas
    (an all-reduce of each rank's local part: with TP, the same slice on every replica)."""

    def after_backward(stages) -> None:
        if inner is not None:
            inner(stages)
        if par.dp_size > 1 and not par.fsdp:
            for st in stages:
                for p in st.submod.parameters():
                    if p.grad is not None:
                        g = _local(p.grad)
                        dist.all_reduce(g, group=par.dp_group)
                        g /= par.dp_size

    return after_backward


def full_grads(grads: dict) -> dict:
    """Whole gradients from DTensor shards (`full_tensor()`: a collective over the tensor's mesh,
    so every rank of a stage's dp x tp group calls it, in the same order)."""
    import logging

    from ..versions import redistribute_logger

    # 2-D shards (FSDP over TP) are gathered in two steps; torch logs a warning about it on every rank
    noisy = redistribute_logger()
    level = noisy.level
    noisy.setLevel(logging.ERROR)
    try:
        return {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in grads.items()}
    finally:
        noisy.setLevel(level)


def all_replicas_losses(par: Parallel, losses: list, n_microbatches: int, has_last: bool, device,
                        chunks: int = 1) -> list[float]:
    """Every replica's per-microbatch losses in the global batch's order: for each accumulated chunk
    (--accumulate), replica 0's microbatches, then replica 1's, ... (`n_microbatches`: this rank's
    count over all chunks)."""
    from ..worker import distributed as worker

    mine = [float(l.detach()) if torch.is_tensor(l) else float(l) for l in losses] if has_last else []
    rows = worker.all_gather_floats(mine if has_last else [0.0] * n_microbatches, device, par.dp_group)
    if not has_last:
        return []
    per = n_microbatches // chunks
    return [x for g in range(chunks) for row in rows for x in row[g * per:(g + 1) * per]]


def local_bytes(tensors) -> int:
    """Bytes this rank holds for `tensors` (a DTensor: its local shard only)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def memory_row(stages, opt, activation_peak: int) -> list[float]:
    """This rank's bytes: parameters, gradients, optimizer state (its local shards), and the most
    activation bytes its stages held at once in the step (labkit.worker.memory.SavedTensorTracker). Read
    right after the first step's backward, before the update."""
    params = [p for st in stages for p in st.submod.parameters()]
    state = [v for st in (opt.state.values() if opt is not None else []) for v in st.values() if torch.is_tensor(v)]
    return [float(local_bytes(params)), float(local_bytes(p.grad for p in params)), float(local_bytes(state)),
            float(activation_peak)]
