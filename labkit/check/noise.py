"""Bug or float noise: the floor each compared tensor of a pipelined step is judged against.

A correct pipeline does not reproduce the unsplit model's numbers bit for bit: it runs the model
microbatch by microbatch and adds the gradients up microbatch after microbatch, so its sums run in
another order; how far that moves a number depends on the model, the data and the dtype (large
activations and bf16 move it most). A fixed tolerance cannot tell that from a bug. So, for every
tensor the check compares (each microbatch's loss, each parameter's gradient, an inference output),
`check_step(..., tolerance=None)` MEASURES the noise of this model on this data:

    R  the unsplit model on the whole batch, in the step's dtype and autocast (the reference),
    C  the same, run microbatch by microbatch (`microbatched_reference`): R's numbers in a pipeline's order,
    T  the unsplit model in float64 on the whole batch (`float64_reference`): the truth,
    floor = min(max|C - R|, max|R - T|) + MIN_FLOOR_ULPS * terms * eps(dtype) * max|R|

`terms` is how many parts a pipeline adds up in an order R does not know (the microbatches, times
the replicas). The minimum keeps a cut of the batch that changes the model's result (the tutorial's
layout cuts a sequence) from passing as noise; max|R - T| alone would hide bugs under bf16, whose
rounding is the same in P and R. A pipelined tensor P is within float noise when
max|P - R| <= NOISE_MULTIPLE * floor.

NOISE_MULTIPLE = 2: above what every correct run of the suite reads (every schedule x split, the
transformers models, FSDP2, data parallelism, accumulation, resume, bf16 and float64 runs:
tests/test_reference_runs.py) and far below what the known bugs read (tests/test_noise.py); the
figures are in bench/RESULTS.md, "labkit/check/noise.py". Tensor parallelism is not modelled: its
split sums put a pre-activation within rounding of 0 on the other side of a ReLU, a jump no
reordering of the reference's own sums makes: TP keeps an absolute tolerance (RunConfig's 1e-3).
Under bf16 a small bug shows or hides by where it enters, not by its size alone: a change that bf16
rounds away in the activation it enters (a bias far smaller than that activation) reaches no loss:
only its own gradient shows it, and that gradient's bf16 floor can be larger; one that survives the
rounding moves every later loss (notebook 09b: the same 0.1% bias error hidden in one model, found in another).

Where it went wrong (`where`): which microbatches' losses are outside, which stages' gradients, the
largest ratios by the unsplit model's names, and what that pattern points to.

May import: torch. Used by labkit.check.reference.check_step."""

from __future__ import annotations

import contextlib
import copy
import types
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

NOISE_MULTIPLE = 2.0
STEP_KINDS = ("loss", "grad", "output")  # the step's own tensors; "boundary": a failed check's float64 replays
MIN_FLOOR_ULPS = 1.0
SHOWN = 3  # how many of the worst tensors a failure names
WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


@dataclass
class Figure:
    """One compared tensor: its error against the reference, the measured floor, their ratio."""

    kind: str                 # "loss" | "grad" | "output"
    name: str                 # microbatch index for a loss, the unsplit model's name for a gradient
    stage: int | None
    err: float                # max |pipelined - reference|
    floor: float              # max(max |microbatched - reference|, the minimum floor)
    scale: float              # max |reference|
    ratio: float              # err / floor
    fit: float = 1.0          # <P, R> / <R, R>: the factor P is R scaled by (1 when equal)
    reorder: float = 0.0      # max |microbatched - reference|: the reference against itself in a pipeline's order
    own: float | None = None  # max |reference - float64 truth|: the reference's own rounding (None: no truth)
    compiled: float | None = None  # what a compiled pipeline added to the floor (labkit.check.compiled_floor)

    def as_dict(self) -> dict:
        return asdict(self)


def eps_of(dtype: torch.dtype) -> float:
    """The resolution a tensor is kept (and its parts added up) in."""
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def figure(kind: str, name: str, stage, pipelined: torch.Tensor, ref: torch.Tensor, probe: torch.Tensor | None,
           terms: int = 1, dtype: torch.dtype | None = None, truth: torch.Tensor | None = None, *,
           reorder: float | None = None, own: float | None = None, compiled: float | None = None) -> Figure:
    """The figure of one tensor; compared in float64, on the reference's device. `terms`: how many
    parts were added up into it in an order the reference does not know (the microbatches, times the
    replicas: a gradient); `dtype`: what it was kept in, where the tensors given are not (losses
    passed as Python floats). `reorder`, `own`: max|probe - ref| and max|truth - ref| already taken (a check
    that frees each reference's tensors as soon as it has read them, labkit.check.stagewise). `compiled`:
    the pipeline has a compiled stage: what compiling measured for this tensor (0: nothing measured), taken
    with one more rounding of the reference's own into the floor (labkit.check.compiled_floor)."""
    scale, err, rr, pr = _stats(pipelined, ref)
    if reorder is None:
        reorder = max_abs_diff(probe, ref)
    if own is None:
        own = max_abs_diff(truth, ref) if truth is not None else None
    noise = reorder if own is None else min(reorder, own)  # the reference's own error: no cut of the batch fakes it
    if compiled is not None:  # a compiled pipeline: one more rounding of its own, or what compiling measured here
        compiled = max(reorder if own is None else own, compiled)
        noise += compiled
    floor = max(noise + MIN_FLOOR_ULPS * terms * eps_of(dtype or ref.dtype) * scale, torch.finfo(torch.float64).tiny)
    fit = pr / rr if rr > 0 else 1.0
    return Figure(kind, name, stage, err, floor, scale, err / floor, fit, reorder, own, compiled)


CHUNK = 1 << 20
"""Elements per float64 piece of a figure: a large tensor (an embedding's gradient) is compared in pieces,
never as whole float64 copies of it and its reference (labkit.check.stagewise's memory, bench/RESULTS.md)."""


def _pieces(a: torch.Tensor, b: torch.Tensor):
    """(a, b) flattened on b's device, in float64 pieces of CHUNK elements."""
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:  # compared as the tensors broadcast (a loss against its 0-d reference)
        a, b = torch.broadcast_tensors(a.to(b.device), b)
    a, b = a.reshape(-1), b.reshape(-1)
    for i in range(0, b.numel(), CHUNK):
        yield a[i:i + CHUNK].to(b.device, torch.float64), b[i:i + CHUNK].to(torch.float64)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64, piece by piece (0.0 for an empty tensor)."""
    return max((float((x - y).abs().max()) for x, y in _pieces(a, b)), default=0.0)


def _stats(p: torch.Tensor, r: torch.Tensor) -> tuple[float, float, float, float]:
    """max |r|, max |p - r|, sum r*r and sum p*r in float64, piece by piece (zeros for an empty tensor)."""
    scale = err = rr = pr = 0.0
    for x, y in _pieces(p, r):
        scale, err = max(scale, float(y.abs().max())), max(err, float((x - y).abs().max()))
        rr, pr = rr + float((y * y).sum()), pr + float((x * y).sum())
    return scale, err, rr, pr


def reference_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` that computes with its OWN parameters. A `forward` replaced on a module
    instance (the kit's SavedTensorTracker, a user's hook or wrapper) is copied by reference, so the
    copy would still run the original module, on the original's parameters: a bound method is bound
    to the copy instead; any other callable is dropped, and the class's forward runs (returned in
    `dropped`, so the check can say so)."""
    copy_ = copy.deepcopy(model)
    dropped = []
    for (name, orig), (_, mine) in zip(model.named_modules(), copy_.named_modules()):
        f = mine.__dict__.get("forward")
        if f is None:
            continue
        if isinstance(f, types.MethodType) and f.__self__ is orig:
            mine.forward = types.MethodType(f.__func__, mine)
        else:
            del mine.__dict__["forward"]
            dropped.append(name or "(the model)")
    copy_._labkit_dropped_forwards = dropped
    return copy_


def autocast_ctx(device, autocast: torch.dtype | None):
    """torch.autocast for the check's references and the kit's own steps, its cast cache off.

    The cache keeps one bf16 copy of each tensor that is a leaf and requires grad, shared by all its
    uses. In the unsplit model that is the weights (each used once per forward: no effect). In a
    pipeline a stage's received activation is such a leaf too: its uses (attention's query, key and
    value) then share one copy, their gradients are summed in bf16 and the gradient sent back is
    rounded once more than the unsplit model's (measured: the tutorial model's stage 0 gradients at
    5e3x their floor under GPipe). Off, every schedule x split reads at most 1.2x (tests)."""
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=autocast, cache_enabled=False)


def autocast(dtype: torch.dtype = torch.bfloat16, device=None):
    """`labkit.autocast(torch.bfloat16)`: torch.autocast with its cast cache off, for a pipelined step
    and its check. A plain `torch.autocast` (cache on) casts a stage's received activation once and
    shares that copy among its uses (q, k and v projections): their gradients are summed in bf16 and
    a correct step fails its check (`autocast_ctx` says how much). `device`: "cpu" or "cuda"; default
    the GPU when this process has initialised one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
    return autocast_ctx(device, dtype)


def chunk_kwargs(kwargs: dict, size: int, n: int, dim: int) -> list[dict]:
    """The model's other inputs for each microbatch: tensors of the batch's size along `dim` cut, the rest whole."""
    out = [{} for _ in range(n)]
    for k, v in kwargs.items():
        parts = v.chunk(n, dim=dim) if torch.is_tensor(v) and v.dim() > dim and v.shape[dim] == size else [v] * n
        for i in range(n):
            out[i][k] = parts[i]
    return out


def canonical(name: str) -> str:
    """A parameter name with the prefixes wrappers add (torch.compile's `_orig_mod.`, the checkpoint
    wrapper's `_checkpoint_wrapped_module.`, DDP's `module.`) taken out: the unsplit model's name."""
    for p in WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def where(figures: list[Figure], multiple: float = NOISE_MULTIPLE, autocast: torch.dtype | None = None) -> str:
    """What diverges and what that points to, from every rank's figures (the same on every rank).
    `autocast`: the step ran under it (a hint about autocast's cast cache, `autocast_ctx`)."""
    bad = [f for f in figures if f.ratio > multiple]
    if not bad:
        return ""
    losses = sorted((f for f in bad if f.kind == "loss"), key=lambda f: int(f.name))
    grads = sorted((f for f in bad if f.kind == "grad"), key=lambda f: -f.ratio)
    outputs = [f for f in bad if f.kind == "output"]
    all_grads = [f for f in figures if f.kind == "grad"]
    lines = []
    if outputs:
        lines.append(f"the output differs ({outputs[0].ratio:.3g}x its floor): a forward on some stage")
    if losses:
        n_mb = sum(1 for f in figures if f.kind == "loss")
        top = max(f.ratio for f in losses)
        if len(losses) == n_mb:
            lines.append(f"every microbatch's loss differs (up to {top:.3g}x its floor)")
        else:
            lines.append(f"the loss of microbatch{'es' if len(losses) > 1 else ''} "
                         f"{', '.join(f.name for f in losses)} differs (up to {top:.3g}x its floor); "
                         + _the_others(figures, multiple))
    if grads:
        stages = sorted({f.stage for f in grads if f.stage is not None})
        worst = ", ".join(f"stage {f.stage}'s {f.name!r} ({f.ratio:.3g}x)" for f in grads[:SHOWN])
        fits = [f.fit for f in all_grads if f.scale > 0]
        spread = max(fits) - min(fits) if fits else 1.0
        if fits and len(grads) == len(all_grads) and abs(fits[0] - 1) > 1e-3 and spread < 1e-3 * abs(fits[0]):
            lines.append(f"every gradient is the reference's times {fits[0]:.4g} (losses equal): a loss-scaling "
                         f"mistake (scale_grads, a loss divided twice or not at all, accumulation)")
        elif not losses:
            lines.append(f"the losses match; gradients of stage{'s' if len(stages) > 1 else ''} "
                         f"{', '.join(map(str, stages))} differ: their backward, what was done to the gradients "
                         f"after it (scaling, clipping, accumulation), or a forward on that stage whose effect on the "
                         f"losses is below their floor (bf16). Largest: {worst}")
        else:
            lines.append(f"gradients of stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} differ; "
                         f"largest: {worst}")
        last = max((f.stage for f in figures if f.stage is not None), default=None)
        if autocast is not None and not losses and stages and last not in stages:
            lines.append("under autocast, gradients of stages before the last alone: if the step ran inside "
                         "torch.autocast with its cast cache on (the default), a stage's received activation is "
                         "cast once and its uses' gradients summed in bf16; run the step under "
                         "torch.autocast(..., cache_enabled=False), as the check's reference does, to compare")
    return "; ".join(lines)


def _the_others(figures: list[Figure], multiple: float) -> str:
    """Whether the microbatches whose losses are within their floors agree, or moved too (a bug on every
    microbatch shows first where the floor is lowest: not a bug of those microbatches alone)."""
    others = [f.ratio for f in figures if f.kind == "loss" and f.ratio <= multiple]
    moved = max(others, default=0.0)
    if moved > 1.0:
        return (f"the others moved too (up to {moved:.2g}x their floors, within the limit): every microbatch "
                f"moved, a bug on the whole batch, not on those microbatches alone")
    return f"the others agree (at most {moved:.2g}x their floors)"


def within_noise(figures: list[Figure], multiple: float = NOISE_MULTIPLE) -> bool:
    """Every tensor of the step within `multiple` times its floor."""
    return all(f.ratio <= multiple for f in figures if f.kind in STEP_KINDS)


def travel_hint(figures: list[Figure], multiple: float = NOISE_MULTIPLE) -> str:
    """What the losses and gradients point to when every stage computes as the unsplit model: how the
    microbatches or activations travelled, or the loss."""
    losses = [f for f in figures if f.kind == "loss"]
    bad = [f for f in losses if f.ratio > multiple]
    if bad and len(bad) < len(losses) and max(f.ratio for f in losses if f.ratio <= multiple) <= 1.0:
        return (f"only the loss{'es' if len(bad) > 1 else ''} of microbatch{'es' if len(bad) > 1 else ''} "
                f"{', '.join(f.name for f in bad)} differ{'' if len(bad) > 1 else 's'}: those microbatches travelled "
                f"differently (fed in another order, or their inputs, targets or per-microbatch kwargs are not the "
                f"whole batch's cut)")
    fits = [f.fit for f in bad]
    if bad and max(fits) - min(fits) < 1e-3 * abs(fits[0]) and abs(fits[0] - 1) > 1e-3:
        return (f"every microbatch's loss is the reference's times {fits[0]:.4g}: the loss is normalised or scaled "
                f"differently (a mean over each microbatch's own tokens instead of the batch's: check_token_step; "
                f"a loss divided twice)")
    if bad and len(bad) < len(losses):
        return (f"the losses of microbatches {', '.join(f.name for f in bad)} are outside their floors and every other "
                f"microbatch's moved too: something the whole batch goes through (a loss, a normalisation, the cut "
                f"of the batch), not those microbatches alone")
    if bad:
        return ("every microbatch's loss differs: the microbatches were cut differently from the whole batch (along "
                "a dim other than the batch: the layout, chunk_dim; per-microbatch kwargs), or the loss is not the "
                "reference's (normalisation, scaling)")
    return ("the losses match: what was done to the gradients after the backward (scale_grads, clipping, "
            "accumulation) or how they were gathered")


def summary(figures: list[Figure], multiple: float = NOISE_MULTIPLE) -> str:
    """The failure's first line: how many tensors are outside the noise, and the worst."""
    figures = [f for f in figures if f.kind in STEP_KINDS]
    bad = sorted((f for f in figures if f.ratio > multiple), key=lambda f: -f.ratio)
    worst = bad[0]
    what = f"microbatch {worst.name}'s loss" if worst.kind == "loss" else \
        "the output" if worst.kind == "output" else f"stage {worst.stage}'s {worst.name!r} gradient"
    return (f"{len(bad)} of {len(figures)} compared tensors are outside float noise (more than {multiple:g}x the "
            f"floor measured for this model and data); the worst, {what}, is {worst.ratio:.3g}x its floor "
            f"(error {worst.err:.3g}, floor {worst.floor:.3g})")
