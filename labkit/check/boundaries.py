"""Where a failed step departs: each stage replayed on the reference's input at its cut.

Gradient ratios cannot localise a bug: a forward bug in stage 1 moves stage 0's gradients too (they
are computed from it), and small parameters (LayerNorm biases) have tiny floors, so their ratios
explode wherever the bug is. Activations at the cuts can. For each stage:

1. its input is the reference's activation at its cut (the unsplit model's, whole batch; stage 0 gets
   the batch itself), and its module (a copy, in float64) is run on it, every submodule hooked;
2. each submodule's input and output, in the order they ran, are held against the reference's
   module of the same name (the unsplit model's names: `blocks.2`, then `blocks.2.down`): the first
   one that departs names the bug (a module whose output departs while its input agrees: its forward;
   a module whose input departs while everything before agreed: its parent's code between them);
3. the stage's output against the reference's activation at the next cut, and, given the
   reference's gradient at that cut, the gradient it sends back and its parameters' gradients
   (a backward-only bug).

float64, whatever dtype the step ran in: a bug in a stage's code shows in float64 too, where rounding
is ~1e-16 of a value. A correct stage computes the same operations on the same input as the
reference, so it agrees to a few float64 ulps; REPLAY_RTOL (1e-9 of the tensor's largest value) is
the floor, far above that and far below any bug a float32 or bf16 check can see. When every stage
agrees, the fault lies outside the stages: how microbatches or activations travelled, or the loss.

Used by check_step (labkit.check.reference: the whole unsplit model on every rank) and check_stages
(labkit.check.stagewise: each rank's slices only). Taught in notebook 09b.

May import: torch, labkit.check.noise."""

from __future__ import annotations

import copy
import types
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from .noise import NOISE_MULTIPLE, Figure, canonical

REPLAY_RTOL = 1e-9
"""The floor of a float64 replay, relative to the tensor's largest value (see the module's docstring)."""


@dataclass
class Departure:
    """The first place a stage's replay departs from the reference (or why it could not be replayed)."""

    stage: int
    what: str      # "forward" | "between" | "output" | "input-grad" | "grad" | "unreplayed"
    module: str    # the reference's name of the module ('' for the stage's own code)
    ratio: float = 0.0
    before: str = ""   # the last module that agreed (what == "between")
    detail: str = ""   # why a stage could not be replayed

    def as_dict(self) -> dict:
        return asdict(self)

    def sentence(self) -> str:
        s, r = f"stage {self.stage}", f"{self.ratio:.2g}x its floor"
        if self.what == "forward":
            return (f"{s} departs at {self.module}: its output is {r} while its input agrees; the bug is in "
                    f"that module's forward")
        if self.what == "between":
            parent = self.module.rpartition(".")[0] or "the stage module"
            after = f" after {self.before}" if self.before else ""
            return (f"{s} departs inside {parent}: the input of {self.module} is {r} while every module before "
                    f"it agrees; the bug is in {parent}'s own forward{after} (a residual, a reshape, a skipped "
                    f"or repeated step)")
        if self.what == "output":
            return (f"{s}'s output is {r} while every module inside it agrees: the bug is in the stage's own "
                    f"forward after its last module (what it returns or sends)")
        if self.what == "input-grad" and self.module:
            return (f"{s}'s forward agrees, but the gradient at the input of {self.module} is {r} while every "
                    f"gradient after it agrees: a backward-only bug in {self.module} (a backward hook, a custom "
                    f"autograd function, a detach)")
        if self.what == "input-grad":
            return (f"{s}'s forward and every module's gradient agree, but the gradient it sends back is {r}: a "
                    f"backward-only bug in the stage's own code (a backward hook on the stage, a detach)")
        if self.what == "grad":
            return (f"{s}'s forward agrees, but the gradient of {self.module} is {r}: a backward-only bug there "
                    f"(a hook on it, a custom autograd function, a gradient scaled or dropped)")
        return f"{s} could not be replayed on the reference's input ({self.detail})"


def boundary_figure(kind: str, name: str, stage: int, mine: torch.Tensor, ref: torch.Tensor) -> Figure:
    """A float64 replay's tensor against the reference's, as a Figure (floor REPLAY_RTOL of its scale)."""
    mine, ref = mine.detach().double(), ref.detach().double().to(mine.device)
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((mine - ref).abs().max()) if ref.numel() else 0.0
    floor = max(REPLAY_RTOL * scale, torch.finfo(torch.float64).tiny)
    rr = float((ref * ref).sum())
    fit = float((mine * ref).sum()) / rr if rr > 0 else 1.0
    return Figure(kind, name, stage, err, floor, scale, err / floor, fit, 0.0, None)


def first_tensor(obj):
    """The first tensor in a module's input or output (a tensor, a tuple, a dict, a ModelOutput)."""
    if torch.is_tensor(obj):
        return obj
    if hasattr(obj, "to_tuple"):
        obj = obj.to_tuple()
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in items:
        t = first_tensor(v)
        if t is not None:
            return t
    return None


class Recorder:
    """Hooks on every submodule of `model`: each call's first tensor input and output, by the
    reference's name (`rename(name)`; None: not recorded), in the order they ran. `keep_grad`: the
    inputs keep their gradient (retain_grad), for the cuts' gradients after a backward."""

    def __init__(self, model: nn.Module, rename=lambda n: n, keep_grad: bool = False):
        self.events: list[tuple[str, int, str, torch.Tensor]] = []
        self.inputs: dict[tuple[str, int], torch.Tensor] = {}
        self._calls: dict[str, int] = {}
        self._handles = []
        for name, m in model.named_modules():
            ref = rename(name) if name else None
            if ref is None:
                continue
            self._handles.append(m.register_forward_pre_hook(self._pre(ref, keep_grad), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(ref)))

    def _pre(self, name, keep_grad):
        def hook(module, args, kwargs):
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            t = first_tensor((args, kwargs))
            if t is not None and t.is_floating_point():
                if keep_grad and t.requires_grad and not t.is_leaf:
                    t.retain_grad()
                self.inputs[name, call] = t
                self.events.append((name, call, "in", t.detach().clone()))
        return hook

    def _post(self, name):
        def hook(module, args, out):
            t = first_tensor(out)
            if t is not None and t.is_floating_point():
                self.events.append((name, self._calls.get(name, 1) - 1, "out", t.detach().clone()))
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def replay_copy(module: nn.Module, values: dict | None = None) -> nn.Module:
    """A float64 copy of a stage's module that runs its own code eagerly: torch.compile's wrapper and
    compiled calls taken off (the replay checks the code, not the compiler), a forward replaced on an
    instance as a bound method re-bound to the copy, its hooks kept (they are part of the stage);
    `values` ({name in the module: tensor}): its parameters as they were at the checked step. Sharded
    parameters (DTensor: tensor parallelism, FSDP) are refused: the replay needs whole tensors."""
    if any(hasattr(p, "full_tensor") for p in module.parameters()):
        raise ValueError("its parameters are sharded (DTensor): the replay needs whole tensors")
    wrapped = hasattr(module, "_orig_mod")
    module = getattr(module, "_orig_mod", module)
    twin = copy.deepcopy(module)
    if values:
        with torch.no_grad():
            for n, p in twin.named_parameters():
                v = values.get(("_orig_mod." + n) if wrapped else n)
                if v is not None and v.shape == p.shape:
                    p.copy_(v)
    for orig, mine in zip(module.modules(), twin.modules()):
        f = mine.__dict__.get("forward")
        if isinstance(f, types.MethodType) and f.__self__ is orig:
            mine.forward = types.MethodType(f.__func__, mine)
        if getattr(mine, "_compiled_call_impl", None) is not None:
            mine._compiled_call_impl = None
    return twin.double()


def name_map(stage_module: nn.Module, pairs: list[tuple[str, str]]):
    """rename(stage module name) -> the reference's name, from (parameter name as the stage's module
    calls it, the reference's name) pairs: the part the two names end alike in is the same module, and
    what precedes it a prefix the stage adds or drops (a wrapper, `inner.`, the stage index)."""
    prefixes: dict[str, str] = {}
    for key, ref in pairs:
        k, r = key.split("."), ref.split(".")
        i = 0
        while i < min(len(k), len(r)) and k[-1 - i] == r[-1 - i]:
            i += 1
        prefixes.setdefault(canonical(".".join(k[:len(k) - i]) + ".").rstrip("."), ".".join(r[:len(r) - i]))

    def rename(name: str) -> str | None:
        c = canonical(name + ".").rstrip(".")
        best = max((p for p in prefixes if p == "" or c == p or c.startswith(p + ".")), key=len, default=None)
        if best is None:
            return None
        rest = c[len(best):].lstrip(".")
        return ".".join(x for x in (prefixes[best], rest) if x) or None
    return rename


def first_departure(stage: int, replay: list, reference: list) -> Departure | None:
    """The first event of the replay (in the order it ran) that departs from the reference's event of
    the same module and call."""
    ref = {(n, c, k): t for n, c, k, t in reference}
    last_ok = ""
    for n, c, k, t in replay:
        r = ref.get((n, c, k))
        if r is None or r.shape != t.shape:
            continue
        f = boundary_figure("activation", n, stage, t, r)
        if f.ratio > NOISE_MULTIPLE:
            return Departure(stage, "forward" if k == "out" else "between", n, f.ratio, last_ok)
        if k == "out":
            last_ok = n
    return None


def grad_departure(stage: int, replay: Recorder, reference: Recorder) -> Departure | None:
    """A backward-only bug: walking the modules back from the last that ran, the first whose input's
    gradient departs from the reference's (the gradients after it agreed: the bug is in it)."""
    for (n, c), t in reversed(list(replay.inputs.items())):
        r = reference.inputs.get((n, c))
        if r is None or t.grad is None or r.grad is None or r.grad.shape != t.grad.shape:
            continue
        f = boundary_figure("input-grad", n, stage, t.grad, r.grad)
        if f.ratio > NOISE_MULTIPLE:
            return Departure(stage, "input-grad", n, f.ratio)
    return None


def param_departure(stage: int, copy_: nn.Module, rename, truth_grads: dict, order: list[str]) -> Departure | None:
    """A backward-only bug that no module's input gradient shows (a hook on a parameter): the parameter
    gradient of the replay furthest down the forward's order (`order`: module names as they ran) that
    departs from the reference's."""
    bad = []
    for key, p in copy_.named_parameters():
        name = rename(key)
        r = truth_grads.get(name) if name else None
        if r is None or p.grad is None or p.grad.shape != r.shape:
            continue
        f = boundary_figure("grad", name, stage, p.grad, r)
        if f.ratio > NOISE_MULTIPLE:
            module = name.rpartition(".")[0]
            bad.append((order.index(module) if module in order else -1, module or name, f.ratio))
    if not bad:
        return None
    _, module, ratio = max(bad)
    return Departure(stage, "grad", module, ratio)


@dataclass
class Cut:
    """What the reference knows of one stage's cut: its input (whole batch, float64), the gradient of
    the loss with respect to it, and the activation the stage must hand on (or the model's output)."""

    a_in: object
    kwargs: dict
    out: torch.Tensor | None
    grad_out: torch.Tensor | None
    loss: object = None
    """For the last stage: output -> the step's loss (float64), whose backward the replay runs."""


def replay_stage(stage: int, module: nn.Module, rename, cut: Cut, reference: Recorder, truth_grads: dict,
                 backward: bool = True, values: dict | None = None) -> tuple[Departure | None, list[Figure]]:
    """Stage `stage`'s module, copied to float64, run on the reference's input at its cut (and, with
    `backward`, back from the reference's gradient at the next cut): the first departure, and the
    boundary figures (its output; the gradient it sends back)."""
    why = ""
    for kwargs in ([cut.kwargs, {}] if cut.kwargs else [{}]):  # the model's other inputs, if the stage takes them
        twin = replay_copy(module, values)
        rec = Recorder(twin, rename, keep_grad=True)
        a = cut.a_in
        if torch.is_tensor(a) and a.is_floating_point():
            a = a.detach().clone().requires_grad_(backward)
        try:
            with torch.enable_grad():
                out = first_tensor(twin(a, **kwargs))
            break
        except Exception as e:  # noqa: BLE001  (anything a user's stage raises: said, not raised)
            why = why or _why(e)
        finally:
            rec.remove()
    else:
        return Departure(stage, "unreplayed", "", detail=why), []
    figs, dep = [], first_departure(stage, rec.events, reference.events)
    if cut.out is not None and out is not None and out.shape == cut.out.shape:
        figs.append(boundary_figure("boundary", f"stage {stage} output", stage, out, cut.out))
        if dep is None and figs[-1].ratio > NOISE_MULTIPLE:
            dep = Departure(stage, "output", "", figs[-1].ratio)
    if dep is not None or not backward or out is None or not out.requires_grad:
        return dep, figs
    try:
        with torch.enable_grad():
            if cut.loss is not None:
                cut.loss(out).backward()
            elif cut.grad_out is not None and cut.grad_out.shape == out.shape:
                out.backward(cut.grad_out.to(out.device))
            else:
                return None, figs
    except Exception as e:  # noqa: BLE001
        return Departure(stage, "unreplayed", "", detail="backward: " + _why(e)), figs
    ref_in = reference.inputs.get(_entry(rec))
    if torch.is_tensor(a) and a.grad is not None and ref_in is not None and ref_in.grad is not None:
        figs.append(boundary_figure("boundary", f"stage {stage} input gradient", stage, a.grad, ref_in.grad))
    order = [n for n, _, k, _ in rec.events if k == "out"]
    dep = grad_departure(stage, rec, reference) or param_departure(stage, twin, rename, truth_grads, order)
    if dep is None and len(figs) > 1 and figs[-1].ratio > NOISE_MULTIPLE:
        dep = Departure(stage, "input-grad", "", figs[-1].ratio)
    return dep, figs


def _entry(rec: Recorder):
    return next(iter(rec.inputs), None)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def sentence(departures: list[Departure]) -> str:
    """The localisation in words: the first departing stage's sentence (stages that could not be
    replayed said too), or '' when every stage agrees."""
    found = sorted((d for d in departures if d.what != "unreplayed"), key=lambda d: d.stage)
    skipped = [d for d in departures if d.what == "unreplayed"]
    parts = [found[0].sentence()] if found else []
    parts += [d.sentence() for d in skipped[:1]]
    return "; ".join(parts)


def up64(v):
    """A floating tensor in float64 (other values as they are)."""
    return v.double() if torch.is_tensor(v) and v.is_floating_point() else v


def stage_names(stage, prefix_stage_index: bool = False):
    """(name as the stage's gradients are keyed, the unsplit model's name, parameter) for each parameter
    of a stage: wrapper prefixes (torch.compile, checkpoint_wrapper, DDP) taken out of the second."""
    for n, p in stage.submod.named_parameters():
        key = f"{stage.stage_index}.{n}" if prefix_stage_index else n
        yield key, canonical(key), p


def stage_rename(stage, prefix_stage_index: bool, renamed: dict):
    """The name map of one PipelineStage's module to the unsplit model's names."""
    pre = f"{stage.stage_index}." if prefix_stage_index else ""
    pairs = [(n, renamed.get(canonical(pre + n), canonical(pre + n))) for n, _ in stage.submod.named_parameters()]
    return name_map(stage.submod, pairs)


def held_modules(module: nn.Module, rename) -> list[str]:
    """The reference's names of the modules of `module` that hold parameters (in it or below), and of
    the stage module itself where it is one of the reference's (a stage that is `full[1]`): its input is
    the cut exactly, though its first child may hold none (a ReLU). Parameter-free modules are left out
    otherwise: a helper every stage holds (rotary embeddings) would claim the first stage's cut."""
    return [r for n, m in module.named_modules()
            if (r := rename(n)) and (n == "" or next(m.parameters(), None) is not None)]


def step_loss(loss_fn, y, n_microbatches: int, chunk_dim: int):
    """output -> the step's loss as the reference takes it: the mean of each microbatch's loss."""
    def loss(out):
        return torch.stack([loss_fn(o, t) for o, t in zip(out.chunk(n_microbatches, dim=chunk_dim),
                                                          y.chunk(n_microbatches, dim=chunk_dim))]).mean()
    return loss
