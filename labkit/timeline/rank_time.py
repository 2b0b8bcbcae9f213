"""One rank's time around its actions, for `labkit.timeline.slowdown`'s critical path: what covers each
moment (waits for receives, posts, the kit's own) and its run-queue clock, read between any two moments.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate

from ..core.actions import COMPUTE_KINDS
from ..spans.idle import COLLECTIVE_KINDS
from ..spans.read import Span


class _Rank:
    """One rank's spans for classifying time between actions: what covers each moment, and its run-queue
    clock (seconds runnable without a CPU so far) at every span's ends, linear in between."""

    def __init__(self, spans: list[Span], clocked: bool, kit: bool):
        recv = [s.kind == "WAIT" and s.what in ("recv", "both") for s in spans]
        self.waits = _Intervals([(s.start, s.end) for s, r in zip(spans, recv) if r])
        self.posts = _Intervals([(s.start, s.end) for s, r in zip(spans, recv)
                                 if s.kind in COLLECTIVE_KINDS or (s.kind == "WAIT" and not r)])
        self.kit = _Intervals([piece for s in spans for piece in s.own()] if kit else [])
        points = sorted((t, q) for s in spans if s.rq and clocked for t, q in zip((s.start, s.end), s.rq))
        self.times = [t for t, _ in points]
        self.level = list(accumulate((q for _, q in points), max))  # a cumulative clock never goes back
        self.actions = sorted(s.start for s in spans if s.kind in COMPUTE_KINDS)

    def next_action(self, t: float) -> float:
        """When this rank's first action at or after `t` starts (inf if none): until then, having ended an
        action, it hands the action's output on (posts its sends, waits for them)."""
        i = bisect_left(self.actions, t)
        return self.actions[i] if i < len(self.actions) else float("inf")

    def queued(self, lo: float, hi: float) -> float:
        """Seconds in [lo, hi] runnable without a CPU (0 without a clock)."""
        return max(0.0, self._at(hi, bisect_left) - self._at(lo, bisect_right)) if self.times else 0.0

    def _at(self, t: float, find) -> float:
        # at a span's end, an end reads its own clock (the first point there), a start the next span's (the last)
        i, n = find(self.times, t), len(self.times)
        at = i if find is bisect_left else i - 1  # the first point at t, or the last
        if 0 <= at < n and self.times[at] == t:
            return self.level[at]
        if i == 0 or i == n:
            return self.level[min(i, n - 1)]
        t0, t1, q0, q1 = self.times[i - 1], self.times[i], self.level[i - 1], self.level[i]
        return q0 + (q1 - q0) * (t - t0) / (t1 - t0)


class _Intervals:
    """Intervals sorted by start: those reaching into [lo, hi] found without reading all of a rank's steps."""

    def __init__(self, intervals: list[tuple[float, float]]):
        self.intervals = sorted(intervals)
        self.starts = [a for a, _ in self.intervals]
        self.longest = max((b - a for a, b in self.intervals), default=0.0)

    def near(self, lo: float, hi: float) -> list[tuple[float, float]]:
        return self.intervals[bisect_left(self.starts, lo - self.longest):bisect_left(self.starts, hi)]


def _merged(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    """The union of `intervals` inside [lo, hi], as sorted disjoint pieces."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(pieces, taken) -> list[tuple[float, float]]:
    """`pieces` less the sorted disjoint intervals `taken`."""
    out = []
    for a, b in pieces:
        for c, d in taken:
            if c < b and d > a:
                if c > a:
                    out.append((a, c))
                a = max(a, d)
        if b > a:
            out.append((a, b))
    return out
