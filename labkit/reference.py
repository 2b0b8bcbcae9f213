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


def whole_batch_reference(model: nn.Module, x, y, n_microbatches: int, loss_fn=None, device="cpu",
                          chunk_dim: int = 0, kwargs: dict | None = None, clip_grad_norm: float | None = None) -> Reference:
    """One forward (and backward, when `loss_fn` is given) of the unsplit `model` on the whole batch;
    the per-microbatch losses from the output and target cut along `chunk_dim`. `kwargs`: the model's
    other inputs for the whole batch (attention_mask, position_ids); a model that returns a tuple or
    a transformers ModelOutput is read as its first element (the logits)."""
    ref = copy.deepcopy(model).to(device)
    ref.zero_grad(set_to_none=True)
    kwargs = kwargs or {}
    if loss_fn is None:
        with torch.no_grad():
            return Reference(output=_first(ref(x, **kwargs)).detach())
    out = _first(ref(x, **kwargs))
    losses = [loss_fn(o, t) for o, t in zip(out.chunk(n_microbatches, dim=chunk_dim), y.chunk(n_microbatches, dim=chunk_dim))]
    torch.stack(losses).mean().backward()
    if clip_grad_norm is not None:  # what a pipelined run clipped over all its stages (--clip-grad-norm)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_grad_norm)
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    return Reference(losses=[float(l.detach()) for l in losses], grads=grads)


def _first(out):
    return out if torch.is_tensor(out) else out[0]


def grad_diff(modules: list[nn.Module], grads: dict[str, torch.Tensor], ref: Reference,
              tied: dict[str, str] | None = None, renamed: dict[str, str] | None = None) -> tuple[float, int]:
    """Largest |grad - reference grad| over the parameters of `modules`, and how many elements were compared.

    `grads` maps parameter names (as in the unsplit model) to the pipelined gradients. A parameter
    with no gradient or no reference counts as an infinite difference, never as a silent skip.
    `tied`: {a copy's name: the unsplit model's name} for a tied weight held by several stages: the
    copy is compared with the one tied parameter's reference gradient and not counted again;
    `renamed`: {name: the unsplit model's name} for a tied parameter held once under its other name.
    """
    worst, numel = 0.0, 0
    tied, renamed = tied or {}, renamed or {}
    for m in modules:
        for name, p in m.named_parameters():
            g, r = grads.get(name), ref.grads.get(tied.get(name, renamed.get(name, name)))
            if g is None or r is None or g.shape != r.shape:
                return float("inf"), numel
            worst = max(worst, float((g.to(r.device) - r).abs().max()))
            numel += 0 if name in tied else p.numel()
    return worst, numel


@dataclass
class Check:
    """A pipelined step held against the unsplit model, as every rank sees it (the result of `check_step`)."""

    ok: bool
    max_abs_diff: float
    compared: int
    """Parameter elements whose gradients were compared, over all ranks."""
    expected: int
    """Parameter elements of the unsplit model (all must be compared, unless forward-only)."""
    losses: list[float]
    """The pipelined per-microbatch losses (from the rank that holds the last stage)."""
    reference_losses: list[float]
    max_abs_diff_losses: float
    max_abs_diff_grads: float
    max_abs_diff_outputs: float
    tolerance: float
    extras: list[list[float]]
    """Each rank's `extra` floats, in rank order (e.g. step times, peak memory)."""
    misnamed: int = 0
    """Stage parameters, over all ranks, whose names (as compared) are not names in the unsplit model."""
    misnamed_example: str = ""
    """One such name on this rank, with the unsplit model's name for the same tensor when one is found."""

    @property
    def failure(self) -> str | None:
        if self.ok:
            return None
        if self.compared != self.expected and self.reference_losses:
            message = f"gradients compared for {self.compared} of {self.expected} parameters"
            if self.misnamed:
                message += (f": {self.misnamed} stage parameters have names that the unsplit model does not have"
                            f"{', e.g. ' + self.misnamed_example if self.misnamed_example else ''}. If each stage "
                            "module is `full[stage_index]` (stages cut from an nn.Sequential, as in notebooks 04 "
                            "and 05), pass prefix_stage_index=True; otherwise pass grads={name in the unsplit "
                            "model: gradient}")
            return message
        if self.max_abs_diff == float("inf"):
            return ("a loss or gradient is missing: pass the `losses` list that schedule.step filled, and "
                    "check before the optimizer step or zero_grad")
        return f"reference mismatch: max abs diff {self.max_abs_diff:.3g} > tolerance {self.tolerance:g}"

    def verdict(self) -> str:
        return (f"{'matches' if self.ok else 'DOES NOT match'} the unsplit model (max abs diff "
                f"{self.max_abs_diff:.2e}, tolerance {self.tolerance:g})")


def stage_grads(stages, prefix_stage_index: bool = False) -> dict[str, torch.Tensor]:
    """The stages' gradients under the unsplit model's parameter names. `prefix_stage_index`: the
    stage modules are the children of an nn.Sequential, so a name is `<stage>.<name in the stage>`."""
    return {(f"{s.stage_index}.{n}" if prefix_stage_index else n): p.grad.detach().clone()
            for s in stages for n, p in s.submod.named_parameters() if p.grad is not None}


def _misnamed(full: nn.Module, stages, prefix_stage_index: bool, tied=None) -> tuple[int, str]:
    """How many of the stages' parameters go by a name the unsplit model lacks, and one example
    (`'weight', which the unsplit model calls '0.weight'`, when the same tensor is found there)."""
    names = {n for n, _ in full.named_parameters()} | set(tied or {})
    by_tensor = {id(p): n for n, p in full.named_parameters()}
    missing = [(f"{s.stage_index}.{n}" if prefix_stage_index else n, p) for s in stages
               for n, p in s.submod.named_parameters()
               if (f"{s.stage_index}.{n}" if prefix_stage_index else n) not in names]
    if not missing:
        return 0, ""
    name, p = missing[0]
    example = repr(name) + (f", which the unsplit model calls {by_tensor[id(p)]!r}" if id(p) in by_tensor else "")
    return len(missing), example


def check_step(full: nn.Module, stages, x, y, losses, n_microbatches: int, loss_fn=None, *, grads=None,
               prefix_stage_index: bool = False, output=None, extra=(), tolerance: float = 1e-4,
               device=None, chunk_dim: int = 0, group=None, kwargs: dict | None = None,
               tied: dict[str, str] | None = None, renamed: dict[str, str] | None = None,
               clip_grad_norm: float | None = None) -> Check:
    """Collective (call it on EVERY rank): this rank's part of one pipelined step against ONE forward
    (and backward) of the unsplit `full` model on the WHOLE batch `x`, `y`.

    stages: this rank's PipelineStages; losses: the `losses` list the schedule filled (last stage);
    grads: the gradients to compare (default: the stages' gradients now, `stage_grads`), under the
    unsplit model's parameter names;
    prefix_stage_index: how a stage's parameter names map to the unsplit model's. False (the default)
    when the stage module keeps the unsplit model's names, as a manual cut that deletes the other
    stages' layers does (`layers.3.linear1.weight` on both sides, notebook 01). True when the stage
    module is `full[stage_index]`, a child of an nn.Sequential (notebooks 04 and 05): its `weight`
    is the unsplit model's `<stage_index>.weight`. With the wrong choice no gradient is found under
    its name, the check fails, and `Check.failure` says which setting to use;
    loss_fn=None: forward only, `output` (the schedule's return on the last stage) is compared instead;
    chunk_dim: the dim the microbatches were cut along (1 for microbatches pre-split along dim 1);
    group: the pipeline's process group when the job holds several pipelines (PP x DP, notebook 10):
    the check is a collective over it, and `losses` / `x` / `y` are the whole batch of all of them;
    kwargs: the unsplit model's other inputs for the whole batch (attention_mask, position_ids);
    tied: {name of a tied weight's copy on a stage: the unsplit model's name}, e.g. GPT-2's
    {"lm_head.weight": "transformer.wte.weight"} (labkit.models.hf.TiedWeights.aliases): each copy
    must hold the whole tied gradient (notebook 11); renamed: {name on a stage: the unsplit model's
    name} for a tied parameter that a stage holds once under its other name (a traced BERT);
    clip_grad_norm: the reference's gradients clipped to this global norm, as the run's were.
    Every rank gets the same verdict. Called by the kit's jobs and from `%%ranks` cells (notebook 01).
    """
    from . import worker

    device = device if device is not None else (stages[0].device if stages else "cpu")
    has_last = any(s.is_last for s in stages)
    mine = [float(l.detach()) if torch.is_tensor(l) else float(l) for l in losses] if has_last else []
    ref = whole_batch_reference(full, x, y, n_microbatches, loss_fn, device, chunk_dim, kwargs, clip_grad_norm)
    gmax = ldiff = odiff = 0.0
    numel = misnamed = 0
    example = ""
    if loss_fn is None:
        if has_last:
            odiff = float((output.to(ref.output.device) - ref.output).abs().max())
    else:
        if grads is None:
            grads = stage_grads(stages, prefix_stage_index)
        if prefix_stage_index:
            named = nn.Module()
            for s in stages:
                named.add_module(str(s.stage_index), s.submod)
            modules = [named]
        else:
            modules = [s.submod for s in stages]
        gmax, numel = grad_diff(modules, grads, ref, tied, renamed)
        misnamed, example = _misnamed(full, stages, prefix_stage_index, {**(tied or {}), **(renamed or {})})
        if has_last:
            ldiff = max((abs(p - r) for p, r in zip(mine, ref.losses)), default=float("inf"))
            if len(mine) != len(ref.losses):
                ldiff = float("inf")
    per_rank = worker.all_gather_floats([gmax, float(numel), ldiff, odiff, float(has_last), float(misnamed), *extra],
                                        device, group)
    last_rank = min(r for r, v in enumerate(per_rank) if v[4])
    pipelined = [] if loss_fn is None else worker.broadcast_floats(
        mine if has_last else None,
        n_microbatches, last_rank, device, group)
    gmax, ldiff, odiff = (max(r[i] for r in per_rank) for i in (0, 2, 3))
    compared = int(sum(r[1] for r in per_rank))
    expected = sum(p.numel() for p in full.parameters())
    diff = odiff if loss_fn is None else max(gmax, ldiff)
    complete = loss_fn is None or compared == expected
    return Check(bool(diff <= tolerance and complete), diff, compared, expected, pipelined, ref.losses,
                 ldiff, gmax, odiff, tolerance, [r[6:] for r in per_rank],
                 int(sum(r[5] for r in per_rank)), example)
