"""The reference check: a pipelined step must equal ONE step of the unsplit model on the WHOLE batch.

The unsplit model (same initial weights) runs one forward over the whole batch; per-microbatch
losses are then taken from slices of that one output, and the gradient is that of their mean
(the schedules' default `scale_grads` divides by the number of microbatches). Comparing chunk
by chunk instead would run the model on each microbatch separately and hide the tutorial-layout
bug, where microbatches cut the sequence (notebooks 01 and 03).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass
class Reference:
    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    output: torch.Tensor | None = None


def whole_batch_reference(model: nn.Module, x, y, n_microbatches: int, loss_fn=None, device="cpu") -> Reference:
    """One forward (and backward, when `loss_fn` is given) of the unsplit `model` on the whole batch."""
    ref = copy.deepcopy(model).to(device)
    ref.zero_grad(set_to_none=True)
    if loss_fn is None:
        with torch.no_grad():
            return Reference(output=ref(x).detach())
    out = ref(x)
    losses = [loss_fn(o, t) for o, t in zip(out.chunk(n_microbatches, dim=0), y.chunk(n_microbatches, dim=0))]
    torch.stack(losses).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    return Reference(losses=[float(l.detach()) for l in losses], grads=grads)


def grad_diff(modules: list[nn.Module], grads: dict[str, torch.Tensor], ref: Reference) -> tuple[float, int]:
    """Largest |grad - reference grad| over the parameters of `modules`, and how many elements were compared.

    `grads` maps parameter names (as in the unsplit model) to the pipelined gradients. A parameter
    with no gradient or no reference counts as an infinite difference, never as a silent skip.
    """
    worst, numel = 0.0, 0
    for m in modules:
        for name, p in m.named_parameters():
            g, r = grads.get(name), ref.grads.get(name)
            if g is None or r is None or g.shape != r.shape:
                return float("inf"), numel
            worst = max(worst, float((g.to(r.device) - r).abs().max()))
            numel += p.numel()
    return worst, numel
