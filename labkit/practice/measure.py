"""What a pipelined step costs beside its result (notebook 14, sections 2 and 3): bytes sent between
ranks, activation memory measured with a fresh tracker per step, warm step times.

`SentBytes` counts the bytes of every send a stage posts while it is active: torch's schedules build
one `torch.distributed.P2POp(isend, tensor, peer)` per tensor sent (activations forward, gradients
backward) on every release 2.11-2.15, whatever path then posts it, so counting those objects counts
the step's traffic. Transfers between two stages on the same rank (V-shaped schedules) are no sends.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


class SentBytes:
    """Context manager: `bytes` sent (P2POp with isend) and `sends` counted while it is open.

        with SentBytes() as sent:
            schedule.step(...)
        sent.bytes
    """

    def __init__(self):
        self.bytes = 0
        self.sends = 0
        self._orig = None

    def __enter__(self) -> "SentBytes":
        orig = dist.P2POp.__init__
        counter = self

        def init(op_self, op, tensor, *args, **kwargs):
            orig(op_self, op, tensor, *args, **kwargs)
            if "send" in getattr(op, "__name__", ""):
                counter.bytes += tensor.numel() * tensor.element_size()
                counter.sends += 1

        self._orig = orig
        dist.P2POp.__init__ = init
        return self

    def __exit__(self, *exc) -> None:
        dist.P2POp.__init__ = self._orig


class WeightCopies:
    """Context manager: bytes of the parameter casts saved for the backward while it is open (`bytes`).

    Under `torch.autocast` a layer computes with a bf16 copy of its float32 weight, made once per autocast
    region (autocast's cache) and saved for the backward wherever the layer's input needs a gradient: memory
    held for the backward that is not an activation. A saved tensor is such a copy when autograd made it
    from an `nn.Parameter` by a cast (`ToCopyBackward0` fed by the parameter's `AccumulateGrad`), possibly seen
    through a view (the transposed weight a matmul saves); each storage counts once. Open it around a step
    WITHOUT a `SavedTensorTracker` on the stages: the tracker's hooks sit inside the stage's forward and
    would take every saved tensor first."""

    VIEWS = ("TBackward0", "TransposeBackward0", "ViewBackward0", "PermuteBackward0", "ExpandBackward0",
             "AliasBackward0")

    def __init__(self):
        self._storages: dict[int, int] = {}
        self._ctx = None

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    def _pack(self, t):
        fn = t.grad_fn
        while fn is not None and type(fn).__name__ in self.VIEWS:
            fn = fn.next_functions[0][0]
        source = fn.next_functions[0][0] if fn is not None and type(fn).__name__ == "ToCopyBackward0" \
            and fn.next_functions else None
        # a parameter's cast; a leaf input's (a stage's received activation) is an activation
        if type(source).__name__ == "AccumulateGrad" and isinstance(source.variable, torch.nn.Parameter):
            storage = t.untyped_storage()
            self._storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> "WeightCopies":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


def fresh_tracker(stages):
    """A new `SavedTensorTracker` on `stages`, with any earlier tracker's wrapper removed first.

    A tracker replaces each stage module's `forward` on the instance; a second tracker wrapped on top
    would see nothing (the inner wrapper's saved-tensor hooks are the innermost and take every tensor).
    So a measured step gets its own tracker, counting from zero."""
    from ..worker.memory import SavedTensorTracker

    for st in stages:
        st.submod.__dict__.pop("forward", None)
    return SavedTensorTracker(stages)


def rank_peak(tracker) -> int:
    """The most activation bytes this rank's stages held AT ONCE over the tracked step (a rank with
    two stages, V-shaped or looped, holds both: the sum of their per-stage peaks would overstate it)."""
    return tracker.rank_peak()


def time_steps(step, n: int = 5, warmup: int = 1) -> float:
    """Median wall time in seconds of `n` calls of `step()` after `warmup` untimed calls (on this rank)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def stage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor occupies (numel x element size)."""
    return t.numel() * t.element_size()


class ForwardCounts(dict):
    """Context manager: {name: how many times that module's forward ran} while it is open, activation
    checkpointing's recomputations included (forward pre-hooks: a recomputation runs the module again).

        with ForwardCounts({f"stage {i}": mod for i, mod in ...}) as counts:
            run(schedule, stages, x, y)
        counts["stage 0"] / n_microbatches   # forwards per microbatch: 1, plus each recomputation

    Under 1F1B a checkpointed block runs twice per microbatch (its forward, then its recomputation in the
    backward); a zero-bubble schedule splits the backward into an input-gradient pass (I) and a
    weight-gradient pass (W), and checkpointing recomputes the block in each pass that needs its saved
    activations: once for I, and once per W pass of a layer with parameters (notebook 14 counts it)."""

    def __init__(self, modules: dict):
        super().__init__({name: 0 for name in modules})
        self._watched, self._handles = dict(modules), []

    def __enter__(self) -> "ForwardCounts":
        for name, mod in self._watched.items():
            self._handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: self._tick(name)))
        return self

    def _tick(self, name: str) -> None:
        self[name] += 1

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
