"""The check's references in less memory (labkit.worker.stagewise): a module copied one tensor at a
time where it goes (`copy_to`), every layer checkpointed while a whole-batch reference runs
(`checkpointed`: each recomputed in the backward, the same numbers), and a backward whose gradients are
read the moment they are made, then freed (`read_as_made`). Measured in bench/RESULTS.md ("the check's
cost").

May import: torch, labkit.worker.noise."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from .noise import canonical


def read_as_made(k: int, root, grad_out, leaves: list, params: list, read: dict, diffs: dict):
    """The backward of one stage whose parameters are the chain's own copies: each parameter's gradient
    read against R's (max |g - r| into `diffs`) by a hook as soon as it is accumulated, then freed, so that
    no more than one is held at a time; returns the gradient of the stage's input (None on the first)."""
    hooks = []
    for n, p in params:
        key = (k, canonical(n))

        def hook(param, key=key):
            r = read.get(key)
            if r is not None and param.grad is not None:
                g = param.grad
                diffs[key] = float((g.to(r.device, torch.float64) - r.double()).abs().max()) if r.numel() else 0.0
            param.grad = None
        hooks.append(p.register_post_accumulate_grad_hook(hook))
    try:
        torch.autograd.backward([root], None if grad_out is None else [grad_out],
                                inputs=leaves + [p for _, p in params])
    finally:
        for h in hooks:
            h.remove()
    return leaves[0].grad if leaves else None


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
def checkpointed(modules):
    """Each block of `modules` runs under torch.utils.checkpoint while inside: a whole-batch reference then
    keeps each block's input, not its inner activations, and recomputes the block in the backward (the
    same operations on the same values: the same numbers). Blocks (`blocks_of`): a model's repeated
    layers, found from the top."""
    from torch.utils.checkpoint import checkpoint

    wrapped = []
    for module in modules:
        for block in blocks_of(module):
            had = block.__dict__.get("forward")
            block.forward = lambda *a, _f=block.forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
            wrapped.append((block, had))
    try:
        yield
    finally:
        for block, had in reversed(wrapped):
            if had is None:
                del block.__dict__["forward"]
            else:
                block.forward = had


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """Every module below `module` made of modules that hold parameters (a model's layers, and inside a
    layer its attention and MLP), outermost first: checkpointed each, a layer's recompute in the backward
    keeps only its parts' inputs, and each part is recomputed in turn (nested)."""
    found = []
    for name, m in module.named_modules():
        if name and any(next(c.parameters(), None) is not None for c in m.children()):
            found.append(m)
    return found
