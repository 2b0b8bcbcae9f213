"""check_step's comparison of one rank's part of a step: each stage parameter's gradient and each
microbatch's loss held against the references (whole batch R, microbatched C, float64 T), one Figure
each (labkit.check.noise), with why a parameter held got no gradient (labkit.check.located) and, in a
compiled pipeline, what compiling changed (labkit.check.compiled_floor).

May import: torch, labkit.check (noise, boundaries, located)."""

from __future__ import annotations

import torch

from . import located
from .boundaries import stage_names
from .noise import figure


def _compiled(c, k: int, name: str) -> float | None:
    """What compiling measured for stage k's `name` ("": the loss); None where no stage is compiled."""
    return None if c.compiled is None else c.compiled.get((k, name), 0.0)


def compare_losses(c, mine: list[float], refs: tuple, last_stage, figures: list) -> float:
    """The pipelined losses against the references' (a figure each, appended to `figures`); the
    largest absolute difference (inf when the counts differ)."""
    ref, probe, truth = refs
    ldiff = max((abs(p - r) for p, r in zip(mine, ref.losses)), default=float("inf"))
    if len(mine) != len(ref.losses):
        return float("inf")
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    truths = truth.losses if truth else [None] * len(mine)
    figures += [figure("loss", str(i), last_stage, f64(p), f64(r), f64(q), 1, next(c.full.parameters()).dtype,
                       None if t is None else f64(t), compiled=_compiled(c, last_stage, ""))
                for i, (p, r, q, t) in enumerate(zip(mine, ref.losses, probe.losses, truths))]
    return ldiff


def compare_grads(c, grads: dict, refs: tuple, figures: list, no_grad: list) -> tuple[float, int]:
    """Each stage parameter's gradient against the reference: a figure each (appended to `figures`),
    the parameters held but given no gradient (`no_grad`, each with why: labkit.check.located.why_no_grad),
    the largest absolute difference and how many elements were compared (a tied weight's copy is compared,
    not counted again)."""
    ref, probe, truth = refs
    stages, prefix_stage_index, tied, renamed = c.stages, c.prefix_stage_index, c.tied, c.renamed
    terms = c.n_microbatches
    worst, numel, ran = 0.0, 0, None
    for s in stages:
        for key, name, p in stage_names(s, prefix_stage_index):
            target = tied.get(name, renamed.get(name, name))
            g, r, cr = grads.get(key), ref.grads.get(target), probe.grads.get(target)
            if g is None and r is None:  # used by neither: nothing to compare, nothing missing
                numel += 0 if name in tied else p.numel()
                continue
            if g is None:  # named as the figures name it: the unsplit model's name
                if ran is None or ran[0] is not s:
                    ran = (s, located.what_ran(s, c.x, c.kwargs, terms, c.chunk_dim))
                own = key.split(".", 1)[1] if prefix_stage_index else key
                no_grad.append(f"stage {s.stage_index}'s {target!r} ({located.why_no_grad(own, p, ran[1])})")
                continue
            if r is None or g.shape != r.shape:
                worst = float("inf")
                continue
            worst = max(worst, float((g.to(r.device) - r).abs().max()))
            t = truth.grads.get(target) if truth else None
            figures.append(figure("grad", target, int(s.stage_index), g, r, cr if cr is not None else r, terms, truth=t,
                                  compiled=_compiled(c, int(s.stage_index), target)))
            numel += 0 if name in tied else p.numel()
    return worst, numel
