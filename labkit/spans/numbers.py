"""What a step computed, for its `end_step` line in the spans (`labkit timeline --compare A B --numbers`):
the microbatches' losses the caller passed, exact, and each of the schedule's stages' gradient norm in
float64, read after torch's step returned, in eager code under no_grad, never inside a compiled region.
`labkit.spans.record`'s step wrapper calls `step_numbers`; `labkit.timeline.runs_compare` reads them.

May import: torch, labkit.versions."""

from __future__ import annotations

import sys

_SAID: list[str] = []


def norm64(grads: list):
    """The 2-norm of all `grads` together in float64 (one tensor on their device): each gradient's norm
    accumulated in float64, as `torch.linalg.vector_norm(g, dtype=torch.float64)` gives it, in ONE call
    (a Python call and a dispatch a parameter cost more than the norms themselves
    in a small model's step: `labkit.versions.float64_norms`), then the norm of those norms."""
    import torch

    from ..versions import float64_norms

    per = float64_norms(grads)  # under no_grad (step_numbers): no graph, whether or not a gradient requires one
    if len(per) == 1:
        return torch.linalg.vector_norm(per[0])
    try:
        return torch.linalg.vector_norm(torch.stack(per))
    except RuntimeError:  # gradients on several devices
        return torch.linalg.vector_norm(torch.stack([v.to(per[0].device) for v in per]))


def step_numbers(schedule, losses, grads: bool) -> dict | None:
    """What a step computed, for its `end_step` line (`labkit timeline --compare A B --numbers`): `losses`,
    the microbatches' losses the caller passed in (`losses=`, on the last stage's rank) as exact floats, and
    `grad_norms`, {stage index: the 2-norm of its gradients in float64} for each of the schedule's stages on
    this rank whose parameters have gradients (`grad_norms_local`: under FSDP / DTensor, of this rank's shard
    only). Read after torch's step returned, in eager code under no_grad, never inside a compiled region;
    nothing of the user's is changed. Cost: one call of torch's foreach norm a stage (`norm64`) and one host
    read per step."""
    try:
        import torch

        from ..versions import schedule_state

        if torch.compiler.is_compiling():
            return None
        out: dict = {}
        with torch.no_grad():
            if isinstance(losses, list) and losses:
                vals = [x.detach().to_local() if hasattr(x, "to_local") else x.detach() for x in losses
                        if isinstance(x, torch.Tensor) and x.numel() == 1]
                if vals:  # exact: float32 and bfloat16 fit a float64, and JSON writes floats as repr
                    out["losses"] = torch.stack([v.reshape(()).double() for v in vals]).tolist()
            idx, norms, local = [], [], False
            for stage in schedule_state(schedule)[1] if grads else ():
                gs = [p.grad for p in stage.submod.parameters() if p.grad is not None]
                if gs:
                    if any(type(g) is not torch.Tensor for g in gs):  # a DTensor (FSDP, TP): this rank's shard
                        local = local or any(hasattr(g, "to_local") for g in gs)
                        gs = [g.to_local() if hasattr(g, "to_local") else g for g in gs]
                    norms.append(norm64(gs))
                    idx.append(stage.stage_index)
            if norms:
                out["grad_norms"] = {str(i): v for i, v in zip(idx, torch.stack(norms).tolist())}
                if local:
                    out["grad_norms_local"] = True
        return out or None
    except Exception as e:  # noqa: BLE001  (never break the user's step over the record)
        if not _SAID:
            _SAID.append(str(e))
            print(f"[labkit] this step's losses and gradient norms are not recorded: {type(e).__name__}: {e}",
                  file=sys.stderr)
        return None
