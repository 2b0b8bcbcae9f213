"""The check's references in less memory (labkit.check.stagewise): a module copied one tensor at a
time where it goes (`copy_to`), every layer checkpointed while a whole-batch reference runs
(`checkpointed`: each recomputed in the backward, the same numbers), a backward whose gradients are
read the moment they are made, then freed (`read_as_made`), and what was freed handed back to the
system before each module runs and between references (`give_back`: freed tensors otherwise stay in
the process's heap, and its resident peak is what a rank must fit). Measured in bench/RESULTS.md
("the check's cost").

May import: torch, labkit.check (noise, pieces)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from .noise import canonical
from .pieces import pieced


def read_as_made(k: int, root, grad_out, leaves: list, params: list, on_grad):
    """The backward of one stage: each parameter's gradient handed to `on_grad((stage, name), gradient)` by a
    hook as soon as it is accumulated, then dropped by the parameter, so that the backward itself holds no
    more than one at a time (a gradient a parameter held before is put back after); returns the gradient of
    the stage's input (None on the first)."""
    hooks, kept = [], [(p, p.grad) for _, p in params]
    for p, _ in kept:
        p.grad = None
    for n, p in params:
        key = (k, canonical(n))

        def hook(param, key=key):
            if param.grad is not None:
                on_grad(key, param.grad)
            param.grad = None
        hooks.append(p.register_post_accumulate_grad_hook(hook))
    try:
        torch.autograd.backward([root], None if grad_out is None else [grad_out],
                                inputs=leaves + [p for _, p in params])
    finally:
        for h in hooks:
            h.remove()
        for p, g in kept:
            p.grad = g
    return leaves[0].grad if leaves else None


def give_back(collect: bool = True) -> None:
    """What the check has freed handed back to the system (glibc's malloc_trim), between its references and
    before each block runs: freed tensors otherwise stay in the process's heap, and the next peak lands on
    top of the last one's (measured: check_stages' resident peak 239 MB above its start on a 16 MB slice,
    198 MB trimmed between references). `collect`: a garbage collection first. Nothing where the C library
    has no malloc_trim."""
    import gc

    if collect:
        gc.collect()
    if _TRIM is not None:
        _TRIM(0)


def _malloc_trim():
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


_TRIM = _malloc_trim()


def copy_to(module: nn.Module, device, dtype=None) -> nn.Module:
    """A deep copy of `module` on `device` (floating tensors in `dtype` when given), made one tensor at a
    time there: the module itself is never copied whole where it lives."""
    import copy

    memo = {}
    for t in list(module.parameters()) + list(module.buffers()):
        v = t.detach().to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
        memo[id(t)] = nn.Parameter(v, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else v
    return copy.deepcopy(module, memo)


def copy64(module: nn.Module) -> nn.Module:
    return copy_to(module, next(module.parameters()).device, torch.float64)


@contextmanager
def checkpointed(modules: dict, upcast: torch.dtype | None = None, seen: set | None = None, pieces: int = 1,
                 dim: int = 0, offload: bool = False):
    """Each block of `modules` ({stage: module}) runs under torch.utils.checkpoint while inside: a whole-batch
    reference then keeps each block's input, not its inner activations, and recomputes the block in the
    backward (the same operations on the same values: the same numbers). Blocks (`blocks_of`): a model's
    layers and their parts, found from the top. Before each module runs, what the last one freed is handed
    back to the system (`give_back`).

    `upcast` (a dtype: float64, or float32 for a 16-bit step): the modules compute in it without a copy of
    them in it: each module's own parameters
    and floating buffers are cast when it runs (hooks; again when its block is recomputed) and put back
    after, so only the running block's casts are alive; a module that does not run through its own call
    (a parent reads its weight) has its tensors cast for the whole forward. `seen`: {(stage, module
    name)} that ran, filled by a run without `upcast` (R), read by one with it (T); None: every module is
    taken to run. Gradients reach the modules' own parameters through the casts, rounded once to their
    dtype. Whatever happens inside, every module's own tensors are its own again on exit.

    `pieces` (with `upcast`): each innermost block's backward recomputes it a piece of the batch (along
    `dim`) at a time where it treats samples apart and that lowers its peak (labkit.check.pieces).
    `offload` (R on a GPU): each innermost block recomputed whole with its saved tensors on the host."""
    wrapped, handles, orig = [], [], {}
    for k, module in modules.items():
        named = list(module.named_modules())
        if upcast:
            orig.update({(id(m), w, n): (m, getattr(m, w)[n]) for _, m in named for w, n in _own(m)})
        blocks = blocks_of(module)
        for block in blocks:
            had = block.__dict__.get("forward")
            innermost = not any(b is not block and any(b is d for d in block.modules()) for b in blocks)
            block.forward = _pieced(block, orig, upcast, pieces, dim, offload) \
                if innermost and (offload or (upcast and pieces > 1)) \
                else (lambda *a, _f=block.forward, **kw: _trimmed(_checkpoint, _f, *a, **kw))
            wrapped.append((block, had))
        handles += [m.register_forward_pre_hook(lambda mod, a: give_back(collect=False)) for _, m in named]
        if upcast:
            late = [(m, w, n) for name, m in named if seen is not None and (k, name) not in seen
                    for w, n in _own(m)]
            for name, m in named:
                mine = [(m, w, n) for w, n in _own(m)]
                if mine and (seen is None or (k, name) in seen):
                    handles += [m.register_forward_pre_hook(lambda mod, a, mine=mine: _swap(mine, orig, upcast)),
                                m.register_forward_hook(lambda mod, a, o, mine=mine: _swap(mine, orig, None))]
            if late:
                handles += [module.register_forward_pre_hook(lambda mod, a, late=late: _swap(late, orig, upcast)),
                            module.register_forward_hook(lambda mod, a, o, late=late: _swap(late, orig, None))]
        elif seen is not None:
            handles += [m.register_forward_hook(lambda mod, a, o, key=(k, n): seen.add(key)) for n, m in named]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for (_, w, n), (m, t) in orig.items():
            getattr(m, w)[n] = t
        for block, had in reversed(wrapped):
            if had is None:
                del block.__dict__["forward"]
            else:
                block.forward = had


def _checkpoint(f, *a, **kw):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(f, *a, use_reentrant=False, **kw)


def _pieced(block: nn.Module, orig: dict, upcast: torch.dtype | None, pieces: int, dim: int, offload: bool):
    """`block`'s forward as labkit.check.pieces runs it: its own tensors (from `orig`, the originals of
    `checkpointed`, where it casts; else its modules' own) given stand-ins for a recomputation, in its
    casts' place and in its modules' slots."""
    base = {(id(m), w, n): orig.get((id(m), w, n)) or (m, getattr(m, w)[n]) for m in block.modules()
            for w, n in _own(m)}
    params = list({id(t): t for _, t in base.values()}.values())
    state, f = {}, block.forward

    def substitute(stand: dict | None):
        for key, (m, t) in base.items():
            new = stand[id(t)] if stand is not None else t
            if key in orig:
                orig[key] = (m, new)
            getattr(m, key[1])[key[2]] = new
    return lambda *a, **kw: _trimmed(pieced, f, a, kw, pieces=pieces, dim=dim, dtype=upcast, params=params,
                                     substitute=substitute, state=state, checkpoint=_checkpoint, offload=offload)


def _trimmed(fn, *a, **kw):
    give_back(collect=False)  # what the last block freed, back to the system before this one allocates
    return fn(*a, **kw)


def _own(m: nn.Module) -> list[tuple[str, str]]:
    """("_parameters" or "_buffers", name) of the floating tensors a module holds itself (not its children's)."""
    return [(w, n) for w in ("_parameters", "_buffers") for n, t in getattr(m, w).items()
            if t is not None and t.is_floating_point()]


def _swap(items: list, orig: dict, dtype: torch.dtype | None) -> None:
    """Each (module, "_parameters"/"_buffers", name) of `items` set to its own tensor's cast to `dtype` (a
    differentiable op), or, with None, back to its own tensor."""
    for m, w, n in items:
        t = orig[id(m), w, n][1]
        getattr(m, w)[n] = t.to(dtype) if dtype is not None else t


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """Every module below `module` made of modules that hold parameters (a model's layers, and inside a
    layer its attention and MLP), outermost first: checkpointed each, a layer's recompute in the backward
    keeps only its parts' inputs, and each part is recomputed in turn (nested)."""
    found = []
    for name, m in module.named_modules():
        if name and any(next(c.parameters(), None) is not None for c in m.children()):
            found.append(m)
    return found
