"""Balanced stages: split points from each block's measured cost.

A stage's time is what its blocks cost, plus the model's ends: the first stage also embeds the
tokens, the last one also runs the output layer and the loss, which with a large vocabulary can
cost several blocks (torchtitan gives the first and last stage fewer layers for this; PiPPy had
split policies). So the kit measures, on one process, each *unit* of the model: block i cut as a
stage of its own, block 0 with the embedding and the last block with the output layer and the loss,
so that any stage [a, b) costs exactly the sum of its units. For each unit: forward + backward time
on one microbatch (the fastest of a few repeats, after a warm-up: on a shared machine the
fastest is the one least disturbed by other work) and the activation bytes autograd
saves. Then the contiguous cut into `n_stages` that makes the slowest stage fastest is found
exactly (dynamic programming), and each stage's time is predicted as the sum of its units.

    plan = balance(unit_costs, n_stages)      # pure: the split and its prediction
    costs = measure_units(cfg)                # measured on this process
    labkit run --model gpt2 --split-points auto ...

Taught in notebook 11 (your own model: the wide_vocab model balanced, even vs balanced timelines).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass
class Plan:
    bounds: list[int]
    """Block index where each stage starts, plus n_blocks."""
    stage_time_s: list[float]
    """Predicted forward+backward time of one microbatch on each stage (sum of its units)."""
    stage_activation_bytes: list[int]
    even_bounds: list[int]
    even_stage_time_s: list[float]

    @property
    def split_points(self) -> list[str]:
        return [f"layers.{b}" for b in self.bounds[1:-1]]

    def to_dict(self) -> dict:
        return {**asdict(self), "split_points": self.split_points}


def stage_sums(values: list[float], bounds: list[int]) -> list[float]:
    return [sum(values[a:b]) for a, b in zip(bounds, bounds[1:])]


def best_bounds(unit_time: list[float], n_stages: int) -> list[int]:
    """The cut of units into `n_stages` contiguous non-empty stages whose slowest stage is fastest
    (ties: the smaller sum of squares, i.e. the more even)."""
    n = len(unit_time)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} stages need between 1 and {n} blocks, one at least per stage.")
    prefix = [0.0]
    for t in unit_time:
        prefix.append(prefix[-1] + t)
    inf = (float("inf"), float("inf"))
    # best[k][i]: (max, sum of squares) cutting the first i units into k stages; back[k][i]: last start
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    back = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                c = prefix[i] - prefix[j]
                cand = (max(best[k - 1][j][0], c), best[k - 1][j][1] + c * c)
                if cand < best[k][i]:
                    best[k][i], back[k][i] = cand, j
    bounds, i = [n], n
    for k in range(n_stages, 0, -1):
        i = back[k][i]
        bounds.append(i)
    return bounds[::-1]


def balance(unit_time: list[float], n_stages: int, unit_bytes: list[int] | None = None) -> Plan:
    """Split points that even out the stages, with each stage's predicted time (and the even split's)."""
    from ..schedules.table import layer_bounds

    bounds = best_bounds(unit_time, n_stages)
    even = layer_bounds(len(unit_time), n_stages)
    unit_bytes = unit_bytes or [0] * len(unit_time)
    return Plan(bounds, stage_sums(unit_time, bounds), [int(b) for b in stage_sums(unit_bytes, bounds)],
                even, stage_sums(unit_time, even))


def _unit_modules(cfg, model, full):
    """Each block as a stage of its own (block 0 with the embedding, the last with the output layer)."""
    n = cfg.model.n_layers
    bounds = list(range(n + 1))
    if cfg.model_name == "tutorial":
        from ..worker.stages import manual_stage_module
        return [manual_stage_module(full, s, n, bounds) for s in range(n)]
    from . import hf
    return [hf.manual_stage(cfg.model_name, cfg.model, full, s, bounds, "cpu") for s in range(n)]


def measure_units(cfg, model=None, full=None, repeats: int = 7, device="cpu") -> tuple[list[float], list[int]]:
    """Forward+backward seconds (fastest of `repeats`, after one warm-up) and saved activation bytes of
    each unit on one microbatch, on `device` (a GPU's time is taken after synchronizing). `model`: the
    job's adapter (labkit.models.adapter).

    On the CPU it measures with ONE intra-op thread, as the kit's ranks compute (labkit launch sets
    OMP_NUM_THREADS=1). With several threads every small op waits for its slowest thread, and on a
    busy machine that wait, not the work, is what gets measured: a block of many small ops then looked
    as slow as the wide_vocab output layer (head / median block 1.84 with 2 threads against 9 to 11
    with one, both beside other jobs at load average 15)."""
    import torch

    if torch.device(device).type != "cpu":
        return _measure_units(cfg, model, full, repeats, device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure_units(cfg, model, full, repeats, device)
    finally:
        torch.set_num_threads(threads)


def _measure_units(cfg, model, full, repeats: int, device) -> tuple[list[float], list[int]]:
    import torch
    import torch.nn as nn

    from ..worker.memory import saved_activation_bytes
    from ..worker.distributed import sync
    from .adapter import adapter

    model = model or adapter(cfg)
    full = full if full is not None else model.build_full()
    device = torch.device(device)
    units = [u.to(device) for u in _unit_modules(cfg, model, full)]
    x, y, kw = model.batch(device)
    mb = cfg.batch_size // cfg.n_microbatches
    x, y, kw = x[:mb], y[:mb], {k: v[:mb] for k, v in kw.items()}

    class _Call(nn.Module):  # saved_activation_bytes calls module(*inputs): the kwargs ride along
        def __init__(self, unit):
            super().__init__()
            self.unit = unit

        def forward(self, h):
            return self.unit(h, **kw)

    times, sizes, h = [], [], x
    for i, unit in enumerate(units):
        last = i == len(units) - 1
        inp = h if i == 0 else h.detach().requires_grad_()

        def once():
            out = unit(inp, **kw)
            (model.loss_fn(out, y) if last else out.float().square().mean()).backward()
            return out

        once()
        spans = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            out = once()
            sync(device)
            spans.append(time.perf_counter() - t0)
        unit.zero_grad(set_to_none=True)
        times.append(min(spans))
        sizes.append(saved_activation_bytes(_Call(unit), inp))
        h = out.detach()
    return times, sizes


def balance_config(cfg, model=None, full=None, device="cpu") -> dict:
    """`--split-points auto` inside the job: every rank measures, the ranks average their measurements
    (so all of them choose the same split), and the plan is returned as a dict for result.json."""
    import torch.distributed as dist

    from ..worker import distributed as worker

    import torch

    times, sizes = measure_units(cfg, model, full, device=device)
    if dist.is_initialized():
        rows = worker.all_gather_floats(times, torch.device(device))
        times = [sum(r[i] for r in rows) / len(rows) for i in range(len(times))]
    plan = balance(times, cfg.n_stages, sizes)
    return {**plan.to_dict(), "unit_time_s": times, "unit_activation_bytes": sizes}
