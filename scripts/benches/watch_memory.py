"""The run watch's memory with slices= (issue 64 item 3: at most 2x the step's peak per rank, snapshots included):
on 2 live ranks, each building only its half of labkit.models.small_lm (8 blocks at dim 256, 12 MB of parameters
a rank) and its slice of it, Schedule1F1B, 4 microbatches, AdamW with weight decay, clipping by the global norm.

Each figure is a rank's peak resident memory above what it held just before (VmHWM after a reset of it through
/proc/self/clear_refs, the freed memory handed back first: gc, malloc_trim), measured from the same state (the
optimizer's state made by two steps, the gradients let go):
- the step: 3 plain steps;
- the watch: `watch_run` and 3 steps under it (every=1) or 8 (every=4): everything it holds, its snapshots and its
  checks included;
- `check_stages` alone, called after one plain step (what the call adds), for comparison.

Rounds alternate plain and watched; the ratio said is the watch's peak over the step's, the worst over ranks and
rounds. The snapshots are kept off memory (labkit.check.spill, the default with slices=); the row held in memory
(spill=False) says what that saves. Linux only (/proc). Also RESULTS.md's section for it."""

from __future__ import annotations

import os
import tempfile

WATCH_MEMORY_HEADING = "The run watch's memory with slices=: its peak against the step's, per rank"
SETUP = r"""
import ctypes, gc, re
import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
import labkit
from labkit.models import lm_loss, small_lm

def _rss():
    s = open("/proc/self/status").read()
    return tuple(int(re.search(k + r":\s+(\d+) kB", s).group(1)) * 1024 for k in ("VmRSS", "VmHWM"))

def _reset():
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    dist.barrier()
    base = _rss()[0]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return base

def _peak(base):
    dist.barrier()
    return (_rss()[1] - base) / 2 ** 20

class Job:
    def __init__(self, batch, dim=256):
        part = lambda: small_lm(blocks=[[0, 1, 2, 3], [4, 5, 6, 7]][rank], first=rank == 0, last=rank == 1, dim=dim)
        self.mod, self.slice, self.batch = part(), part(), batch
        self.stage = PipelineStage(self.mod, rank, 2, "cpu")
        self.sched = Schedule1F1B(self.stage, 4, loss_fn=lm_loss)
        self.opt = torch.optim.AdamW(self.mod.parameters(), lr=1e-3, weight_decay=0.1)
        self.g = torch.Generator().manual_seed(0)
        for _ in range(2):
            self.step()

    def batch_xy(self):
        return tuple(torch.randint(0, 128, (self.batch, 64), generator=self.g) for _ in range(2))

    def forward_backward(self, x, y):
        losses = []
        self.sched.step(x) if rank == 0 else self.sched.step(target=y, losses=losses)
        return losses

    def step(self, watch=None):
        x, y = self.batch_xy()
        if watch:
            watch.begin(x, y)
        self.opt.zero_grad()
        losses = self.forward_backward(x, y)
        sq = torch.tensor([sum(float(p.grad.double().pow(2).sum()) for p in self.mod.parameters())])
        dist.all_reduce(sq)
        torch.nn.utils.clip_grads_with_norm_(self.mod.parameters(), 1.0, sq.sqrt()[0])
        self.opt.step()
        if watch:
            watch.end(losses)

    def plain(self, n=3):
        self.opt.zero_grad()
        base = _reset()
        for _ in range(n):
            self.step()
        return _peak(base)

    def watched(self, every, n, spill=None):
        self.opt.zero_grad()
        base = _reset()
        watch = labkit.watch_run([self.stage], self.opt, lm_loss, 4, slices={rank: self.slice}, every=every,
                                 spill=spill)
        try:
            for _ in range(n):
                self.step(watch)
        finally:
            watch.close()
        return _peak(base), watch.report.ok

    def check_stages(self):
        x, y = self.batch_xy()
        self.opt.zero_grad()
        losses = self.forward_backward(x, y)
        self.slice.load_state_dict(self.mod.state_dict())
        base = _reset()
        c = labkit.check_stages({rank: self.slice}, [self.stage], x, y, losses, 4, lm_loss)
        return _peak(base), c.ok

def measure(batch, rounds, cases):
    job = Job(batch)
    cs, cs_ok = job.check_stages()
    out = {"params_mb": sum(p.numel() * 4 for p in job.mod.parameters()) / 2 ** 20, "check_stages_mb": cs,
           "check_stages_ok": cs_ok, "plain_mb": [], "cases": {name: [] for name, _, _, _ in cases}}
    for _ in range(rounds):
        out["plain_mb"].append(job.plain())
        for name, every, n, spill in cases:
            out["cases"][name].append(job.watched(every, n, spill))
    return out
"""

CASES = [("every 1", 1, 3, None), ("every 4", 4, 8, None), ("every 1, held in memory", 1, 3, False)]
BATCHES = (16, 64)


def watch_memory(rounds: int = 2) -> dict:
    """Each batch's figures per rank, on one warm pool of 2 ranks."""
    from labkit.ranks import Ranks

    out = {"rounds": rounds, "model": "small_lm, 8 blocks at dim 256 (12 MB of parameters a rank), sequence 64, 2 "
                                      "ranks, 1F1B, 4 microbatches, AdamW, global-norm clipping",
           "load": [os.getloadavg()[0]], "batches": {}}
    with tempfile.TemporaryDirectory() as tmp, Ranks(nproc=2, device="cpu", runs_root=tmp, live="print") as pool:
        pool.exec(SETUP)
        for batch in BATCHES:
            got = pool.exec(f"measure({batch}, {rounds}, {CASES!r})", timeout=1800)
            out["batches"][str(batch)] = {str(r): v for r, v in got.items()}
            out["load"].append(os.getloadavg()[0])
    return out


def worst(per_rank: dict, name: str) -> tuple[float, float, float]:
    """(the worst ratio of the watch's peak over the step's over ranks and rounds, the watch's MB there, the
    step's): each round's watch against the same round's step."""
    best = (0.0, 0.0, 0.0)
    for v in per_rank.values():
        for plain, (watched, _) in zip(v["plain_mb"], v["cases"][name]):
            if watched / plain > best[0]:
                best = (watched / plain, watched, plain)
    return best


def _watch_memory_rows(w: dict | None) -> list[str]:
    """RESULTS.md's section: how, then a row per batch and case."""
    if not w:
        return []
    when = f"; measured {w['date']}, torch {w['torch']}" if w.get("date") else ""
    if w.get("load"):
        after = ", ".join(f"{v:.1f}" for v in w["load"][1:])
        when += f", load average {w['load'][0]:.1f} at the start and {after} after each batch"
    how = (f"{w['model']}; on one warm pool of live ranks, {w['rounds']} rounds alternating the plain step and the "
           f"watched steps (`labkit.watch_run(slices=...)`), each a rank's peak resident memory above what it held "
           f"just before{when}. Ratio: the watch's peak over the step's, the worst over ranks and rounds (the bound: "
           f"2x). `check_stages` alone: what one call adds after a plain step.")
    rows = ["", f"## {WATCH_MEMORY_HEADING}", "", how, "",
            "| batch | watch | step | watched | ratio (worst) | check_stages alone | verdicts |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for batch, per_rank in w["batches"].items():
        cs = max(v["check_stages_mb"] for v in per_rank.values())
        for name in next(iter(per_rank.values()))["cases"]:
            ratio, watched, plain = worst(per_rank, name)
            held = all(ok for v in per_rank.values() for _, ok in v["cases"][name])
            rows.append(f"| {batch} x 64 | {name} | {plain:.0f} MB | {watched:.0f} MB | {ratio:.2f}x | {cs:.0f} MB | "
                        f"{'every step held' if held else 'FAILED'} |")
    return rows
