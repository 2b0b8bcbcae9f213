"""What compiling a stage changes in its numbers, measured, so that a correct compiled step is never
failed: inductor fuses and reorders a stage's float operations, so its results carry a rounding of their
own that the eager references (labkit.check.noise: R, C, T) do not share. A gradient that is zero in
exact arithmetic (a key projection's bias, under softmax) is pure rounding: eager 1e-17, compiled 2e-10
on the same data (measured on labkit.models.small_lm, inductor, torch 2.15), far above a floor taken
from the eager references.

So, where a stage of the pipeline is compiled (torch.compile's wrapper, or `module.compile()` in place),
each compiled stage is run on microbatch 0's real input at its cut (from the references), forward and
backward, once compiled and once eager (`eager`: the same module and parameters, its compiled call set
aside), and each parameter's gradient difference (`probe`) is added to that parameter's floor; every
other figure's floor gets one more rounding of its own (a compiled neighbour's rounding reaches it
through the activations and gradients it sends). A bug in the stage's code is in both runs: the probe
measures compilation, nothing else. The figures say so (`Figure.compiled`).

May import: torch, labkit.check (boundaries, located, noise)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from .boundaries import first_tensor


def is_compiled(module: nn.Module) -> bool:
    """torch.compile's wrapper (`_orig_mod`), or a module compiled in place (`module.compile()`)."""
    return hasattr(module, "_orig_mod") or any(getattr(m, "_compiled_call_impl", None) is not None
                                               for m in module.modules())


@contextmanager
def eager(module: nn.Module):
    """`module` run eagerly inside: yields the callable (torch.compile's `_orig_mod`, or the module with
    its in-place compiled calls set aside and put back after)."""
    if hasattr(module, "_orig_mod"):
        yield module._orig_mod
        return
    kept = [(m, m._compiled_call_impl) for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    for m, _ in kept:
        m._compiled_call_impl = None
    try:
        yield module
    finally:
        for m, impl in kept:
            m._compiled_call_impl = impl


def probe(module: nn.Module, a_in, kwargs: dict, grad_out=None, loss=None, ctx=None) -> dict[str, float]:
    """{parameter name in `module`: max |compiled gradient - eager gradient|} on one microbatch's real input
    `a_in` (and `kwargs`), backward from `grad_out` (a stage before the last) or `loss(output)` (the last;
    its key "" holds the loss's difference); {} where a run fails (said nowhere: the floor is then the
    eager one plus one rounding)."""
    import contextlib

    names = [n for n, p in module.named_parameters() if p.requires_grad]

    def run(fn):
        a = a_in.detach().requires_grad_(a_in.is_floating_point())
        params = [p for _, p in module.named_parameters() if p.requires_grad]
        with torch.enable_grad(), (ctx or contextlib.nullcontext()):
            o = first_tensor(fn(a, **kwargs))
            root = loss(o) if loss is not None else o
        gs = torch.autograd.grad([root], params, None if loss is not None else [grad_out], allow_unused=True)
        return root.detach(), gs

    try:
        lc, gc = run(module)
        with eager(module) as fn:
            le, ge = run(fn)
    except Exception:  # noqa: BLE001  (the probe is a measurement: it never fails the check)
        return {}
    out = {n: float((c.double() - e.double()).abs().max()) for n, c, e in zip(names, gc, ge)
           if c is not None and e is not None and c.numel()}
    if loss is not None:
        out[""] = float((lc.double() - le.double()).abs().max())
    return out


def probes_for_check_step(c) -> dict:
    """check_step's measure (collective over the pipeline, `c` its call): the unsplit model run on microbatch
    0 alone in the step's dtype, each cut's input and gradient recorded (as labkit.check.located finds a
    stage's cut), and each compiled stage of this rank probed there. {(stage, unsplit model's name): what
    compiling changed}; (last stage, ""): the loss."""
    from .boundaries import Recorder, stage_names
    from .located import held_by_stage
    from .noise import autocast_ctx, chunk_kwargs, reference_copy

    m, d = c.n_microbatches, c.chunk_dim
    _, names = held_by_stage(c)
    n_stages = max(names) + 1
    compiled = [s for s in c.stages if is_compiled(s.submod)]
    if not compiled or c.loss_fn is None:
        return {}
    x0, y0 = c.x.chunk(m, dim=d)[0], c.y.chunk(m, dim=d)[0]
    size = c.x.shape[d] if torch.is_tensor(c.x) and c.x.dim() > d else 0
    kw0 = chunk_kwargs(c.kwargs, size, m, d)[0] if c.kwargs else {}
    ctx = autocast_ctx(c.device, c.autocast)
    model = reference_copy(c.full).to(c.device)
    rec = Recorder(model, keep_grad=True)
    try:
        with torch.enable_grad(), ctx:
            out = first_tensor(model(x0, **kw0))
            loss = c.loss_fn(out, y0)
        loss.backward()
    except Exception:  # noqa: BLE001  (a measurement: never fails the check)
        return {}
    finally:
        rec.remove()
    entry = {k: next((key for key in rec.inputs if key[0] in v), None) for k, v in names.items()}
    found = {}
    for s in compiled:
        k = int(s.stage_index)
        a_in = x0 if k == 0 else rec.inputs.get(entry[k])
        nxt = rec.inputs.get(entry.get(k + 1)) if k + 1 < n_stages else None
        if a_in is None or (k + 1 < n_stages and (nxt is None or nxt.grad is None)):
            continue
        got = probe(s.submod, a_in.detach(), kw0, None if nxt is None else nxt.grad,
                    (lambda o: c.loss_fn(o, y0)) if nxt is None else None, ctx)
        target = {own.split(".", 1)[1] if c.prefix_stage_index else own: name
                  for own, name, _ in stage_names(s, c.prefix_stage_index)}
        found.update({(k, c.tied.get(target[n], c.renamed.get(target[n], target[n])) if n else ""): v
                      for n, v in got.items() if n in target or not n})
    return found
