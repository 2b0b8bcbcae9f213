"""Work shared by the runs of one batch: configs that a `--suite` job or live ranks run one after the
other (`labkit.jobs.train.run_items`) differ mostly in schedule and dtype, not in the model, the
batch or the cut. Inside `shared_work()`, what a run computes from those alone is computed once:

- the tracer's `pipeline()` trace of a cut (`labkit.worker.stages.trace_pipe`, ~5 s of CPU each);
- the reference check's three references of the unsplit model (`labkit.check.reference`: whole
  batch, microbatch by microbatch, float64), the same for every schedule of one model and batch.

Each is keyed by everything it depends on (`digest`: every weight's and input's bytes), so a run
that changed anything computes its own; outside the block nothing is kept and every call computes.
A single job and a notebook's own `labkit run` never open it.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.nn as nn

_SHARED: dict | None = None  # {key: value} while shared_work() is open


@contextlib.contextmanager
def shared_work():
    """Within the block, `memo` computes each key once; the values are dropped when it ends."""
    global _SHARED
    outer = _SHARED
    _SHARED = {} if outer is None else outer
    try:
        yield
    finally:
        _SHARED = outer


def is_shared() -> bool:
    """Whether a `shared_work()` block is open."""
    return _SHARED is not None


def memo(key, make):
    """`make()`, computed once per `key` inside `shared_work()` (always outside it, or when `key` is
    None: what cannot be keyed safely). The value is shared: callers must not change it (copy it)."""
    if _SHARED is None or key is None:
        return make()
    if key not in _SHARED:
        _SHARED[key] = make()
    return _SHARED[key]


def digest(*items) -> str:
    """sha256 of tensors' bytes (dtype and shape included) and of modules' parameters and buffers by
    name; None and other plain values by their repr. Cheap for the kit's models (a few MB)."""
    h = hashlib.sha256()

    def tensor(name: str, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())

    for i, item in enumerate(items):
        if isinstance(item, nn.Module):
            for name, t in (*item.named_parameters(), *item.named_buffers()):
                tensor(f"{i}.{name}", t)
        elif torch.is_tensor(item):
            tensor(str(i), item)
        elif isinstance(item, dict):
            for k in sorted(item):
                v = item[k]
                tensor(f"{i}.{k}", v) if torch.is_tensor(v) else h.update(f"{i}.{k}={v!r}|".encode())
        else:
            h.update(f"{i}={item!r}|".encode())
    return h.hexdigest()


def module_key(model: nn.Module) -> tuple | None:
    """What a model computes: its code and structure, train or eval, every weight. None (do not share)
    for a model with hooks or a forward replaced on an instance (`labkit.versions.has_hooks`: a
    tracker, a user's wrapper): what those do is not in the key."""
    from ..versions import has_hooks

    if has_hooks(model):
        return None
    return (type(model).__module__, type(model).__qualname__, repr(model), model.training, digest(model))


def autocast_state(device) -> tuple:
    """torch.autocast's state for `device`'s kind: () when off (an autocast trace records its casts)."""
    kind = torch.device(device).type
    if not torch.is_autocast_enabled(kind):
        return ()
    return kind, str(torch.get_autocast_dtype(kind)), torch.is_autocast_cache_enabled()
