"""Cutting the model into pipeline stages: manual split and tracer split.

Manual (notebook 01): copy the full model and delete what a stage does not own, then wrap it
in `PipelineStage`. Tracer (notebook 02): `pipeline()` traces the whole model with torch.export,
cuts it at `SplitPoint.BEGINNING` of layer boundaries, and `Pipe.build_stage` wraps a piece.

Several stages on one rank (a V placement, `--nproc 1`): torch 2.11 to 2.14 post a warm-up send of
a rank to itself, which gloo cannot make ('Pair is not connected'); `build_stages` applies the kit's
one work-around for it first (`labkit.versions.apply_workarounds`), for manual and traced stages alike.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..config.run import RunConfig
from ..schedules.table import layer_bounds
from .shared import autocast_state, is_shared, memo, module_key


def manual_stage_module(full: nn.Module, stage: int, n_stages: int, bounds: list[int] | None = None) -> nn.Module:
    """A copy of the tutorial Transformer that keeps only `stage`'s layers (and ends)."""
    m = copy.deepcopy(full)
    n_layers = len(full.layers)
    bounds = bounds or layer_bounds(n_layers, n_stages)
    keep = set(range(bounds[stage], bounds[stage + 1]))
    for i in range(n_layers):
        if i not in keep:
            del m.layers[str(i)]
    if stage != 0:
        m.tok_embeddings = None
    if stage != n_stages - 1:
        m.norm = None
        m.output = None
    return m


def stage_input_example(cfg: RunConfig, stage: int, device) -> torch.Tensor:
    """One microbatch of what `stage` receives: tokens for stage 0, activations after that."""
    p = cfg.model
    mb = cfg.batch_size // (cfg.dp_size * cfg.n_microbatches)  # one replica's microbatch
    tokens_shape = (mb, p.seq_len)
    # batch layout: the model transposes to (seq, batch, dim); tutorial layout: no transpose
    act_shape = (p.seq_len, mb, p.dim) if cfg.layout == "batch" else (mb, p.seq_len, p.dim)
    if stage == 0:
        return torch.zeros(tokens_shape, dtype=torch.long, device=device)
    return torch.zeros(act_shape, dtype=getattr(torch, cfg.dtype), device=device)  # --dtype (autocast: below)


def build_stages(cfg: RunConfig, full: nn.Module, rank: int, device, group=None):
    """The `PipelineStage`s of `rank`, in the order the schedule expects, and how they were built."""
    from torch.distributed.pipelining import PipelineStage

    from ..versions import apply_workarounds

    apply_workarounds()  # a rank's warm-up send to itself (torch < 2.15): see the module docstring
    n = cfg.n_stages
    local = cfg.stages_of_rank(rank)
    if cfg.split == "manual":
        stages = []
        for s in local:
            mod = manual_stage_module(full, s, n, cfg.layer_bounds()).to(device)
            stages.append(PipelineStage(mod, s, n, device, input_args=stage_input_example(cfg, s, device), group=group))
        return stages, "manual: deleted layers, PipelineStage"

    pipe = trace_pipe(cfg, full, device)
    stages = [pipe.build_stage(s, device, group) for s in local]
    return stages, "tracer: pipeline(), pipe.build_stage"


def trace_pipe(cfg: RunConfig, full: nn.Module, device):
    """`pipeline()` on a copy of the full model, split at the first layer of every stage but the first.
    Inside `shared_work()` (labkit.worker.shared) a trace already made for the same model, weights,
    microbatch and cut is copied instead of traced again (torch.export: ~5 s of CPU for the tiny preset):
    every user, the first too, builds its stages from a copy; the trace itself stays untouched."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    bounds = cfg.layer_bounds()
    split_spec = {f"layers.{b}": SplitPoint.BEGINNING for b in bounds[1:-1]}
    example = stage_input_example(cfg, 0, device)

    def trace():
        return pipeline(copy.deepcopy(full).to(device), mb_args=(example,), split_spec=split_spec)

    key = _trace_key(full, example, split_spec, device) if is_shared() else None
    return trace() if key is None else copy.deepcopy(memo(key, trace))


def _trace_key(full: nn.Module, example: torch.Tensor, split_spec: dict, device) -> tuple | None:
    """What a trace depends on: the model (code, structure, every weight's bytes; None with hooks),
    the example microbatch's shape and dtype, the cut, the device, grad mode and autocast (an autocast
    trace records its casts)."""
    model = module_key(full)
    if model is None:
        return None
    return ("trace", model, tuple(example.shape), str(example.dtype), tuple(sorted(split_spec)), str(device),
            torch.is_grad_enabled(), autocast_state(device))


def make_schedule(info, stages: list, n_microbatches: int, loss_fn=None, **kwargs):
    """The torch schedule object `info` names, for these stages (`loss_fn=None`: forward only);
    `kwargs` go to its constructor (e.g. scale_grads=False)."""
    from ..versions import RANGES, schedule_class

    cls = schedule_class(info.cls)
    if cls is None:
        torch_range = RANGES["torch"]
        raise RuntimeError(f"torch {torch.__version__} has no {info.cls}; install a torch the kit supports "
                           f"({torch_range.floor} to {torch_range.newest}; `labkit doctor` checks it).")
    if info.multi:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)


def build_schedule(cfg: RunConfig, stages: list, loss_fn=None, **kwargs):
    """The schedule of a RunConfig for these stages (its --schedule-csv order when it has one)."""
    if cfg.schedule_csv:
        return runtime_from_csv(stages, cfg.n_microbatches, loss_fn, cfg.schedule_csv, **kwargs)
    return make_schedule(cfg.info, stages, cfg.n_microbatches, loss_fn, **kwargs)


def runtime_from_csv(stages: list, n_microbatches: int, loss_fn, order_csv, **kwargs):
    """torch's action runtime loaded with a compute-only order (torch adds SEND/RECV itself): the private
    route `labkit.versions.runtime_with_order` owns."""
    from ..versions import runtime_with_order

    return runtime_with_order(stages, n_microbatches, order_csv, loss_fn, **kwargs)
