"""What a failed check says: stage values held against the unsplit model's before anything else
(`stage_values`, `value_diff`), and where the step departs (`located_step`: each stage replayed by
labkit.check.boundaries against a float64 run of the whole unsplit model; `located_stages`: against
each rank's slices, check_stages; `say`: the sentence, for both).

May import: torch, labkit.check (noise, boundaries, inputs, fits, lean), labkit.spans
(compiled, received)."""

from __future__ import annotations

import dataclasses

import torch
from torch.overrides import TorchFunctionMode

from .boundaries import (Cut, Departure, Recorder, _why, first_tensor, held_modules, name_map, replay_stage,
                         sentence, stage_names, stage_rename, step_loss, up64)
from .noise import Figure, canonical, travel_hint


def say(departures: list[Departure], figures: list[Figure], said: str, reference: str = "the unsplit model",
        fed: tuple[list[str], set] | None = None) -> str:
    """The localisation first: what a stage received wrong (`fed`: labkit.check.inputs.findings), then
    where a stage's own code departs (or, when every stage computes as `reference`, what travelled
    wrong), then what the figures show (`said`)."""
    wrong, fed_stages = fed or ([], set())
    where = sentence(departures)
    departed = {d.stage for d in departures if d.what != "unreplayed"}
    if wrong:
        right = sorted(k for k in fed_stages if k not in departed)
        lead = "; ".join(wrong)
        if right:
            lead += (f": {'its module computes' if len(right) == 1 else 'their modules compute'} as {reference} "
                     f"when replayed on the reference's input (float64)")
        where = "; ".join(x for x in (lead, where) if x)
    elif not departed and any(d.what == "unreplayed" for d in departures):  # not known to compute right
        skipped = [d for d in departures if d.what == "unreplayed"]
        stages = sorted({d.stage for d in skipped})
        where = (f"{'stage' if len(stages) == 1 else 'stages'} {', '.join(map(str, stages))} could not be replayed "
                 f"on the reference's input ({skipped[0].detail})")
    elif not departed:
        hint = travel_hint(figures) if fed is not None else \
            travel_hint(figures) + " (what each stage received was not recorded: a process the kit did not start)"
        where = "; ".join(x for x in (where, f"every stage computes as {reference} when replayed on the reference's "
                                      f"input at its cut (float64): " + hint) if x)
    return f"{where}. Figures: {said}" if said else where


def fed_wrong(stages, x, kwargs, n_microbatches: int, chunk_dim: int, group) -> tuple[list[str], set] | None:
    """Collective: what each stage received against the reference's cut (labkit.check.inputs); None when no
    rank recorded anything (a process the kit did not start)."""
    from . import inputs

    rec = inputs.gather(stages, group)
    return inputs.findings(rec, x, kwargs, n_microbatches, chunk_dim) if rec else None


def located_step(c, figures: list[Figure], said: str) -> str:
    """check_step's failure localised (collective): the boundary figures are added to `figures`."""
    fed = fed_wrong(c.stages, c.x, c.kwargs, c.n_microbatches, c.chunk_dim, c.group)
    departures, boundary = localise_full(c)
    figures += boundary
    return say(departures, figures, said, fed=fed)


def held_by_stage(c) -> tuple[dict, dict]:
    """Collective over the pipeline (check_step's `_Call` c): this rank's name maps of its stages to the
    unsplit model's ({stage: rename}), and every stage's modules by the unsplit model's names ({stage:
    set}), every rank's gathered: where each stage's cut lies in a run of the unsplit model."""
    import torch.distributed as dist

    renames = {int(s.stage_index): stage_rename(s, c.prefix_stage_index, c.renamed) for s in c.stages}
    mine = {k: held_modules(s.submod, renames[k]) for s in c.stages for k in [int(s.stage_index)]}
    held = [None] * dist.get_world_size(c.group)
    dist.all_gather_object(held, mine, group=c.group)
    return renames, {k: set(v) for h in held for k, v in h.items()}


def localise_full(c) -> tuple[list[Departure], list[Figure]]:
    """Collective over the pipeline (check_step's `_Call` c, the whole unsplit model on every rank):
    this rank's stages replayed against a float64 run of the unsplit model; every rank gets every
    rank's departures and boundary figures."""
    from .noise import reference_copy

    renames, names = held_by_stage(c)
    deps, figs = [], []
    try:
        full64 = reference_copy(c.full).double().to(c.device)
        ref = Recorder(full64, keep_grad=True)
        x64, kw64, y64 = up64(c.x), {k: up64(v) for k, v in (c.kwargs or {}).items()}, up64(c.y)
        with torch.enable_grad():
            out = first_tensor(full64(x64, **kw64))
            loss = step_loss(c.loss_fn, y64, c.n_microbatches, c.chunk_dim) if c.loss_fn is not None else None
            if loss is not None:
                loss(out).backward()
        ref.remove()
    except Exception as e:  # noqa: BLE001
        deps = [Departure(int(s.stage_index), "unreplayed", "", detail="the unsplit model in float64: " + _why(e))
                for s in c.stages]
    else:
        truth = {n: p.grad for n, p in full64.named_parameters() if p.grad is not None}
        entry = {k: next((key for key in ref.inputs if key[0] in v), None) for k, v in names.items()}
        n_stages = max(names) + 1
        for s in c.stages:
            k = int(s.stage_index)
            nxt = ref.inputs.get(entry.get(k + 1)) if k + 1 < n_stages else None
            a_in = x64 if k == 0 else ref.inputs.get(entry[k])
            if a_in is None:
                deps.append(Departure(k, "unreplayed", "", detail="its input in the unsplit model was not found"))
                continue
            cut = Cut(a_in, kw64, out.detach() if k + 1 == n_stages else (nxt.detach() if nxt is not None else None),
                      None if nxt is None else nxt.grad, loss if k + 1 == n_stages else None)
            moved = c.values is None and c.grads is not None and stage_values(dataclasses.replace(c, stages=[s]))
            if moved:  # the stage is not at the checked step's weights: a replay would compare other weights
                deps.append(Departure(k, "unreplayed", "", detail="its weights are not the unsplit model's now (an "
                                      "optimizer step since the checked step?): pass values=, its parameters at "
                                      "the step"))
                continue
            try:
                dep, f = replay_stage(k, s.submod, renames[k], cut, ref, truth, backward=loss is not None,
                                      values=(c.values or {}).get(k))
            except Exception as e:  # noqa: BLE001  (a stage the replay cannot hold: said, never raised)
                dep, f = Departure(k, "unreplayed", "", detail=_why(e)), []
            deps += [dep] if dep is not None else []
            figs += f
    return gathered(deps, figs, c.group)


def gathered(deps: list[Departure], figs: list[Figure], group) -> tuple[list[Departure], list[Figure]]:
    """Collective: every rank's departures and boundary figures, on every rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, ([d.as_dict() for d in deps], [f.as_dict() for f in figs]), group=group)
    return [Departure(**d) for ds, _ in out for d in ds], [Figure(**f) for _, fs in out for f in fs]


def stage_values(c) -> list[str]:
    """This rank's stage parameters whose values are not the unsplit model's (cast to the stage's dtype,
    exactly): a weight loaded or copied wrong, named before any gradient. Sharded parameters (DTensor)
    are left to the gradients."""
    params = dict(c.full.named_parameters(remove_duplicate=False))
    out = []
    for s in c.stages:
        at_step = (c.values or {}).get(int(s.stage_index), {})
        for key, name, p in stage_names(s, c.prefix_stage_index):
            p = at_step.get(key.split(".", 1)[1] if c.prefix_stage_index else key, p)
            r = params.get(c.tied.get(name, c.renamed.get(name, name)))
            if r is not None and r.shape == p.shape and (diff := value_diff(p, r)) > 0:
                out.append(f"stage {s.stage_index}'s {name!r} (max diff {diff:.2g})")
    return out


def value_diff(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |mine - ref cast to mine's dtype|: 0 for a parameter that holds the reference's values (a
    cast copy included); 0 too for a sharded one (DTensor: left to the gradients)."""
    if hasattr(mine, "full_tensor") or hasattr(ref, "full_tensor") or not ref.numel() or mine.shape != ref.shape:
        return 0.0
    m = mine.detach().to(ref.device)
    return float((m.double() - ref.detach().to(m.dtype).double()).abs().max())


def compiled_counts(c) -> dict | None:
    """What dynamo did in this process so far (since it started, or since torch._dynamo.reset()), when a
    stage of this rank is compiled (torch.compile's wrapper, or `module.compile()` in place); else None."""
    compiled = any(hasattr(s.submod, "_orig_mod") or any(getattr(m, "_compiled_call_impl", None) is not None
                                                         for m in s.submod.modules()) for s in c.stages)
    if not compiled:
        return None
    from ..spans import compiled as dynamo

    return dynamo.delta(None, dynamo.snapshot())


def compile_notes_of(per_rank: list) -> list[str]:
    """The check's notes on compiled stages that did not run compiled: a frame at dynamo's recompile
    limit (or one it could not compile) runs eagerly, silently (labkit.spans.compiled)."""
    from ..spans.compiled import compile_notes

    counts = {str(r): v for r, v in enumerate(per_rank) if v is not None}
    return [f"torch.compile, {n} (counted since the rank's process started or torch._dynamo.reset())"
            for n in compile_notes(counts, fell_back_only=True)]


@dataclasses.dataclass
class Ran:
    """What one forward of a stage module did (`what_ran`): the names of its own submodules that ran, and of
    its parameters that an operation took and made a tensor from (read for a shape or a dtype: not used)."""

    modules: set[str]
    used: set[str]


class _Uses(TorchFunctionMode):
    """Every operation of a forward, seen as it runs (torch.overrides): which of `names` ({id of a tensor:
    its parameter names}) it took as an argument, where what it returned holds a tensor."""

    def __init__(self, names: dict[int, set[str]]):
        super().__init__()
        self.names, self.used = names, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if next(_tensors(out), None) is not None:
            for t in _tensors((args, kwargs or {})):
                self.used |= self.names.get(id(t), set())
        return out


def _tensors(v):
    """The tensors in `v`, inside tuples (torch's named ones too), lists and dicts."""
    if torch.is_tensor(v):
        yield v
    elif isinstance(v, (tuple, list, dict)):
        for item in v.values() if isinstance(v, dict) else v:
            yield from _tensors(item)


def what_ran(stage, x, kwargs, n_microbatches: int, chunk_dim: int = 0) -> Ran | None:
    """One forward of the stage module on microbatch 0's shapes (stage 0: its cut of `x`; a later stage:
    random values of the shapes and dtypes it received in the step, labkit.spans.received), eager, under
    no_grad, with its buffers restored after: which of its submodules ran and which of its parameters
    they used. None when it cannot be told (nothing recorded, a kwarg the check was not given, a forward
    that fails on such values)."""
    from ..spans import received
    from .noise import chunk_kwargs

    received.settle()
    first = (getattr(stage, received.ATTR, None) or {}).get(0)
    if first is None:
        return None
    dev = torch.device(stage.device) if getattr(stage, "device", None) is not None else torch.device("cpu")
    if int(stage.stage_index) == 0 and torch.is_tensor(x):
        args = [x.chunk(n_microbatches, dim=chunk_dim)[0].to(dev)]
    else:
        args = []
        for fp in first["args"]:
            if fp[0] != "tensor":
                return None
            dtype = getattr(torch, fp[2])
            args.append(torch.randn(fp[1], dtype=dtype, device=dev) if dtype.is_floating_point
                        else torch.zeros(fp[1], dtype=dtype, device=dev))
    size = x.shape[chunk_dim] if torch.is_tensor(x) and x.dim() > chunk_dim else 0
    cut = chunk_kwargs(kwargs or {}, size, n_microbatches, chunk_dim)[0] if kwargs else {}
    if any(k not in cut for k in first["kwargs"]):
        return None
    kw = {k: cut[k].to(dev) if torch.is_tensor(cut[k]) else cut[k] for k in first["kwargs"]}
    ran, names = set(), {}
    for n, p in stage.submod.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(n)

    def entered(mod, _args, n):  # the parameters as the module holds them when it runs (FSDP swaps them in)
        for own, p in mod.named_parameters(recurse=False):
            names.setdefault(id(p), set()).add(f"{n}.{own}" if n else own)

    hooks = [h for n, m in stage.submod.named_modules() for h in (
        m.register_forward_pre_hook(lambda mod, a, n=n: entered(mod, a, n)),
        m.register_forward_hook(lambda mod, a, o, n=n: ran.add(n)))]
    kept = {n: b.detach().clone() for n, b in stage.submod.named_buffers()}
    uses = _Uses(names)
    try:  # eager: a compiled stage's code is not compiled again for this forward (nor its counts moved)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"), uses:
            stage.submod(*args, **kw)
    except Exception:  # noqa: BLE001  (values a forward does not take: not told)
        return None
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for n, b in stage.submod.named_buffers():
                if n in kept:
                    b.copy_(kept[n])
    return Ran(ran, uses.used)


CUT_OFF = "a .detach(), torch.no_grad(), a value replaced after it"


def why_no_grad(own_name: str, param: torch.Tensor, ran: Ran | None) -> str:
    """Why a parameter the unsplit model gives a gradient got none on the stage, from one forward of the
    stage (`what_ran`): its module never ran; it ran and used the parameter, but its output was cut off
    from the loss; it ran and never used the parameter."""
    owner = own_name.rpartition(".")[0]
    if not param.requires_grad:
        return "it does not require grad on the stage (requires_grad=False there, not in the unsplit model)"
    if ran is None:
        return ("its module did not run in the stage's forward, ran without using it, or its output was cut off "
                f"from the loss ({CUT_OFF}): which, a forward on the step's shapes could not tell")
    if own_name in ran.used:
        who = "its module ran in the stage's forward and used it" if owner in ran.modules else \
            "the stage's forward used it (its module never ran)"
        return f"{who}, but its output was cut off from the loss ({CUT_OFF})"
    if owner in ran.modules:
        return "its module ran in the stage's forward but never used it (its forward computes without this parameter)"
    return "its module never ran in the stage's forward (a layer skipped or left out of the stage's forward)"


def _cut64(run, cut: Cut, last: bool) -> Cut:
    """T's cut in float64 on the slices' device, for the replay (T may have run in float32, on the host)."""
    to64 = lambda v: up64(v).to(run.device) if torch.is_tensor(v) else v  # noqa: E731
    loss = step_loss(run.loss_fn, to64(run.y), run.n_microbatches, run.chunk_dim) if last else None
    return Cut(to64(cut.a_in), {n: to64(v) for n, v in cut.kwargs.items()}, None, to64(cut.grad_out), loss)


def located_stages(run, cuts: dict, figures: list[Figure], said: str, *, values: dict | None = None,
                   live: bool = True, out: dict | None = None) -> str:
    """check_stages' failure localised (its `_Run` run; `cuts`: {stage: T's Cut there}): each of this rank's
    stages replayed in float64 on T's input at its cut, against its slice in float64 (collective: every
    rank gets every departure), after what each stage received against the reference's cut
    (labkit.check.inputs). A replay that cannot fit on the rank is said, not run (labkit.check.fits).
    `values`: {stage: {name in its module: tensor}}, the stages' parameters at the step where they moved on
    since (the run watch's, after the optimizer's step); `live` False: what each stage received is not this
    step's (not compared); `out` (a dict) gets "fed" and "departures" (every rank's)."""
    from .fits import replay_too_large
    from .lean import copy64

    fed = fed_wrong(run.stages, run.x, run.kwargs, run.n_microbatches, run.chunk_dim, run.group) if live \
        else ([], set())
    deps, figs = [], []
    for s in run.stages:
        k = int(s.stage_index)
        cut = _cut64(run, cuts[k], k + 1 == run.n_stages)
        wide = cut.grad_out if torch.is_tensor(cut.grad_out) else cut.a_in  # stage 0's input: token ids
        too_large = replay_too_large([run.slices[k], s.submod], wide, run.device)
        if too_large:  # said instead of an out-of-memory kill (labkit.check.fits)
            deps.append(Departure(k, "unreplayed", "", detail=too_large))
            continue
        ref64 = copy64(run.slices[k])
        rec = Recorder(ref64, lambda n: canonical(n + ".").rstrip(".") or None, keep_grad=True)
        a = cut.a_in.clone().requires_grad_(k > 0 and cut.a_in.is_floating_point())
        try:
            with torch.enable_grad():
                o = first_tensor(ref64(a, **cut.kwargs))
                cut.out = o.detach()  # T's output at this cut: its slice in float64 on T's input
                cut.loss(o).backward() if cut.loss is not None else o.backward(cut.grad_out)
        except Exception as e:  # noqa: BLE001
            deps.append(Departure(k, "unreplayed", "", detail=f"its slice: {_why(e)}"))
            continue
        finally:
            rec.remove()
        pairs = [(n, canonical(n)) for n, _ in s.submod.named_parameters()]
        truth_grads = {canonical(n): p.grad for n, p in ref64.named_parameters() if p.grad is not None}
        try:
            dep, f = replay_stage(k, s.submod, name_map(s.submod, pairs), cut, rec, truth_grads,
                                  values=(values or {}).get(k))
        except Exception as e:  # noqa: BLE001  (a stage the replay cannot hold: said, never raised)
            dep, f = Departure(k, "unreplayed", "", detail=_why(e)), []
        deps += [dep] if dep is not None else []
        figs += f
    departures, boundary = gathered(deps, figs, run.group)
    figures += boundary
    if out is not None:
        out.update(fed=fed, departures=departures)
    return say(departures, figures, said, "its slice of the unsplit model", fed=fed)
