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
    held: dict[int, int] = {}
    best = 0
    for _, stage, n, _ in tracker.events:
        held[stage] = n
        best = max(best, sum(held.values()))
    return best


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
