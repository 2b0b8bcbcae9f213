"""Notebook 09, gotcha 5b: ranks that call schedule.step a different number of times.

    labkit launch --nproc 2 --timeout 300 --stall 10 notebooks/scripts_09/hang_steps.py

Each rank counts its own batches, and the counts differ (an uneven split of the data: rank 0 has 2,
rank 1 has 1). Rank 1 runs one step and goes on to the end of training, a barrier where every rank
meets; rank 0 runs a second step and waits in it for rank 1, which never comes back. The stall ends
the job; `run.where_stuck()` says it in pipeline terms: rank 0 waits in step 2, rank 1 left
schedule.step after step 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from labkit.worker import distributed as worker


def my_batches(rank: int) -> list[torch.Tensor]:
    """The bug: each rank's own count of batches (2 on rank 0, 1 on rank 1)."""
    return [torch.randn(8, 4) for _ in range(2 if rank == 0 else 1)]


@record
def main() -> None:
    d = worker.init_distributed("cpu", timeout_s=300)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stage = PipelineStage(full[d.rank], d.rank, 2, d.device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    print(f"[hang_steps] rank {d.rank} ready", flush=True)
    for batch in my_batches(d.rank):
        schedule.step(batch) if d.rank == 0 else schedule.step(target=batch)
    dist.barrier()  # the end of training: every rank meets here (rank 0 never does)
    worker.teardown()


if __name__ == "__main__":
    main()
