"""The reference check: a pipelined step must equal ONE step of the unsplit model on the WHOLE batch.

The unsplit model (same initial weights) runs one forward over the whole batch; per-microbatch
losses are then taken from slices of that one output, and the gradient is that of their mean
(the schedules' default `scale_grads` divides by the number of microbatches). Comparing chunk
by chunk instead would run the model on each microbatch separately and hide the tutorial-layout
bug, where microbatches cut the sequence (notebooks 01 and 03).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from . import located
from .boundaries import stage_names
from .calls import CheckStepError, _agree_comparable, _Call  # noqa: F401  (CheckStepError: part of this API)
from .compared import compare_grads, compare_losses
from .noise import (NOISE_MULTIPLE, STEP_KINDS, Figure, autocast_ctx, canonical, chunk_kwargs, figure, reference_copy,
                    summary, where, within_noise)
from ..worker.shared import digest, is_shared, memo, module_key


@dataclass
class Reference:
    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    output: torch.Tensor | None = None
    dropped: list[str] = field(default_factory=list)
    """Modules whose instance-level `forward` (a wrapper) the reference could not run on its copy."""


def whole_batch_reference(model: nn.Module, x, y, n_microbatches: int, loss_fn=None, device="cpu",
                          chunk_dim: int = 0, kwargs: dict | None = None, clip_grad_norm: float | None = None,
                          autocast: torch.dtype | None = None, *, copied: bool = False) -> Reference:
    """One forward (and backward, when `loss_fn` is given) of the unsplit `model` on the whole batch;
    the per-microbatch losses from the output and target cut along `chunk_dim`. `kwargs`: the model's
    other inputs for the whole batch (attention_mask, position_ids); a model that returns a tuple or
    a transformers ModelOutput is read as its first element (the logits). `autocast`: the forward
    runs under torch.autocast with that dtype, as the pipelined step's did. The model is copied
    (`noise.reference_copy`: a forward replaced on an instance runs on the copy's parameters); `copied`:
    `model` is already such a copy of the caller's own (float64_reference's), run as it is."""
    ref = (model if copied else reference_copy(model)).to(device)
    ref.zero_grad(set_to_none=True)
    kwargs = kwargs or {}
    if loss_fn is None:
        with torch.no_grad(), autocast_ctx(device, autocast):
            return Reference(output=_first(ref(x, **kwargs)).detach())
    with autocast_ctx(device, autocast):  # the loss too: a schedule computes it inside its step
        out = _first(ref(x, **kwargs))
        losses = [loss_fn(o, t) for o, t in zip(out.chunk(n_microbatches, dim=chunk_dim),
                                                y.chunk(n_microbatches, dim=chunk_dim))]
    torch.stack(losses).mean().backward()
    if clip_grad_norm is not None:  # what a pipelined run clipped over all its stages (--clip-grad-norm)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_grad_norm)
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    return Reference(losses=[float(l.detach()) for l in losses], grads=grads, dropped=ref._labkit_dropped_forwards)


def float64_reference(model: nn.Module, x, y, n_microbatches: int, loss_fn=None, device="cpu", chunk_dim: int = 0,
                      kwargs: dict | None = None, clip_grad_norm: float | None = None,
                      why: list | None = None) -> Reference | None:
    """`whole_batch_reference` of a float64 copy on float64 inputs, without autocast: the truth a
    step's own rounding is measured against (None where the model cannot run in float64; `why`, a
    list, gets the error then)."""
    up = lambda v: v.double() if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
    try:
        model64 = reference_copy(model).double()
        return whole_batch_reference(model64, up(x), up(y), n_microbatches, loss_fn, device, chunk_dim,
                                     {k: up(v) for k, v in (kwargs or {}).items()}, clip_grad_norm, copied=True)
    except (RuntimeError, TypeError) as e:
        if why is not None:
            why.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None


def microbatched_reference(model: nn.Module, x, y, n_microbatches: int, loss_fn=None, device="cpu",
                           chunk_dim: int = 0, kwargs: dict | None = None, clip_grad_norm: float | None = None,
                           autocast: torch.dtype | None = None) -> Reference:
    """The unsplit `model` run microbatch by microbatch, as a pipeline adds the numbers up: each
    microbatch's forward and loss, its backward accumulating into the gradients, then the sum divided
    by the number of microbatches (torch's scale_grads). The same numbers as `whole_batch_reference`
    in another order: how far the two differ is this model's float noise (labkit.check.noise)."""
    ref = reference_copy(model).to(device)
    ref.zero_grad(set_to_none=True)
    kwargs = kwargs or {}
    size = x.shape[chunk_dim] if torch.is_tensor(x) and x.dim() > chunk_dim else 0
    xs, kws = x.chunk(n_microbatches, dim=chunk_dim), chunk_kwargs(kwargs, size, n_microbatches, chunk_dim)
    if loss_fn is None:
        with torch.no_grad(), autocast_ctx(device, autocast):
            outputs = [_first(ref(xc, **kw)).detach() for xc, kw in zip(xs, kws)]
            return Reference(output=torch.cat(outputs, dim=chunk_dim))
    losses = []
    for xc, yc, kw in zip(xs, y.chunk(n_microbatches, dim=chunk_dim), kws):
        with autocast_ctx(device, autocast):
            out = _first(ref(xc, **kw))
            loss = loss_fn(out, yc)
        loss.backward()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.div_(n_microbatches)
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_grad_norm)
    return Reference(losses=losses, grads={n: p.grad.detach().clone() for n, p in ref.named_parameters()
                                           if p.grad is not None})


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
    tolerance: float | None
    """An absolute bound the caller gave; None: the step is judged against measured float noise."""
    extras: list[list[float]]
    """Each rank's `extra` floats, in rank order (e.g. step times, peak memory)."""
    figures: list[Figure] = field(default_factory=list)
    """Every compared tensor (each microbatch's loss, each gradient, the output): its error against the
    reference, the floor measured for this model and data, their ratio (labkit.check.noise)."""
    noise_multiple: float = NOISE_MULTIPLE
    where: str = ""
    """What diverges and what that points to, when the step is outside float noise."""
    no_grad: list[str] = field(default_factory=list)
    """Parameters a stage holds whose gradient was None after the step."""
    notes: list[str] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    """Stage parameters that do not hold the unsplit model's values before the step (a loading or copying
    bug), each with its largest difference: reported before anything else."""
    no_grad_why: list[str] = field(default_factory=list)
    """Why each of `no_grad` got no gradient (its module never ran in the stage's forward; it ran and used the
    parameter but its output was cut off from the loss; it ran and never used the parameter:
    labkit.check.located.why_no_grad), in the same order."""

    def __post_init__(self):
        if self.no_grad and not self.no_grad_why:  # "stage 1's 'w' (why)", as the ranks gathered them: the
            # why's own parentheses kept (it ends in one)
            named = [n.partition(" (") for n in self.no_grad]
            self.no_grad, self.no_grad_why = [n for n, _, _ in named], [w.removesuffix(")") for _, _, w in named]
        # one first place: a weight loaded wrong or a parameter given no gradient is what `failure` leads
        # with, so `where` says the same (not the gradient ratios it causes)
        if not self.ok and (self.values or self.no_grad):
            self.where = self.failure or self.where

    @property
    def worst_ratio(self) -> float:
        """The worst ratio of the step's own tensors (losses, gradients, output); a failed check's boundary
        figures (kind "boundary": float64 replays, labkit.check.boundaries) are not among them."""
        return max((f.ratio for f in self.figures if f.kind in STEP_KINDS), default=0.0)

    @property
    def failure(self) -> str | None:
        if self.ok:
            return None
        if self.values:
            return (f"{'; '.join(self.values[:3])}{' and others' if len(self.values) > 3 else ''}: "
                    f"{'does' if len(self.values) == 1 else 'do'} not hold the unsplit model's values before the step "
                    f"(a loading or copying bug): a stage must start from the unsplit model's weights (the same seed, "
                    f"checkpoint or copy), cast at most")
        if self.no_grad:
            whys = list(dict.fromkeys(w for w in self.no_grad_why if w))
            why = (": " + "; ".join(whys[:2])) if whys else ""
            return (f"{', '.join(self.no_grad[:3])}{' and others' if len(self.no_grad) > 3 else ''}: held by the "
                    f"stage, given a gradient by the unsplit model, but none by the step{why}. Every parameter a "
                    f"stage holds must take part in its forward and backward as in the unsplit model")
        if self.compared != self.expected and self.reference_losses:
            return (f"gradients compared for {self.compared} of {self.expected} parameters: some of the unsplit "
                    "model's parameters are held by no stage (a layer left out of every stage?)")
        if self.max_abs_diff == float("inf"):
            return ("a loss or gradient is missing: pass the `losses` list that schedule.step filled, and "
                    "check before the optimizer step or zero_grad")
        if self.tolerance is None:  # where first: the sentence a learner acts on, then the numbers
            return (f"{self.where}. " if self.where else "") + summary(self.figures, self.noise_multiple)
        return (f"reference mismatch: max abs diff {self.max_abs_diff:.3g} > tolerance {self.tolerance:g}"
                + (f". Where, against this model's float noise: {self.where}" if self.where else ""))

    def verdict(self) -> str:
        if self.tolerance is None:
            return (f"{'matches' if self.ok else 'DOES NOT match'} the unsplit model within float noise (worst "
                    f"tensor {self.worst_ratio:.2g}x its measured floor, limit {self.noise_multiple:g}x; max abs "
                    f"diff {self.max_abs_diff:.2e})")
        return (f"{'matches' if self.ok else 'DOES NOT match'} the unsplit model (max abs diff "
                f"{self.max_abs_diff:.2e}, tolerance {self.tolerance:g})")


def stage_grads(stages, prefix_stage_index: bool = False) -> dict[str, torch.Tensor]:
    """The stages' gradients under the unsplit model's parameter names. `prefix_stage_index`: the
    stage modules are the children of an nn.Sequential, so a name is `<stage>.<name in the stage>`."""
    return {(f"{s.stage_index}.{n}" if prefix_stage_index else n): p.grad.detach().clone()
            for s in stages for n, p in s.submod.named_parameters() if p.grad is not None}


def check_step(full: nn.Module, stages, x, y, losses, n_microbatches: int, loss_fn=None, *, grads=None,
               prefix_stage_index: bool | None = None, output=None, extra=(), tolerance: float | None = None,
               device=None, chunk_dim: int = 0, group=None, kwargs: dict | None = None,
               tied: dict[str, str] | None = None, renamed: dict[str, str] | None = None,
               clip_grad_norm: float | None = None, autocast: torch.dtype | None = None,
               values: dict | None = None) -> Check:
    """Collective (call it on EVERY rank): this rank's part of one pipelined step against ONE forward
    (and backward) of the unsplit `full` model on the WHOLE batch `x`, `y`.

    stages: this rank's PipelineStages; losses: the `losses` list the schedule filled (last stage);
    grads: the gradients to compare (default: the stages' gradients now, `stage_grads`), under the
    unsplit model's parameter names;
    prefix_stage_index: how a stage's parameter names map to the unsplit model's; None (the default):
    inferred from the names, the check says which it used in its notes. False when the stage module
    keeps the unsplit model's names, as a manual cut that deletes the other
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
    clip_grad_norm: the reference's gradients clipped to this global norm, as the run's were;
    tolerance: None (the default): each compared tensor is judged against the float noise measured
    for this model and data (labkit.check.noise: within NOISE_MULTIPLE = 2 times its floor), which
    tells a bug from rounding in float32 and bf16 alike; a number: an absolute bound on every
    difference instead (e.g. 1e-3 for tensor parallelism, whose split sums the floor does not model);
    values: each stage's parameters as they were at the step ({stage_index: {name in the stage module:
    tensor}}), when the stages changed since (an optimizer step, as the kit's jobs check their first step
    after the last): the values check and a failure's replay read them; default: the stages' own now;
    autocast: the dtype the step ran under torch.autocast with: the references run under it too (cast
    cache off: run the step as `labkit.check.noise.autocast_ctx` does, or read the failure's hint).
    The returned Check carries every compared tensor's figures (error, floor, ratio), and a failure
    says where the step went wrong (which losses, stages and parameters) in either mode.
    Every rank gets the same verdict. A call that cannot be compared (the microbatch count against the
    schedule's, losses missing on the last stage or passed on another rank, a stage held twice or by
    no rank, stage parameter names the unsplit model lacks or that collide across stages) raises
    `CheckStepError` on EVERY rank with the same message, before any collective that could wait:
    the ranks agree on it with one `all_gather_object`. Called by the kit's jobs and from `%%ranks`
    cells (notebook 01).
    """
    device = device if device is not None else (stages[0].device if stages else "cpu")
    c = _Call(full, stages, x, y, losses, n_microbatches, loss_fn, grads, prefix_stage_index, output, extra, tolerance,
              device, chunk_dim, group, kwargs, tied or {}, renamed or {}, clip_grad_norm, autocast, values=values)
    # Validate first, on every rank, and agree with ONE collective that every rank reaches: a rank
    # that raised alone would leave the others waiting in the check's collectives below.
    _agree_comparable(c)
    found, ref, why = _compare(c)
    return _decide(c, found, ref, why)


@dataclass
class _Findings:
    """This rank's part of the comparison, before the ranks gather it."""

    mine: list[float]
    """The pipelined losses (the last stage's rank; else empty)."""
    figures: list[Figure] = field(default_factory=list)
    no_grad: list[str] = field(default_factory=list)
    gmax: float = 0.0
    numel: int = 0
    ldiff: float = 0.0
    odiff: float = 0.0
    values: list[str] = field(default_factory=list)
    """Stage parameters whose values are not the unsplit model's (`_compare_values`)."""


def _compare(c: _Call) -> tuple[_Findings, Reference, list[str]]:
    """This rank's gradients, losses or output against the references (whole batch, microbatched,
    float64). Returns its findings, the whole-batch reference, and why there is no float64 truth."""
    mine = [float(l.detach()) if torch.is_tensor(l) else float(l) for l in c.losses] if c.has_last else []
    ref, probe, truth, why = memo(_references_key(c), lambda: _references(c))
    last_stage = max((int(s.stage_index) for s in c.stages if s.is_last), default=None)
    found = _Findings(mine, values=located.stage_values(c) if c.grads is None or c.values else [])
    if c.loss_fn is None:
        if c.has_last:
            found.odiff = float((c.output.to(ref.output.device) - ref.output).abs().max())
            found.figures.append(figure("output", "output", last_stage, c.output, ref.output, probe.output,
                                        truth=truth.output if truth else None))
        return found, ref, why
    grads = c.grads if c.grads is not None else stage_grads(c.stages, c.prefix_stage_index)
    if c.compiled is not None:  # a compiled pipeline: what compiling changes, measured (every rank: collective)
        from .compiled_floor import probes_for_check_step

        c.compiled = probes_for_check_step(c)
    found.gmax, found.numel = compare_grads(c, grads, (ref, probe, truth), found.figures, found.no_grad)
    if c.has_last:
        found.ldiff = compare_losses(c, mine, (ref, probe, truth), last_stage, found.figures)
    return found, ref, why


def _references(c: _Call) -> tuple[Reference, Reference, Reference | None, list[str]]:
    """The unsplit model's whole-batch, microbatched and float64 references for this call, and why
    there is no float64 one (the model would not run in float64)."""
    args = (c.full, c.x, c.y, c.n_microbatches, c.loss_fn, c.device, c.chunk_dim, c.kwargs, c.clip_grad_norm,
            c.autocast)
    why: list[str] = []
    return whole_batch_reference(*args), microbatched_reference(*args), float64_reference(*args[:-1], why), why


def _references_key(c: _Call) -> tuple | None:
    """What the references depend on (labkit.worker.shared): the unsplit model, the whole batch, the
    microbatch count, the loss, the device, the cut's dim, clipping, autocast. None: not shared (a
    model with hooks, or no shared_work() block open: then nothing is hashed)."""
    model = module_key(c.full) if is_shared() else None
    if model is None:
        return None
    return ("references", model, digest(c.x, c.y, c.kwargs or {}), c.n_microbatches, c.loss_fn, str(c.device),
            c.chunk_dim, c.clip_grad_norm, str(c.autocast), torch.is_grad_enabled())


def _decide(c: _Call, found: _Findings, ref: Reference, why: list[str]) -> Check:
    """Every rank's findings gathered over the pipeline (collectives), and the one verdict."""
    from ..worker import distributed as worker

    per_rank = worker.all_gather_floats([found.gmax, float(found.numel), found.ldiff, found.odiff,
                                         float(c.has_last), *c.extra], c.device, c.group)
    gathered = [None] * dist.get_world_size(c.group)
    dist.all_gather_object(gathered, ([f.as_dict() for f in found.figures], found.no_grad, ref.dropped,
                                      (found.values, located.compiled_counts(c))), group=c.group)
    figures = [Figure(**f) for figs, _, _, _ in gathered for f in figs]
    no_grad = [n for _, ng, _, _ in gathered for n in ng]
    dropped = sorted({n for _, _, dr, _ in gathered for n in dr})
    values = [v for _, _, _, vs in gathered for v in vs[0]]
    last_rank = min(r for r, v in enumerate(per_rank) if v[4])
    pipelined = [] if c.loss_fn is None else worker.broadcast_floats(
        found.mine if c.has_last else None, c.n_microbatches, last_rank, c.device, c.group)
    gmax, ldiff, odiff = (max(r[i] for r in per_rank) for i in (0, 2, 3))
    compared = int(sum(r[1] for r in per_rank))
    expected = sum(p.numel() for p in c.full.parameters())
    diff = odiff if c.loss_fn is None else max(gmax, ldiff)
    complete = c.loss_fn is None or compared == expected
    within = all(f.ratio <= NOISE_MULTIPLE for f in figures) and diff != float("inf")
    ok = bool(complete and not no_grad and not values and (within if c.tolerance is None else diff <= c.tolerance))
    notes = _notes(c, ok, figures, dropped, why) + located.compile_notes_of([vs[1] for *_, vs in gathered])
    said = "" if ok else where(figures, autocast=c.autocast)
    located_ = complete and not no_grad and not values and diff != float("inf") and not within_noise(figures)
    if not ok and located_:  # every rank: ok is the same (a pass by float noise failed by a tolerance: nothing to find)
        said = located.located_step(c, figures, said)
    return Check(ok, diff, compared, expected, pipelined, list(ref.losses), ldiff, gmax, odiff, c.tolerance,
                 [r[5:] for r in per_rank], figures, NOISE_MULTIPLE, said, no_grad, notes, values)


def _notes(c: _Call, ok: bool, figures: list[Figure], dropped: list[str], why: list[str]) -> list[str]:
    """What the verdict alone does not say: forwards the reference could not run, a pass by tolerance
    outside float noise, no float64 truth."""
    notes = [f"{', '.join(dropped)}: a forward replaced on the module instance (a wrapper or hook) was not run "
             f"by the reference's copy; the class's forward was"] if dropped else []
    if c.inferred and c.prefix_stage_index:
        notes.append("names: each stage module is full[stage_index] (its 'weight' is the unsplit model's "
                     "'<stage_index>.weight'): prefix_stage_index=True, inferred from the names")
    worst = max(figures, key=lambda f: f.ratio, default=None)
    if c.tolerance is not None and ok and worst is not None and worst.ratio > NOISE_MULTIPLE:
        notes.append(f"within the tolerance {c.tolerance:g}, but outside float noise: the worst tensor ({worst.kind} "
                     f"{worst.name}) is {worst.ratio:.3g}x the floor measured for this model and data; a check without "
                     f"tolerance= would fail it (where: {where(figures, autocast=c.autocast)})")
    if why and c.tolerance is None:
        notes.append(f"no float64 truth (the model or loss would not run in float64: {why[0]}): each floor is the "
                     f"reference against itself microbatch by microbatch alone, which a cut of the batch can fool")
    return notes
