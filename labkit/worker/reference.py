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
import torch.distributed as dist
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

    @property
    def failure(self) -> str | None:
        if self.ok:
            return None
        if self.compared != self.expected and self.reference_losses:
            return (f"gradients compared for {self.compared} of {self.expected} parameters: some of the unsplit "
                    "model's parameters are held by no stage (a layer left out of every stage?)")
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


class CheckStepError(ValueError):
    """`check_step` was called in a way that cannot compare the step (a wrong microbatch count, losses on
    the wrong rank, stage names that are not the unsplit model's...). Raised on EVERY rank of the
    pipeline with the same message, before the check's collectives: nothing is left waiting."""


def _local_report(full: nn.Module, stages, losses, loss_fn, output, prefix_stage_index, tied, renamed,
                  extra=(), batch=None) -> dict:
    """What this rank knows about the call, for the verdict every rank computes the same way."""
    params = {n: tuple(p.shape) for n, p in full.named_parameters()}
    by_tensor = {id(p): n for n, p in full.named_parameters()}
    claims: dict[int, list[str]] = {}
    misnamed, example, shapes = 0, "", []
    for s in stages:
        mine = claims.setdefault(int(s.stage_index), [])
        for n, p in s.submod.named_parameters():
            name = f"{s.stage_index}.{n}" if prefix_stage_index else n
            if name in tied:  # a tied weight's copy stands for a name another stage holds too
                continue
            ref_name = renamed.get(name, name)
            if ref_name not in params:
                misnamed += 1
                if not example:
                    example = repr(name) + (f", which the unsplit model calls {by_tensor[id(p)]!r}"
                                            if id(p) in by_tensor else "")
                continue
            mine.append(ref_name)  # only names the unsplit model has can collide
            if params[ref_name] != tuple(p.shape) and len(shapes) < 3:
                shapes.append(f"stage {s.stage_index}'s {name!r} has shape {list(p.shape)}, the unsplit model's "
                              f"{ref_name!r} {list(params[ref_name])}")
    return {"stages": sorted(claims), "last": any(s.is_last for s in stages),
            "num_stages": max((int(getattr(s, "num_stages", 0) or 0) for s in stages), default=0),
            "chunks": sorted({int(c) for s in stages if (c := getattr(s, "chunks", None)) is not None}),
            "n_losses": len(losses or []), "has_output": output is not None, "n_extra": len(extra),
            "batch": batch, "claims": claims, "misnamed": misnamed, "example": example, "shapes": shapes}


def _verdict(reports: list[dict], ranks: list[int], n_microbatches, loss_fn, group, chunk_dim=0) -> list[str]:
    """Every mistake the reports show, in words that say the fix; the same list on every rank."""
    problems = []
    where = lambda r: f"rank {ranks[r]}"  # noqa: E731
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        problems.append(f"n_microbatches must be a whole number >= 1 (the schedule's n_microbatches), got "
                        f"{n_microbatches!r}.")
        n_microbatches = None
    # The microbatch count: the schedule's M (stage.chunks, set by its step) must divide it (several
    # pipelines with group= or steps accumulated give a whole multiple of it).
    stepped = sorted({c for rep in reports for c in rep["chunks"]})
    if n_microbatches is not None and stepped and any(n_microbatches % c for c in stepped):
        problems.append(
            f"wrong microbatch count: the schedule stepped the stages with {' and '.join(map(str, stepped))} "
            f"microbatches, check_step got n_microbatches={n_microbatches}. Pass the n_microbatches the schedule "
            f"was built with ({stepped[0]}; times the number of pipelines with group=, times the steps "
            f"accumulated).")
    batches = {rep["batch"] for rep in reports if rep["batch"] is not None}
    if len(batches) > 1:
        problems.append(f"the ranks passed batches of different shapes ({', '.join(map(str, sorted(batches)))}): "
                        f"pass the same whole batch x, y on every rank.")
    elif batches and n_microbatches is not None:
        shape = next(iter(batches))
        size = shape[chunk_dim] if len(shape) > chunk_dim else 0
        if size < n_microbatches or len(torch.empty(size).chunk(n_microbatches)) != n_microbatches:
            what = "targets y" if loss_fn is not None else "inputs x"
            problems.append(f"the {what} ({size} along dim {chunk_dim}) cannot be cut into {n_microbatches} "
                            f"microbatches: pass the WHOLE batch the step ran on, and the schedule's n_microbatches.")
    if len({rep["n_extra"] for rep in reports}) > 1:
        problems.append("extra= must hold the same number of floats on every rank.")
    # Who holds which stage: every stage once, the last one somewhere.
    holders: dict[int, list[int]] = {}
    for r, rep in enumerate(reports):
        for i in rep["stages"]:
            holders.setdefault(i, []).append(r)
    twice = {i: rs for i, rs in sorted(holders.items()) if len(rs) > 1}
    for i, rs in twice.items():
        fix = (" These ranks run several pipelines: pass group=the pipeline's process group (the check is a "
               "collective over it)." if group is None else " Check each rank's stage_index (PipelineStage(..., "
               "stage_index, num_stages, ...)) and the group passed to check_step.")
        problems.append(f"stage {i} is held by {' and '.join(where(r) for r in rs)}: a stage must be on one rank "
                        f"of the pipeline.{fix}")
    n_stages = max([rep["num_stages"] for rep in reports] + [0])
    missing = [i for i in range(n_stages) if i not in holders]
    if missing and not twice:
        problems.append(f"no rank of the pipeline holds stage{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing))} of {n_stages}: check each rank's stage_index, and pass "
                        f"group=the pipeline's process group when the ranks run several pipelines.")
    lasts = [r for r, rep in enumerate(reports) if rep["last"]]
    if not lasts and not missing:
        problems.append("no rank holds the last stage: check each rank's stage_index and num_stages.")
    # Losses (or the output, forward only): on the last stage, one per microbatch, and nowhere else.
    for r, rep in enumerate(reports):
        if loss_fn is None:
            if rep["last"] and not rep["has_output"]:
                problems.append(f"{where(r)} holds the last stage but got no output: pass output=the value "
                                f"schedule.step returned there.")
            continue
        if rep["last"] and rep["n_losses"] == 0:
            problems.append(f"{where(r)} holds the last stage but got no losses: pass the `losses` list that "
                            f"schedule.step(target=y, losses=losses) filled on that rank.")
        elif rep["last"] and n_microbatches is not None and rep["n_losses"] != n_microbatches:
            problems.append(f"{where(r)} (the last stage) holds {rep['n_losses']} losses, check_step got "
                            f"n_microbatches={n_microbatches}: one loss per microbatch. Pass the n_microbatches "
                            f"the schedule was built with, and the `losses` list of one step.")
        elif not rep["last"] and rep["n_losses"]:
            problems.append(f"{where(r)} holds no last stage but passed {rep['n_losses']} losses: losses come "
                            f"from the last stage only (schedule.step(target=y, losses=losses) on the rank that "
                            f"holds it). Pass an empty list (or the list its step left empty) on the other ranks.")
    # Names: each stage's parameters under the unsplit model's names of its own layers.
    misnamed = sum(rep["misnamed"] for rep in reports)
    if misnamed:
        example = next((rep["example"] for rep in reports if rep["example"]), "")
        problems.append(
            f"{misnamed} stage parameters have names that the unsplit model does not have"
            f"{', e.g. ' + example if example else ''}. If each stage module is `full[stage_index]` (stages "
            "cut from an nn.Sequential, as in notebooks 04 and 05), pass prefix_stage_index=True; otherwise "
            "pass renamed={name on the stage: name in the unsplit model}.")
    owners: dict[str, list[int]] = {}
    for rep in reports:  # (a stage's own names, twice over, would be one stage: set() below)
        for i, names in rep["claims"].items():
            for name in names:
                owners.setdefault(name, []).append(int(i))
    clash = {name: sorted(set(st)) for name, st in owners.items() if len(set(st)) > 1}
    if clash:
        pairs = sorted({tuple(st) for st in clash.values()})
        names = sorted(clash, key=lambda n: (clash[n], n))
        problems.append(
            f"parameter names collide across stages: {len(clash)} name{' is' if len(clash) == 1 else 's are'} "
            f"claimed by more than one stage "
            f"({'; '.join('stages ' + ' and '.join(map(str, p)) for p in pairs)}), e.g. "
            f"{', '.join(map(repr, names[:3]))}. Each name would be compared with ONE gradient of the unsplit "
            "model, the wrong one for all but one stage. A stage whose children were renumbered 0..k (e.g. "
            "nn.Sequential(full[2], full[3])) takes stage 0's names: keep the unsplit model's names (a slice "
            "full[2:4] keeps '2.', '3.'; a copy with the other stages' layers deleted keeps them all, "
            "notebook 01), use prefix_stage_index=True for stages that are full[stage_index], or pass "
            "renamed={name on the stage: name in the unsplit model}.")
    for rep in reports:
        problems += [f"names that do not line up: {x} (renumbered children?)." for x in rep["shapes"]]
    return list(dict.fromkeys(problems))


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
    is the unsplit model's `<stage_index>.weight`. With the wrong choice the names are not the unsplit
    model's (or collide across stages) and `CheckStepError` says which setting to use;
    loss_fn=None: forward only, `output` (the schedule's return on the last stage) is compared instead;
    chunk_dim: the dim the microbatches were cut along (1 for microbatches pre-split along dim 1);
    group: the pipeline's process group when the job holds several pipelines (PP x DP, notebook 10):
    the check is a collective over it, and `losses` / `x` / `y` are the whole batch of all of them;
    kwargs: the unsplit model's other inputs for the whole batch (attention_mask, position_ids);
    tied: {name of a tied weight's copy on a stage: the unsplit model's name}, e.g. GPT-2's
    {"lm_head.weight": "transformer.wte.weight"} (labkit.models.tied.TiedWeights.aliases): each copy
    must hold the whole tied gradient (notebook 11); renamed: {name on a stage: the unsplit model's
    name} for a tied parameter that a stage holds once under its other name (a traced BERT);
    clip_grad_norm: the reference's gradients clipped to this global norm, as the run's were.
    Every rank gets the same verdict. A call that cannot be compared (the microbatch count against the
    schedule's, losses missing on the last stage or passed on another rank, a stage held twice or by
    no rank, stage parameter names the unsplit model lacks or that collide across stages) raises
    `CheckStepError` on EVERY rank with the same message, before any collective that could wait:
    the ranks agree on it with one `all_gather_object`. Called by the kit's jobs and from `%%ranks`
    cells (notebook 01).
    """
    from . import distributed as worker

    device = device if device is not None else (stages[0].device if stages else "cpu")
    tied, renamed = tied or {}, renamed or {}
    # Validate first, on every rank, and agree with ONE collective that every rank reaches: a rank
    # that raised alone would leave the others waiting in the check's collectives below.
    batch = y if loss_fn is not None else x
    report = _local_report(full, stages, losses, loss_fn, output, prefix_stage_index, tied, renamed, extra,
                           tuple(batch.shape) if torch.is_tensor(batch) else None)
    reports = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(len(reports))]
    problems = _verdict(reports, ranks, n_microbatches, loss_fn, group, chunk_dim)
    if problems:
        raise CheckStepError("check_step cannot compare this step (the same on every rank of the pipeline):\n"
                             + "\n".join(f"  - {p}" for p in problems))
    has_last = any(s.is_last for s in stages)
    mine = [float(l.detach()) if torch.is_tensor(l) else float(l) for l in losses] if has_last else []
    ref = whole_batch_reference(full, x, y, n_microbatches, loss_fn, device, chunk_dim, kwargs, clip_grad_norm)
    gmax = ldiff = odiff = 0.0
    numel = 0
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
        if has_last:
            ldiff = max((abs(p - r) for p, r in zip(mine, ref.losses)), default=float("inf"))
            if len(mine) != len(ref.losses):
                ldiff = float("inf")
    per_rank = worker.all_gather_floats([gmax, float(numel), ldiff, odiff, float(has_last), *extra],
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
                 ldiff, gmax, odiff, tolerance, [r[5:] for r in per_rank])
