"""Notebook 09, gotcha 5: a rank that hangs, and the stall (or the deadline) that ends the job.

    labkit launch --nproc 2 --timeout 300 --stall 10 notebooks/scripts_09/hang.py

Rank 1 never reaches the pipeline: it is stuck in `load_next_batch` (think of a data loader that
waits on a file that never comes). Rank 0 runs `schedule.step` and waits for rank 1 forever; the
process group's own timeout is 300 s. Both ranks print `ready`, then nothing: 10 s later (`--stall`)
the kit makes every rank dump its Python stack (faulthandler, SIGABRT) into its stderr.log and
stacks.txt, stops the job and says where each rank was (the deadline, `--timeout`, would at 300 s).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from labkit.worker import distributed as worker


def load_next_batch() -> torch.Tensor:
    while True:  # the bug: waits for data that never arrives
        time.sleep(0.05)


@record
def main() -> None:
    d = worker.init_distributed("cpu", timeout_s=300)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stage = PipelineStage(full[d.rank], d.rank, 2, d.device)
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    print(f"[hang] rank {d.rank} ready", flush=True)
    if d.rank == 0:
        schedule.step(torch.randn(4, 4))
    else:
        target = load_next_batch()
        schedule.step(target=target)
    worker.teardown()


if __name__ == "__main__":
    main()
