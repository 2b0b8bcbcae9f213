"""Notebook 02: a skip connection across stages, traced with `pipeline()` and run with `build_stage`.

    labkit launch --nproc 3 notebooks/scripts_02/skip_connection.py

`Skip` computes h1 = a(x), h2 = b(h1), out = c(h2) + h1: with a stage per module, stage 2 needs
stage 0's output as well as stage 1's. The tracer builds that graph; this script asks the runtime
to train it with GPipe on three ranks (one stage each) and writes result.json on the last rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

from labkit import worker


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h1 = self.a(x)
        h2 = self.b(h1)
        return self.c(h2) + h1  # h1 skips stage 1


@record
def main() -> None:
    d = worker.init_distributed("cpu", timeout_s=60)
    torch.manual_seed(0)
    model = Skip()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = pipeline(model, mb_args=(x.chunk(2)[0],), split_spec={"b": SplitPoint.BEGINNING, "c": SplitPoint.BEGINNING})
    stage = pipe.build_stage(d.rank, d.device)
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    if d.rank == 0:
        schedule.step(x)
    elif d.rank == 2:
        losses = []
        out = schedule.step(target=y, losses=losses)
        diff = float((out - model(x)).abs().max())
        worker.write_json(Path(os.environ.get("LABKIT_RUN_DIR", ".")) / "result.json", {"max_abs_diff_outputs": diff})
    else:
        schedule.step()
    worker.teardown()


if __name__ == "__main__":
    main()
