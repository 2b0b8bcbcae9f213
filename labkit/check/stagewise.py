"""The step check for a model no rank holds whole: `check_stages`.

`check_step` needs the WHOLE unsplit model on every rank, plus its float64 copy: a model that needs
pipelining does not fit there. `check_stages` needs only each rank's slices of it: `slices` maps each
stage this rank holds to the user's own layers for that stage, computing as the unsplit model does
(built from the same seed or loaded from the same checkpoint, never the stage module itself). The
reference then runs as a chain along the pipeline, whole batch, stage after stage: each rank runs its
slices and sends the activation at each cut to the next stage's rank, then the gradients back. Three
chains, as check_step's three references (labkit.check.noise): in the step's dtype and autocast
(R), microbatch by microbatch (C), in float64 (T; float32 for a 16-bit step). The losses, every
gradient and every value are judged against their measured floors as check_step judges them; a failure
is localised by the same float64 replay of each stage on T's input at its cut (labkit.check.boundaries,
labkit.check.located), against the slice.

No rank holds more than its own slices, one reference's gradients of them (C's sums, then R's: R reads
C's against its own as it makes each and frees it), one block's graph at a time (labkit.check.lean:
each block checkpointed, T cast to its dtype module by module as it runs, each gradient read as it is
made; T's backward a microbatch's piece of the batch at a time where a layer treats samples apart:
labkit.check.pieces) and the whole-batch activations at its own cuts. Taught in notebook 09b; measured in
bench/RESULTS.md.

May import: torch, labkit.check (noise, calls, boundaries, compiled_floor, fits, lean, located, reference's Check)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from . import fits
from .boundaries import Cut, first_tensor, step_loss
from .compiled_floor import is_compiled, probe
from .lean import checkpointed, copy_to, give_back, read_as_made
from .calls import CheckStepError, _batch_problems, _loss_problems, _stage_problems
from .located import located_stages, value_diff, what_ran, why_no_grad
from .noise import NOISE_MULTIPLE, Figure, autocast_ctx, canonical, chunk_kwargs, figure, max_abs_diff, where
from .reference import Check


def check_stages(slices: dict[int, nn.Module], stages, x, y, losses, n_microbatches: int, loss_fn, *,
                 autocast: torch.dtype | None = None, kwargs: dict | None = None, device=None, chunk_dim: int = 0,
                 group=None) -> Check:
    """Collective (call it on EVERY rank of the pipeline): one pipelined step against ONE forward and
    backward of the unsplit model on the WHOLE batch, where no rank holds the unsplit model.

    slices: {stage_index: this rank's slice of the unsplit model for that stage} for every stage this
    rank holds, with the stage module's parameter names (a wrapper's prefix aside) and shapes, built
    as the unsplit model's layers are (same seed or checkpoint), never from the stage module;
    stages: this rank's PipelineStages; x, y: the whole batch (every rank); losses: the `losses` list
    the schedule filled (the last stage's rank; empty elsewhere); loss_fn: the schedule's loss;
    autocast: the dtype the step ran under (`labkit.autocast`); kwargs: the slices' other inputs for
    the whole batch (every slice gets them; cut per microbatch along `chunk_dim` where they have the
    batch's size); group: the pipeline's process group when the ranks run several pipelines.
    Returns a Check as check_step's (figures, where, values). A call that cannot be compared (a slice
    whose names or shapes do not match its stage, a stage held by no rank or twice, losses on the wrong
    rank, a wrong microbatch count) raises CheckStepError on EVERY rank before any other collective."""
    device = device if device is not None else (stages[0].device if stages else "cpu")
    run = _Run(dict(slices), list(stages), x, y, list(losses or []), n_microbatches, loss_fn, autocast,
               kwargs or {}, torch.device(device), chunk_dim, group)
    _agree(run)
    return _decide(run, references(run))


def references(run: _Run) -> dict[str, _Chain]:
    """The three chains of an agreed `run` (`_agree`), collective: {"C", "R", "T"}, each rank holding what its
    slices give (R's gradients, C's and T's differences from them, the losses on the last stage's rank, T's cuts).
    check_stages' and the run watch's with slices= (labkit.check.gradients)."""
    # C first, its gradients summed; R reads each of them against its own as it makes it and frees it, so that
    # a rank never holds two references' gradients at once (labkit.check.lean; bench/RESULTS.md)
    refs = {"C": _chain(run, "C")}
    give_back()
    refs["R"] = _chain(run, "R", against=refs["C"])
    give_back()
    if run.compiled is not None:
        for k, (a0, kw0, grad0, loss0) in refs["R"].mb0.items():
            s = run.stage(k)
            if is_compiled(s.submod):
                got = probe(s.submod, a0, kw0, grad0, loss0, autocast_ctx(run.device, run.autocast))
                run.compiled.update({(k, canonical(n)): v for n, v in got.items()})
        refs["R"].mb0.clear()
    refs["T"] = _chain(run, "T", against=refs["R"])
    give_back()
    return refs


@dataclass
class _Run:
    slices: dict
    stages: list
    x: object
    y: object
    losses: list
    n_microbatches: int
    loss_fn: object
    autocast: object
    kwargs: dict
    device: torch.device
    chunk_dim: int
    group: object
    holders: dict = field(default_factory=dict)
    seen: set = field(default_factory=set)
    """{(stage, module name of its slice)} that ran in R: T casts each of them as it runs
    (labkit.check.lean.checkpointed)."""
    truth_dtype: torch.dtype = torch.float64
    """T's dtype: float64, or float32 where every rank's step computes in 16 bits (`_sixteen`)."""
    compiled: dict | None = None
    """None: no stage of the pipeline is compiled; else {(stage, name): what compiling changed in this
    rank's compiled stages' gradients ("" : the loss)}, labkit.check.compiled_floor."""
    """{stage index: the group rank that holds it}, agreed by `_agree`."""

    @property
    def n_stages(self) -> int:
        return len(self.holders)

    def stage(self, k: int):
        return next(s for s in self.stages if int(s.stage_index) == k)


def _slice_problems(run: _Run) -> list[str]:
    """This rank's slices against its stages: one per stage held, the same names and shapes, not the
    stage module's own parameters."""
    held = sorted(int(s.stage_index) for s in run.stages)
    if sorted(run.slices) != held:
        return [f"a rank holds stage{'s' if len(held) > 1 else ''} {held} but passed slices for {sorted(run.slices)}: "
                f"pass slices={{stage_index: that stage's slice of the unsplit model}} for each stage it holds."]
    problems = []
    for s in run.stages:
        k, sl = int(s.stage_index), run.slices[int(s.stage_index)]
        mine = {canonical(n): p for n, p in s.submod.named_parameters()}
        theirs = {canonical(n): p for n, p in sl.named_parameters()}
        if {id(p) for p in mine.values()} & {id(p) for p in theirs.values()}:
            problems.append(f"stage {k}'s slice shares parameters with the stage module: build the slice as the "
                            f"unsplit model's layers are built (same seed or checkpoint), not from the stage.")
        only = sorted(set(mine) ^ set(theirs))
        if only:
            side = "the stage" if only[0] in mine else "the slice"
            problems.append(f"stage {k}'s slice and stage module name their parameters differently ({len(only)} "
                            f"name(s) in one only, e.g. {only[0]!r} in {side}): the slice must hold that stage's "
                            f"layers under the same names.")
        problems += [f"stage {k}'s {n!r} has shape {list(p.shape)} on the stage, {list(theirs[n].shape)} in the "
                     f"slice." for n, p in mine.items() if n in theirs and theirs[n].shape != p.shape][:2]
    return problems


def _agree(run: _Run) -> None:
    """Every rank's report gathered once; the same CheckStepError on every rank when the call cannot
    be compared. Sets run.holders."""
    report = {"stages": sorted(int(s.stage_index) for s in run.stages), "last": any(s.is_last for s in run.stages),
              "num_stages": max((int(getattr(s, "num_stages", 0) or 0) for s in run.stages), default=0),
              "chunks": sorted({int(c) for s in run.stages if (c := getattr(s, "chunks", None)) is not None}),
              "n_losses": len(run.losses), "has_output": False, "n_extra": 0,
              "batch": tuple(run.y.shape) if torch.is_tensor(run.y) else None, "slices": _slice_problems(run),
              "compiled": any(is_compiled(s.submod) for s in run.stages), "sixteen": _sixteen(run),
              "too_large": fits.stages_too_large(run.slices, run.device, _sixteen(run))}
    reports = [None] * dist.get_world_size(run.group)
    dist.all_gather_object(reports, report, group=run.group)
    ranks = [dist.get_global_rank(run.group, r) if run.group is not None else r for r in range(len(reports))]
    problems = [] if run.loss_fn is not None else ["check_stages compares a training step: pass the schedule's "
                                                     "loss_fn (forward-only steps: check_step with output=)."]
    problems += [f"rank {ranks[r]}: {p}" for r, rep in enumerate(reports) for p in rep["slices"]]
    problems += _batch_problems(reports, run.n_microbatches if isinstance(run.n_microbatches, int) else None,
                                run.loss_fn, run.chunk_dim)
    problems += _stage_problems(reports, ranks, run.group)
    problems += _loss_problems(reports, ranks, run.n_microbatches, run.loss_fn)
    problems += [f"rank {ranks[r]}: {rep['too_large']}" for r, rep in enumerate(reports) if rep["too_large"]][:1]
    if problems:
        raise CheckStepError("check_stages cannot compare this step (the same on every rank of the pipeline):\n"
                             + "\n".join(f"  - {p}" for p in dict.fromkeys(problems)))
    run.holders = {k: r for r, rep in enumerate(reports) for k in rep["stages"]}
    run.compiled = {} if any(rep["compiled"] for rep in reports) else None
    run.truth_dtype = torch.float32 if all(rep["sixteen"] for rep in reports) else torch.float64


def _sixteen(run: _Run) -> bool:
    """Whether this rank's step computes in 16 bits (its slices' parameters, or its autocast): then T computes
    in float32, whose rounding is 2^16 times finer than bfloat16's (2^13 than float16's), so R's own error
    reads the same, in half float64's bytes (a 1B bfloat16 Llama: bench/RESULTS.md). T's gradients reach
    the parameters rounded to their dtype either way (labkit.check.lean.checkpointed)."""
    low = (torch.bfloat16, torch.float16)
    dtypes = {p.dtype for sl in run.slices.values() for p in sl.parameters() if p.is_floating_point()}
    return run.autocast in low or (bool(dtypes) and dtypes <= set(low))


@dataclass
class _Chain:
    """One reference chain's results on this rank: the losses (last stage), each of its slices'
    gradients (R; C's summed over its microbatches until R reads them) or only what the figures read of
    them against R's (C: max|C - R|, T: max|T - R|, per parameter: each freed as soon as it is read), and,
    for T, what the replay of a failed check needs at each of its cuts."""

    losses: list[float] = field(default_factory=list)
    grads: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    """{(stage index, parameter name in the slice): its gradient} (R; C's sums until R has read them)."""
    diffs: dict[tuple[int, str], float] = field(default_factory=dict)
    """{(stage index, name): max |this chain's gradient - R's|} (C, filled by R, and T)."""
    cuts: dict[int, Cut] = field(default_factory=dict)
    mb0: dict[int, tuple] = field(default_factory=dict)
    """R, where a stage is compiled: {stage: (microbatch 0's input at its cut, its kwargs, the gradient at
    its output for that microbatch alone or None, its loss or None)}, for labkit.check.compiled_floor."""


def _send(run: _Run, obj, k: int) -> None:
    dst = run.holders[k]
    dist.send_object_list([obj], dst=dist.get_global_rank(run.group, dst) if run.group is not None else dst,
                          group=run.group)


def _recv(run: _Run, k: int, device):
    box, src = [None], run.holders[k]
    dist.recv_object_list(box, src=dist.get_global_rank(run.group, src) if run.group is not None else src,
                          group=run.group)
    return box[0].to(device) if torch.is_tensor(box[0]) else box[0]


def _chain(run: _Run, mode: str, against: _Chain | None = None) -> _Chain:
    """The unsplit model run along the pipeline on the whole batch: "C" microbatch by microbatch (one
    microbatch's graph at a time, its gradients summed as made, one buffer a parameter), "R" in the step's
    dtype and autocast (it keeps its gradients, reading C's sums against each as it makes it: `against`),
    "T" in run.truth_dtype (float64, or float32 for a 16-bit step; read against R's, `against`, keeping only
    the differences). Activations go forward from stage to stage, their gradients back. The whole-batch
    chains keep only each block's input in their graph (`lean.checkpointed`: each block recomputed in the
    backward, the same numbers). On a GPU, C and T
    run on the host, and R keeps its gradients there (the device then holds only R's graph:
    labkit.check.inputs' docstring), each block's recomputation saving its tensors on the host too
    (labkit.check.pieces, offload)."""
    m, out, d = run.n_microbatches, _Chain(), run.chunk_dim
    host = run.device.type == "cuda" and mode != "R"
    dev = torch.device("cpu") if host else run.device
    # T computes in its dtype without a copy of the slices in it (lean.checkpointed(upcast=...))
    mods = {k: copy_to(sl, dev) if host else sl for k, sl in run.slices.items()}
    truth = run.truth_dtype if mode == "T" else None
    move = lambda v: (v.to(truth) if truth is not None and v.is_floating_point() else v).to(dev) \
        if torch.is_tensor(v) else v  # noqa: E731
    x, y, kw = move(run.x), move(run.y), {k: move(v) for k, v in run.kwargs.items()}
    ctx = autocast_ctx(dev, None if mode == "T" else run.autocast)
    if mode != "C":
        on_grad = _keep_reading(out, against, m) if mode == "R" else \
            (lambda key, g: out.diffs.__setitem__(key, _diff(g, against.grads.get(key))))
        # T in pieces where they lower its peak; R on a GPU with its recomputations' saved tensors on the host
        with checkpointed(mods, upcast=truth, seen=run.seen, pieces=m, dim=d, offload=dev.type == "cuda"):
            _pass(run, mods, x, kw, lambda o: [run.loss_fn(a, b) for a, b in zip(o.chunk(m, dim=d), y.chunk(m, dim=d))],
                  ctx, dev, out, on_grad, cuts=mode == "T", y=y, mode_r=mode == "R")
        if mode == "R":  # C's sums for parameters R gave no gradient: not compared (nan), freed
            against.diffs.update({key: float("nan") for key in against.grads})
            against.grads.clear()
        return out
    size = x.shape[d] if torch.is_tensor(x) and x.dim() > d else 0
    xs, ys, acc = x.chunk(m, dim=d), y.chunk(m, dim=d), out.grads

    def add(key, g):  # each microbatch's gradient summed as the backward makes it (one buffer a parameter)
        acc[key] = acc[key].add_(g) if key in acc else g

    for i, kwi in enumerate(chunk_kwargs(kw, size, m, d)):
        part = _Chain()
        _pass(run, mods, xs[i], kwi, lambda o, i=i: [run.loss_fn(o, ys[i])], ctx, dev, part, add, mean=False)
        out.losses += part.losses
    return out


def _keep_reading(out: _Chain, summed: _Chain, m: int):
    """R's on_grad: each gradient kept (on the host when R runs on a GPU), and C's sum for the same parameter
    read against it, over the microbatch count as the schedules' scale_grads, then freed."""
    def on_grad(key, g):
        g = g.detach().cpu() if g.device.type == "cuda" else g.detach()
        out.grads[key] = g
        c = summed.grads.pop(key, None)
        if c is not None:
            summed.diffs[key] = _diff(c.div_(m), g)
    return on_grad


def _diff(g, r) -> float:
    """max |g - r| in float64, piece by piece (0.0 for an empty tensor; nan where R has no gradient: not
    compared)."""
    return float("nan") if r is None else max_abs_diff(g, r)


def _pass(run: _Run, mods: dict, x, kw: dict, losses_of, ctx, dev, out: _Chain, on_grad, cuts: bool = False,
          y=None, mean: bool = True, mode_r: bool = False) -> None:
    """One forward and backward of this rank's slices along the chain on one input (the whole batch or a
    microbatch): the losses into `out` (last stage), T's cuts when `cuts`. `on_grad(key, gradient)`: each
    parameter's gradient handed over the moment the backward has it, then dropped by the parameter
    (`lean.read_as_made`), keyed by (stage, name): two stages of one rank may name their parameters alike
    (each built from one block class: 'lin.weight' on stage 0 and on stage 4), and never share one."""
    me, graph = dist.get_rank(run.group), {}
    for k in range(run.n_stages):
        if run.holders[k] != me:
            continue
        a = x if k == 0 else (graph[k - 1][1] if run.holders[k - 1] == me else _recv(run, k - 1, dev))
        a = a.detach().requires_grad_(True) if a.is_floating_point() else a
        with torch.enable_grad(), ctx:
            o = first_tensor(mods[k](a, **kw))
        graph[k] = (a, o)
        if k + 1 < run.n_stages and run.holders[k + 1] != me:
            _send(run, o.detach().cpu(), k + 1)
    for k in reversed(range(run.n_stages)):
        if run.holders[k] != me:
            continue
        a, o = graph[k]
        if k + 1 == run.n_stages:
            with torch.enable_grad(), ctx:
                per = losses_of(o)
            out.losses += [float(v.detach()) for v in per]
            root, grad_out = (torch.stack(per).mean() if mean else per[0]), None
        else:
            grad_out = graph[k + 1][2] if run.holders[k + 1] == me else _recv(run, k + 1, dev)
            root = o
        params = [(n, p) for n, p in mods[k].named_parameters() if p.requires_grad]
        leaves = [a] if k > 0 and a.requires_grad else []
        a_grad = read_as_made(k, root, grad_out, leaves, params, on_grad)
        graph[k] = (a, None, a_grad)
        if run.compiled is not None and mode_r:
            m, d, last = run.n_microbatches, run.chunk_dim, k + 1 == run.n_stages
            size = a.shape[d] if a.dim() > d else 0
            y0 = y.chunk(m, dim=d)[0] if last else None
            out.mb0[k] = (a.detach().chunk(m, dim=d)[0], chunk_kwargs(kw, size, m, d)[0] if kw else {},
                          None if last else grad_out.chunk(m, dim=d)[0] * m,
                          (lambda o, y0=y0: run.loss_fn(o, y0)) if last else None)
        if k > 0 and run.holders[k - 1] != me:
            _send(run, a_grad.detach().cpu() if a_grad is not None else None, k - 1)
        if cuts:
            last = k + 1 == run.n_stages
            # the output at the cut is not kept: a failed check's replay recomputes it (`_located`), a passing
            # one never reads it (an LM's float64 logits)
            out.cuts[k] = Cut(a.detach(), kw, None, None if last else grad_out,
                              step_loss(run.loss_fn, y, run.n_microbatches, run.chunk_dim) if last else None)


def _compare(run: _Run, refs: dict) -> tuple[list[Figure], list[str], list[str], int, float]:
    """This rank's figures (losses on the last stage's rank, every stage parameter's gradient), stage
    parameters whose values are not the slice's, parameters with no gradient, the elements compared
    and the largest absolute gradient or loss difference."""
    R, C, T = refs["R"], refs["C"], refs["T"]
    figs, values, no_grad, numel, worst, ran = [], [], [], 0, 0.0, None
    for s in run.stages:
        k = int(s.stage_index)
        theirs = {canonical(n): p for n, p in run.slices[k].named_parameters()}
        for n, p in s.submod.named_parameters():
            name = canonical(n)
            d = value_diff(p, theirs[name])
            if d > 0:
                values.append(f"stage {k}'s {name!r} (max diff {d:.2g})")
            g, r = p.grad, R.grads.get((k, name))
            if g is None and r is not None:
                if ran is None or ran[0] is not s:
                    ran = (s, what_ran(s, run.x, run.kwargs, run.n_microbatches, run.chunk_dim))
                no_grad.append(f"stage {k}'s {name!r} ({why_no_grad(n, p, ran[1])})")
                continue
            if g is None or r is None:
                continue
            worst = max(worst, float((g.to(r.device) - r).abs().max()))
            figs.append(figure("grad", name, k, g, r, None, run.n_microbatches, reorder=C.diffs.get((k, name), 0.0),
                               own=T.diffs.get((k, name)), compiled=_compiled(run, k, name)))
            numel += p.numel()
    if any(s.is_last for s in run.stages):
        f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        mine = [float(v.detach()) if torch.is_tensor(v) else float(v) for v in run.losses]
        dtype = next(run.slices[run.n_stages - 1].parameters()).dtype
        figs += [figure("loss", str(i), run.n_stages - 1, f64(p), f64(r), f64(c), 1, dtype, f64(t),
                        compiled=_compiled(run, run.n_stages - 1, ""))
                 for i, (p, r, c, t) in enumerate(zip(mine, R.losses, C.losses, T.losses))]
        worst = max([worst] + [abs(p - r) for p, r in zip(mine, R.losses)])
    return figs, values, no_grad, numel, worst


def _compiled(run: _Run, k: int, name: str) -> float | None:
    """What compiling measured for stage k's `name` ("": the loss), 0.0 where nothing was measured in a
    compiled pipeline, None where no stage is compiled (labkit.check.compiled_floor)."""
    return None if run.compiled is None else run.compiled.get((k, name), 0.0)


def _decide(run: _Run, refs: dict) -> Check:
    """Every rank's figures gathered over the pipeline, the one verdict, and on failure where."""
    figs, values, no_grad, numel, worst = _compare(run, refs)
    expected = sum(p.numel() for sl in run.slices.values() for p in sl.parameters())
    gathered = [None] * dist.get_world_size(run.group)
    mine = [float(v.detach()) if torch.is_tensor(v) else float(v) for v in run.losses]
    dist.all_gather_object(gathered, ([f.as_dict() for f in figs], values, no_grad, numel, expected, worst,
                                      refs["R"].losses, mine), group=run.group)
    figures = [Figure(**f) for g in gathered for f in g[0]]
    values, no_grad = [v for g in gathered for v in g[1]], [n for g in gathered for n in g[2]]
    compared, expected = sum(g[3] for g in gathered), sum(g[4] for g in gathered)
    diff = max(g[5] for g in gathered)
    ref_losses = next(g[6] for g in gathered if g[6])
    losses = next(g[7] for g in gathered if g[7])
    ok = bool(compared == expected and not values and not no_grad and all(f.ratio <= NOISE_MULTIPLE for f in figures))
    said = "" if ok else where(figures, autocast=run.autocast)
    if not ok and not values and not no_grad:
        said = located_stages(run, refs["T"].cuts, figures, said)
    ldiff = max((abs(p - r) for p, r in zip(losses, ref_losses)), default=0.0)
    return Check(ok, diff, compared, expected, losses, ref_losses, ldiff, diff, 0.0, None, [[] for _ in gathered],
                 figures, NOISE_MULTIPLE, said, no_grad, [], values)
