"""Notebook 09, gotcha 5c: ranks whose schedules run different numbers of microbatches.

    labkit launch --nproc 2 --timeout 300 --stall 10 notebooks/scripts_09/hang_microbatches.py

Each rank builds its Schedule1F1B with its own n_microbatches (rank 0: 4, rank 1: 8; the same
microbatch size, so rank 1's batch is twice as large). Rank 0 runs its 4 microbatches, ends its step,
spends 2 s on its own work (as a real job would: logging, a checkpoint) and exits; rank 1 waits for
microbatch 4's activation from rank 0 meanwhile, and dies of the closed connection ("Connection closed
by peer"; the same on every torch release: rank 1 is already waiting when rank 0 leaves). That error only echoes rank 0's end: `run.where_stuck()` says who left
first and why the schedules never met.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from labkit.worker import distributed as worker


@record
def main() -> None:
    d = worker.init_distributed("cpu", timeout_s=300)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stage = PipelineStage(full[d.rank], d.rank, 2, d.device)
    m = 4 if d.rank == 0 else 8  # the bug: each rank its own n_microbatches
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    print(f"[hang_microbatches] rank {d.rank} ready: {m} microbatches", flush=True)
    batch = torch.randn(2 * m, 4)
    schedule.step(batch) if d.rank == 0 else schedule.step(target=batch)
    if d.rank == 0:  # its work after the step (a real job logs, saves...): rank 1 is waiting for it by then
        time.sleep(2)
    dist.destroy_process_group()  # rank 0 is done and leaves (no barrier: it does not wait for rank 1)


if __name__ == "__main__":
    main()
