"""The run watch's cost and its word (issue 64 item 2): on the bench's language model (labkit.models.small_lm,
8 blocks, dim 128, batch 16 x 64, 2 live ranks, Schedule1F1B, 4 microbatches, AdamW with weight decay, a
warm-up LambdaLR, clipping by the global norm), a clean 100-step run checked every 10 steps (labkit.watch_run)
against the same run alone, in interleaved pairs, each pair's order alternating: the watched run's wall time
over the plain run's. And the same run with a bug from step 37 on (rank 1's gradients scaled by 1.01 after the
clipping): the step the watch names (found by replaying from the good check at step 30). A bug at ONE unchecked
step that leaves nothing in the fingerprints (its gradients alone wrong) is not seen with every=10: measured
2026-12-06, the first version of this bench planted such a one-off bug and the watch did not name it. Also RESULTS.md's
section for it, with the load average at the start and after each pair (another job on the machine slows the two
runs of a pair unequally). Measured 2026-12-06 on a quiet machine: 1.87x (1.79-1.90) while every rank made all
three references of each check; 1.63x (1.62-1.69) once each reference is made by one rank
(labkit.check.gradients.owners); 1.46x (1.46-1.48, load average 1.4-1.9) once fingerprints are taken again only
where a tensor was written and the references' gradients travel as flat buffers (labkit.check.wire): a check
then costs about the float64 reference of the whole model on one rank (docs/live-ranks.md, "The run watch");
with the update replayed 256K elements at a time (a piece is faster than the whole: 11 ms against 22 ms for a stage
of 0.8M parameters), three runs one after another: 1.56x (1.34-1.64), 1.41x (1.37-1.47) and 1.42x (1.32-1.68),
1.42x over the 9 pairs: a run of 3 pairs can land either side of 1.5x."""

from __future__ import annotations

import os
import statistics
import tempfile

WATCH_HEADING = "The run watch: a 100-step run checked every 10 steps, and a bug at step 37"
SETUP = """
import time
import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
import labkit
from labkit.models import cut_small_lm, lm_loss, small_lm

def train(watched, steps=100, every=10, bug_at=None):
    torch.manual_seed(0)
    full = small_lm(8, dim=128)
    module = cut_small_lm(full, list(range(rank * 4, rank * 4 + 4)), rank == 0, rank == 1)
    stage = PipelineStage(module, rank, 2, "cpu")
    schedule = Schedule1F1B(stage, 4, loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1)
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    watch = labkit.watch_run([stage], opt, lm_loss, 4, full=full, every=every) if watched else None
    g = torch.Generator().manual_seed(0)
    dist.barrier()
    t = time.perf_counter()
    try:
        for step in range(steps):
            x, y = torch.randint(0, 128, (16, 64), generator=g), torch.randint(0, 128, (16, 64), generator=g)
            if watch:
                watch.begin(x, y)
            opt.zero_grad()
            losses = []
            schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
            sq = torch.tensor([sum(float(p.grad.double().pow(2).sum()) for p in module.parameters())])
            dist.all_reduce(sq)
            torch.nn.utils.clip_grads_with_norm_(module.parameters(), 1.0, sq.sqrt()[0])
            if bug_at is not None and step >= bug_at and rank == 1:  # from that step on
                for p in module.parameters():
                    p.grad.mul_(1.01)
            opt.step()
            lrs.step()
            if watch:
                watch.end(losses)
        dist.barrier()
        took = time.perf_counter() - t
    finally:
        if watch:
            watch.close()
    r = watch.report if watch else None
    return took, None if r is None else (r.ok, r.first_wrong_step, r.stage, r.failure)
"""


def watch_bench(pairs: int = 3, steps: int = 100, every: int = 10, bug_at: int = 37) -> dict:
    """Interleaved pairs of the plain and the watched run on one warm pool of 2 ranks; then the bug's run."""
    from labkit.ranks import Ranks

    out = {"pairs": pairs, "steps": steps, "every": every, "bug_at": bug_at,
           "model": "small_lm, 8 blocks, dim 128, batch 16 x 64, 2 ranks, 1F1B, 4 microbatches, AdamW, LambdaLR, "
                    "global-norm clipping"}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp, Ranks(nproc=2, device="cpu", runs_root=tmp, live="print") as pool:
        pool.exec(SETUP)
        run = lambda watched: max(v[0] for v in pool.exec(f"train({watched}, {steps}, {every})").values())  # noqa: E731
        run(False)  # warm-up: imports, the allocator
        ratios, plain, watched, verdicts = [], [], [], []
        for i in range(pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {w: run(w) for w in order}
            plain.append(got[False])
            watched.append(got[True])
            ratios.append(got[True] / got[False])
            load.append(os.getloadavg()[0])
        clean = pool.exec(f"train(True, {steps}, {every})")
        bug = pool.exec(f"train(True, {steps}, {every}, bug_at={bug_at})")
    ok, first, stage, failure = bug[0][1]
    out.update(ratio={"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "ratios": ratios},
               plain_s=statistics.median(plain), watched_s=statistics.median(watched), load=load, cores=os.cpu_count(),
               clean_ok=all(v[1][0] for v in clean.values()),
               bug={"named_step": first, "stage": stage, "failure": failure, "ranks_agree": bug[0][1] == bug[1][1]})
    return out


def _watch_rows(w: dict | None) -> list[str]:
    """RESULTS.md's section: how, then the cost row and the bug's row."""
    if not w:
        return []
    when = f"; measured {w['date']}, torch {w['torch']}" if w.get("date") else ""
    if w.get("load"):  # another job on the machine slows both runs of a pair, not the same way: said
        when += (f", load average {w['load'][0]:.1f} at the start and {', '.join(f'{v:.1f}' for v in w['load'][1:])} "
                 f"after each pair on {w.get('cores', '?')} cores")
    how = (f"{w['model']}; {w['steps']} steps, the watched run checked every {w['every']} steps (`labkit.watch_run`, "
           f"fingerprints at every step), against the same run alone, on one warm pool of live ranks, "
           f"{w['pairs']} interleaved pairs, each pair's order alternating{when}. Ratio: the watched run's wall "
           f"time over the plain run's (the slower rank's, between barriers). Then the same run with rank 1's "
           f"gradients scaled by 1.01 after the clipping from step {w['bug_at']} on.")
    r, b = w["ratio"], w["bug"]
    return ["", f"## {WATCH_HEADING}", "", how, "",
            "| run | plain | watched | ratio, median (range) | verdict |",
            "| --- | --- | --- | --- | --- |",
            f"| clean, every {w['every']} | {w['plain_s']:.1f} s | {w['watched_s']:.1f} s | {r['median']:.2f}x "
            f"({r['min']:.2f}-{r['max']:.2f}) | {'holds at every step' if w['clean_ok'] else 'FAILED'} |",
            f"| bug at step {w['bug_at']} | - | - | - | named step {b['named_step']}, stage {b['stage']}"
            f"{'' if b['ranks_agree'] else ' (ranks disagree)'} |"]
