"""Proven lower bounds on a searched order's period (the zero-bubble paper's "cost"), in closed form.

The period is the longest rank's span, first start to last end (arXiv 2401.10241, Section 5.3: its
bubble rate is (period - M(F+I+W)) / period). `search` reports one of these as `SearchResult.bound`
and the exact model (`labkit.theory.exact`) starts from it, so where an order meets it the order is
provably optimal (`gap` 0) and the solver need not run. With one stage per rank, P ranks, M
microbatches, costs F, I, W, link latency c, memory limit K (1F1B stage microbatches) and R, the
share of a microbatch's activations W still needs (`weight_memory`), no order's period is shorter than:

1. **Work**: M(F+I+W), every rank's own actions back to back.
2. **The last microbatch's way home** (rank 0's span): rank P-1 cannot start before a forward has
   crossed P-1 links, (P-1)(F+c); its last I comes after all M of its F and I; that microbatch's I
   then crosses P-1 stages back to rank 0, (P-1)(I+c), and rank 0 still owes its W.
3. **Memory on rank 0** (M > K): before rank 0's first I only forwards can run, at most floor(K) of
   them (nothing is freed yet), while that I cannot start before a forward went to the last stage and
   its gradient came back, PF + (P-1)I + 2(P-1)c after rank 0's first start: the rest of that wait is
   idle. After rank 0's last F (which follows that first I, since M > K), its I comes back no sooner
   than (P-1)F + PI + 2(P-1)c, then its W; all rank 0 can do meanwhile is the I and W of the n
   microbatches in flight and the W of the d whose I is done, n + Rd <= K: the rest is idle too.
   Rank 0's span is at least its work plus both idle parts. With K = P (1F1B's memory, the paper's
   ZB-1p) and R(I+W) >= W this is M(F+I+W) + (P-1)(F+I-W) + 4(P-1)c: exactly what the paper's
   handcrafted ZB-H1 takes, which is therefore optimal there (tests/test_paper.py).

With two stages per rank (V placement) only the work bound is used. Taught in notebook 13.
"""

from __future__ import annotations

import math

from .cost import Cost


def _rank0_memory_bound(p: int, m: int, cost: Cost, memory_limit: float, weight_memory: float) -> float:
    f, i, w, c = cost.F, cost.input_grad, cost.weight_grad, cost.p2p
    q = min(m, math.floor(memory_limit + 1e-9))  # forwards rank 0 can run before its first I
    warm = max(0.0, p * f + (p - 1) * i + 2 * (p - 1) * c - q * f)
    if m <= q:
        return m * (f + i + w) + warm
    tail_work = 0.0
    for n in range(1, q + 1):  # n in flight (holding 1 each), d done with I (holding R each) at the last F
        d = m - n if weight_memory <= 0 else min(m - n, math.floor((memory_limit - n) / weight_memory + 1e-9))
        tail_work = max(tail_work, n * (i + w) + max(0, d) * w)
    tail = max(0.0, (p - 1) * f + p * i + 2 * (p - 1) * c + w - tail_work)
    return m * (f + i + w) + warm + tail


def period_bound(pp_size: int, n_microbatches: int, cost: Cost, stages_per_rank: int = 1,
                 memory_limit: float = math.inf, weight_memory: float = 1.0) -> float:
    """No order's period (longest rank's span) is shorter: the largest of the bounds above (with two
    stages per rank, the work bound M(F+I+W) per stage held)."""
    p, m = pp_size, n_microbatches
    f, i, w, c = cost.F, cost.input_grad, cost.weight_grad, cost.p2p
    work = stages_per_rank * m * (f + i + w)
    if stages_per_rank != 1:
        return work
    way_home = (p - 1) * (f + i + 2 * c) + m * (f + i) + w
    bounds = [work, way_home]
    if math.isfinite(memory_limit):
        bounds.append(_rank0_memory_bound(p, m, cost, memory_limit, weight_memory))
    return max(bounds)
