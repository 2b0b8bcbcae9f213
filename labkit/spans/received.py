"""What each stage's forward received and returned, per microbatch: a fingerprint of every tensor (its
shape, dtype and three weighted float64 sums per row along the batch dim), kept on the stage until the next
step overwrites it. The step check (labkit.check.inputs) holds them against the reference's cut of
the whole batch: a stage that received another microbatch's activation or kwarg is then named, not
guessed from the losses.

A fingerprint costs one float64 copy and one matrix product over each input of a forward and the output
of every stage but the last (the copy freed at once, no host sync: the sums stay on the tensor's device
until the check reads them); scripts/benches/observer.py measures the whole kit against plain torchrun.
An activation (a tensor that requires grad) is fingerprinted later, off the path that feeds the next stage:
when the rank next waits for a peer (`settle`, from the spans' wait wrapper: time it would idle), when the
step ends, or when the record is read, whichever comes first. The values are the same: the tensor is the
one the forward received or returned, unchanged (nothing of torch's writes to a stage's output once its
forward returned, and what a stage received is a leaf that requires grad, which autograd refuses to
change in place).
`labkit.spans.record`
calls `begin` from its wrapper of `forward_one_chunk`, in every process the kit starts (jobs, live
ranks), and `before` / `after` from its wrapper of the stage's call of its module
(`labkit.versions.stage_module_call`): no hook is put on the user's module, so none is traced into a
compiled region. A plain process without the kit records nothing, and the check then says so.

May import: torch (imported where a fingerprint is taken: the spans recorder loads this module first)."""

from __future__ import annotations

ATTR = "_labkit_received"  # on a PipelineStage: {microbatch: {"args": [...], "kwargs": {...}, "out": ...}}
_CHUNK = "_labkit_chunk"   # on a PipelineStage: the microbatch its forward is running now


def fingerprint(v):
    """A tensor's shape and dtype and, per row along dim 0, three weighted sums of its values in float64 on
    its device: plain (weights 1), and weighted by cos(k) and sin(k) of the position k (these move when
    values move within a row); a non-tensor's repr (short). One float64 copy and one matrix product: few
    ops, as it runs in every forward. Two fingerprints are compared only with each other (`same` in
    labkit.check.inputs), never read as figures. No autograd: the tensor is detached."""
    import torch

    if not torch.is_tensor(v):
        return ("value", repr(v)[:80])
    t = v.detach()
    shape = t.shape
    rows = (t.reshape(shape[0], -1) if shape else t.reshape(1, 1)).to(torch.float64)
    return ("tensor", tuple(shape), str(t.dtype)[6:], torch.mm(rows, _weights(rows.shape[1], rows.device)))


_WEIGHTS: dict = {}  # {(row length, device): (n, 3) float64 weights}: made once per shape, not per forward


def _weights(n: int, device):
    """The (n, 3) weights, stored column by column (the transpose of a contiguous (3, n)): the product of a
    few rows by them is 2-3x faster on CPU than by a row-major (n, 3) (one dot product a column)."""
    w = _WEIGHTS.get((n, device))
    if w is None:
        import torch

        if len(_WEIGHTS) > 64:  # a model whose shapes keep changing: never grow without bound
            _WEIGHTS.clear()
        k = torch.arange(n, device=device, dtype=torch.float64)
        w = _WEIGHTS[(n, device)] = torch.stack([torch.ones_like(k), torch.cos(k), torch.sin(k)]).t()
    return w


PENDING: list = []  # [(record, key, index or name, tensor)]: activations whose fingerprint is due
DUE = ("due",)  # what a record holds in a deferred fingerprint's place until `settle`
MAX_PENDING = 64  # never more activations held for a fingerprint than this


def _later(v, record: dict, key: str, slot):
    """`v`'s fingerprint now, or, for an activation (a tensor that requires grad, under grad mode), a place
    kept for it in `record[key][slot]` (`slot` None: `record[key]`) until `settle`."""
    import torch

    if torch.is_tensor(v) and v.requires_grad and torch.is_grad_enabled():
        if len(PENDING) >= MAX_PENDING:  # stages driven by hand, with no wait or step of the kit's between
            settle()
        PENDING.append((record, key, slot, v))
        return DUE
    return fingerprint(v)


def settle(more=None) -> None:
    """Every deferred fingerprint taken now (the spans recorder calls it where the rank would wait for a peer,
    and at a step's end; reading a record calls it first); with `more`, one at a time while `more()` says to go
    on (labkit.spans.later.idle), the oldest first."""
    while PENDING:
        record, key, slot, t = PENDING.pop(0)
        fp = fingerprint(t)
        if slot is None:
            record[key] = fp
        else:
            record[key][slot] = fp
        if more is not None and not more():
            return


def on_host(fp):
    """A fingerprint whose sums are on the CPU (to gather it over the ranks)."""
    return fp[:3] + (fp[3].cpu(),) if fp[0] == "tensor" else fp


def begin(stage, chunk_id) -> None:
    """Called before `stage.forward_one_chunk(chunk_id, ...)`: notes the microbatch its forward runs."""
    setattr(stage, _CHUNK, int(chunk_id) if isinstance(chunk_id, int) else chunk_id)
    if getattr(stage, ATTR, None) is None:
        setattr(stage, ATTR, {})


def before(stage, args, kwargs) -> None:
    """Called with what the stage hands its module (`stage.submod(*args, **kwargs)`), right before that
    call: fingerprints the inputs of the microbatch `begin` noted. It runs in torch's stage code, outside
    the module: nothing of the kit is in the module's forward, so a compiled module (`module.compile()`,
    `torch.compile(module)`, blocks compiled inside it) traces, guards and recompiles as it does without
    the kit (tests/test_observer.py holds dynamo's counts against plain torchrun's)."""
    mb = getattr(stage, _CHUNK, None)
    if mb is not None and getattr(stage, ATTR, None) is not None:
        record = {"args": [None] * len(args), "kwargs": {}, "out": None}
        for i, a in enumerate(args):
            record["args"][i] = _later(a, record, "args", i)
        for k, v in kwargs.items():
            record["kwargs"][k] = _later(v, record, "kwargs", k)
        getattr(stage, ATTR)[mb] = record


def after(stage, out) -> None:
    """Called with what the stage's module returned: fingerprints its (first) output, once per forward (not
    on the last stage: its output is sent to no stage)."""
    import torch

    mb = getattr(stage, _CHUNK, None)
    got = (getattr(stage, ATTR, None) or {}).get(mb)
    # the last stage's output goes to no stage (the check holds a stage's input against what the one before
    # it sent): not fingerprinted, as no check reads it
    if got is not None and got["out"] is None and not getattr(stage, "is_last", False):
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        got["out"] = _later(first, got, "out", None) if torch.is_tensor(first) else None
    setattr(stage, _CHUNK, None)


def of_stages(stages) -> dict:
    """This rank's record, on the host: {stage index: {microbatch: {"args", "kwargs", "out"}}}; a stage
    with no record (no forward under the kit) is left out."""
    settle()
    out = {}
    for s in stages:
        got = getattr(s, ATTR, None)
        if got:
            out[int(s.stage_index)] = {mb: {"args": [on_host(a) for a in r["args"]],
                                            "kwargs": {k: on_host(v) for k, v in r["kwargs"].items()},
                                            "out": None if r["out"] is None else on_host(r["out"])}
                                       for mb, r in got.items() if isinstance(mb, int)}
    return out
