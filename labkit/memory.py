"""What a stage holds in memory: its parameters, block by block, and the activations a microbatch leaves.

`param_groups` counts parameter elements per model block (which blocks a stage got from a manual
split or the tracer, notebooks 01 and 02); `saved_activation_bytes` measures what autograd keeps
for one microbatch until its backward (why 1F1B holds fewer microbatches than GPipe, notebook 04).
"""

from __future__ import annotations


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


def torch_liveness(schedule: str, pp_size: int, n_microbatches: int, stages_per_rank: int = 1) -> dict[int, int]:
    """Per rank, the activation slots torch 2.15's `analyze_pipeline_activation_liveness` says the
    schedule's plan needs: the most (stage, microbatch) activations a rank holds at once (granularity
    "stage_microbatch"). Compare with `orders.rank_peak_in_flight` of the kit's plan (notebook 04).

    Raises `ScheduleError` on a torch without the analysis (before 2.15), and passes on torch's own
    `ValueError` when it cannot read the schedule's plan (2.15 reads Schedule1F1B's last rank as
    forwarding microbatches 1..m instead of 0..m-1, notebook 04).
    """
    from torch.distributed import pipelining

    from .orders import ScheduleError
    from .theory.plans import mock_schedule

    analyze = getattr(pipelining, "analyze_pipeline_activation_liveness", None)
    if analyze is None:
        raise ScheduleError("analyze_pipeline_activation_liveness needs torch 2.15 or newer "
                            "(labkit.versions.has('activation liveness')).")
    from .config import stage_placement, schedule_info

    sched = mock_schedule(schedule, pp_size, n_microbatches, stages_per_rank)
    placement = stage_placement(pp_size, stages_per_rank, schedule_info(schedule).v_shaped)
    return {r: analyze(sched, pp_rank=r, stage_indices=placement[r], granularity="stage_microbatch").num_slots
            for r in range(pp_size)}
