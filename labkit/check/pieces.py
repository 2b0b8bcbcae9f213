"""A checkpointed block of check_stages' float64 reference (T) recomputed a piece of the batch at a time in
its backward (labkit.check.lean.checkpointed): the block's whole-batch graph in float64 was the check's
largest allocation (one small_lm block on 16 x 64 tokens: about 36 MB of saved tensors, twice the step's
float32 activations of a microbatch), while its gradient is the sum of its pieces' wherever the block
treats each sample apart, as a transformer layer does.

Whether it does is measured, never assumed: the forward runs on the whole batch (no graph kept, as
checkpointing does) and keeps a fingerprint of each piece of its output (four float64 sums); the
backward recomputes each piece on its own and holds its output's fingerprint against the whole batch's.
Where one departs (a BatchNorm in training mode, a mask rolled across the batch, dropout), or where the
output is not a batch of tensors, the block is recomputed whole instead, as torch's checkpoint does, and
remembered as such; so is a block whose graph weighs less than what pieces add (`_worth`: a stand-in of
each of its parameters in the reference's dtype, and their gradients' sum). The pieces' gradients are
summed in the reference's dtype on those stand-ins (`substitute`: their .grad sum the pieces' in place),
then rounded once to each parameter's dtype, as the whole block's are: a float64 sum of four pieces'
float64 gradients instead of one (float32 for a 16-bit step's reference, 2^16 times finer than bfloat16).
Measured in bench/RESULTS.md ("the check's cost").

On a GPU the same Function serves the whole-batch reference in the step's dtype (R, which stays on the
device: its rounding is the floor) with one piece, the whole batch (`offload`): its recomputation's saved
tensors go to the host as they are made (torch.autograd.graph.save_on_cpu, pageable) and come back one
backward operation at a time, so the device holds the block's whole-batch tensors one operation at a time
instead of its whole graph; the same kernels on the same values give the same numbers (tested bit for
bit against torch's checkpoint, under bf16 autocast too, on the CPU: no GPU has run it yet).

May import: torch."""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch.autograd.graph import save_on_cpu


def pieced(f, args: tuple, kwargs: dict, *, pieces: int, dim: int, dtype: torch.dtype | None, params: list,
           substitute, state: dict, checkpoint, offload: bool = False):
    """f(*args, **kwargs) for a whole-batch reference, its backward a piece of the batch at a time (at most
    `pieces` pieces along `dim`) where the block treats samples apart; `checkpoint(f, *args, **kwargs)`
    instead where it cannot (no grad, a batch of one, a block that `state` remembers as whole) or where it
    would not save memory (`_worth`). `params`: the block's own floating parameters and buffers (each once);
    `substitute({id(tensor): stand-in})` puts stand-ins in their place for a recomputation, `substitute(None)`
    the tensors back; `dtype`: the stand-ins' dtype (the reference's). `state`: this block's memory ("whole":
    True once it was recomputed whole or found not worth pieces; None: the parameters' own dtype).

    `offload` (the whole-batch reference in the step's dtype, R, on a GPU): one piece, the whole batch, its
    recomputation's saved tensors on the host (torch.autograd.graph.save_on_cpu), brought back to the
    device one backward operation at a time: the same kernels on the same values, the same numbers,
    without the block's whole-batch graph on the device."""
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, v in enumerate(leaves) if torch.is_tensor(v)]
    batch = next((leaves[i].shape[dim] for i in at if leaves[i].dim() > dim), 0)
    if state.get("whole") or not torch.is_grad_enabled() or (not offload and (pieces < 2 or batch < 2)):
        return checkpoint(f, *args, **kwargs)
    job = _Job(f, leaves, spec, at, 1 if offload else min(pieces, batch), dim, batch, dtype, params, substitute,
               state, offload)
    if "whole" not in state and not offload:
        state["whole"] = not _worth(job)
        if state["whole"]:
            return checkpoint(f, *args, **kwargs)
    outs = _Pieced.apply(job, *(leaves[i] for i in at), *params)
    if job.refused:  # the output is not a batch of tensors: recomputed whole
        state["whole"] = True
        return checkpoint(f, *args, **kwargs)
    got = list(job.out_leaves)
    for i, t in zip(job.out_at, outs if isinstance(outs, tuple) else (outs,)):
        got[i] = t
    return tree_unflatten(got, job.out_spec)


def tree_flatten(tree) -> tuple[list, object]:
    """The leaves of nested tuples, lists and dicts (those exact types; anything else is a leaf), and how to
    put them back (`tree_unflatten`)."""
    if type(tree) in (tuple, list):
        parts = [tree_flatten(v) for v in tree]
        return [x for leaves, _ in parts for x in leaves], (type(tree), [spec for _, spec in parts])
    if type(tree) is dict:
        leaves, spec = tree_flatten(list(tree.values()))
        return leaves, (dict, (list(tree), spec))
    return [tree], None


def tree_unflatten(leaves: list, spec):
    return _rebuild(iter(leaves), spec)


def _rebuild(it, spec):
    if spec is None:
        return next(it)
    kind, inner = spec
    if kind is dict:
        return dict(zip(inner[0], _rebuild(it, inner[1])))
    return kind(_rebuild(it, s) for s in inner)


class _Job:
    """One call of a pieced block: how to call it again, and what its whole-batch forward gave."""

    def __init__(self, f, leaves, spec, at, pieces, dim, batch, dtype, params, substitute, state, offload):
        self.f, self.leaves, self.spec, self.at, self.dim, self.batch = f, leaves, spec, at, dim, batch
        self.dtype, self.params, self.substitute, self.state, self.offload = dtype, params, substitute, state, offload
        size = -(-batch // pieces)
        self.bounds = [(0, batch)] if pieces == 1 else [(s, min(size, batch - s)) for s in range(0, batch, size)]
        self.out_spec, self.out_leaves, self.out_at, self.prints = None, [], [], []
        self.refused, self.rng, self.cuda, self.cuda_rng, self.amp = False, None, [], [], []

    def call(self, tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.at, tensors):
            leaves[i] = t
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self.f(*args, **kwargs)

    def batched(self, t) -> bool:
        return torch.is_tensor(t) and t.dim() > self.dim and t.shape[self.dim] == self.batch

    def piece(self, t, b):
        return t.narrow(self.dim, *b) if self.batched(t) else t


class _Pieced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, job: _Job, *tensors):
        ins = tensors[:len(job.at)]
        job.rng, job.amp = torch.get_rng_state(), _autocast_now()
        job.cuda = sorted({t.device.index or 0 for t in ins if t.is_cuda})
        job.cuda_rng = [torch.cuda.get_rng_state(d) for d in job.cuda]
        out = job.call(ins)
        leaves, spec = tree_flatten(out)
        at = [i for i, v in enumerate(leaves) if torch.is_tensor(v)]
        floating = [i for i in at if leaves[i].is_floating_point()]
        if not floating or any(v is not None and not torch.is_tensor(v) for v in leaves) \
                or not (job.offload or all(job.batched(leaves[i]) for i in floating)):
            job.refused, empty = True, torch.empty(0)
            ctx.mark_non_differentiable(empty)
            return empty
        job.out_spec, job.out_at = spec, at
        job.out_leaves = [None if torch.is_tensor(v) else v for v in leaves]
        job.prints = [] if job.offload else [[_print(job.piece(leaves[i], b)) for i in floating] for b in job.bounds]
        ctx.job = job
        ctx.save_for_backward(*ins)
        outs = tuple(leaves[i] for i in at)
        ctx.mark_non_differentiable(*(t for t in outs if not t.is_floating_point()))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        job, ins = ctx.job, ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        got = _backward(job, ins, grads, need, job.bounds)
        if got is None:  # a piece departed from the whole batch: the block recomputed whole, and remembered
            job.state["whole"] = True
            got = _backward(job, ins, grads, need, [(0, job.batch)])
        return (None, *got)


def _backward(job: _Job, ins, grads, need, bounds):
    """The gradients of the block's inputs and parameters, recomputing it on each of `bounds`' pieces of the
    batch in turn; None where a piece's output departs from the whole batch's (only checked in pieces)."""
    n_in = len(ins)
    stand = [(p.detach() if job.dtype in (None, p.dtype) else p.detach().to(job.dtype))
             .requires_grad_(bool(need[n_in + j]) and p.is_floating_point()) for j, p in enumerate(job.params)]
    gin = [None] * n_in
    job.substitute({id(p): s for p, s in zip(job.params, stand)})
    try:
        for b in bounds:
            with _as_in_forward(job):
                part = [job.piece(t, b).detach().requires_grad_(bool(need[i]) and t.is_floating_point())
                        for i, t in enumerate(ins)]
                out = job.call(part)
            outs = [tree_flatten(out)[0][i] for i in job.out_at]
            if len(bounds) > 1:
                floating = [t for t in outs if t.is_floating_point()]
                if not all(_same(_print(t), w, job.dtype)
                           for t, w in zip(floating, job.prints[bounds.index(b)])):
                    return None
            pairs = [(o, job.piece(g, b)) for o, g in zip(outs, grads)
                     if g is not None and o.requires_grad]
            wrt = [t for t in part if t.requires_grad] + [s for s in stand if s.requires_grad]
            if pairs and wrt:  # the stand-ins' .grad sum the pieces' in place, one piece's gradient at a time
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=wrt)
            del out, outs, pairs
            for i, t in enumerate(part):
                if t.grad is None:
                    continue
                if job.batched(ins[i]):
                    if gin[i] is None:
                        gin[i] = torch.zeros_like(ins[i])
                    gin[i].narrow(job.dim, *b).copy_(t.grad)
                else:
                    gin[i] = t.grad if gin[i] is None else gin[i].add_(t.grad)
            del part
    finally:
        job.substitute(None)
    return [*gin, *(None if s.grad is None else s.grad.to(p.dtype) for s, p in zip(stand, job.params))]


def _autocast_now() -> list[tuple[str, torch.dtype, bool]]:
    """(device type, dtype, cast cache) of each autocast in force: the recomputation runs under the same."""
    return [(d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled()) for d in ("cpu", "cuda")
            if torch.is_autocast_enabled(d)]


def _as_in_forward(job: _Job) -> ExitStack:
    """Grad on, the random state of the block's forward (host and each GPU its inputs were on; the process's
    own state put back after), its autocast, and with `offload` saved tensors kept on the host."""
    stack = ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    torch.set_rng_state(job.rng)
    if job.cuda:
        stack.enter_context(torch.random.fork_rng(devices=job.cuda, device_type="cuda"))
        for d, state in zip(job.cuda, job.cuda_rng):
            torch.cuda.set_rng_state(state, d)
    stack.enter_context(torch.enable_grad())
    for device_type, dtype, cache in job.amp:
        stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
    if job.offload:  # pageable host memory: pinned blocks would stay cached in the user's process after the check
        stack.enter_context(save_on_cpu(pin_memory=False))
    return stack


def _worth(job: _Job) -> bool:
    """Whether pieces would lower the block's peak: its first piece run without a graph, every module's
    output inside it counted (a floor on what the whole batch's graph would save, scaled from the piece),
    against what pieces add: a stand-in of each parameter in the reference's dtype and its sum."""
    counted = [0]

    def count(module, args, out):
        counted[0] += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                          if torch.is_tensor(t) and t.is_floating_point())
    b = job.bounds[0]
    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            job.call([job.piece(job.leaves[i], b) for i in job.at])
    finally:
        handle.remove()
    whole = counted[0] * job.batch / b[1]
    added = sum(p.numel() * torch.finfo(job.dtype).bits // 4 for p in job.params if p.requires_grad)
    return whole * (1 - b[1] / job.batch) > added


def _print(t: torch.Tensor) -> torch.Tensor:
    """Four float64 sums of a piece of output: of its values, their magnitudes, their squares, and their
    values weighted by a fixed pseudo-random pattern (which moves when values move within the piece)."""
    v = t.detach().reshape(-1).to(torch.float64)
    w = torch.rand(v.numel(), generator=torch.Generator().manual_seed(v.numel()), dtype=torch.float64)
    return torch.stack([v.sum(), v.abs().sum(), v.square().sum(), (v * w).sum()])


def _same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a piece's fingerprint recomputed alone (`a`) is the whole batch's (`b`) within the rounding of
    `dtype` (a relative 1e-10 in float64, 3e-6 in float32: far below the step's own noise, far above
    a reordered sum's), relative to the piece's magnitudes."""
    tol = torch.finfo(dtype).eps ** 0.5 * 1e-2
    scale = torch.stack([b[1], b[1], b[2], b[1]]).clamp_min(torch.finfo(torch.float64).tiny)
    return bool(((a - b).abs() <= tol * scale).all())
