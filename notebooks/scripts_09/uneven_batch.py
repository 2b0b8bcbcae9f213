"""Notebook 09, gotcha 1: a batch that does not divide into the microbatches (static shapes).

    labkit launch --nproc 2 notebooks/scripts_09/uneven_batch.py --batch 10 --microbatches 4

Two Linear stages, forward only (GPipe, loss_fn=None). `schedule.step` cuts the batch with
torch.tensor_split: 10 rows in 4 microbatches are 3, 3, 2, 2 rows. Stage 1 learns the shape of
what it receives from the FIRST microbatch (3 rows) and keeps receive buffers of that shape.

Step 1 runs as torch does by default: no check per microbatch. The last rank writes result.json:
how many rows came out, and whether each microbatch's real rows match the unsplit model.
Step 2 runs the same step again with torch's per-microbatch metadata check switched on (what
TORCH_DISTRIBUTED_DEBUG=DETAIL in the environment does): rank 0 raises PipeliningMetadataError.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from labkit.worker import distributed as worker


def forward_step(full: nn.Sequential, rank: int, device, x: torch.Tensor, n_microbatches: int):
    """One forward-only GPipe step on fresh stages; the merged output on the last rank, else None."""
    stage = PipelineStage(full[rank], rank, 2, device)  # no input_args: shapes come from microbatch 0
    schedule = ScheduleGPipe(stage, n_microbatches=n_microbatches)  # loss_fn=None: forward only
    with torch.no_grad():
        return schedule.step(x) if rank == 0 else schedule.step()


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4)
    a = p.parse_args()

    d = worker.init_distributed("cpu", timeout_s=60)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))  # same weights on both ranks
    x = torch.randn(a.batch, 4)

    # Step 1: torch's default, no per-microbatch check.
    out = forward_step(full, d.rank, d.device, x, a.microbatches)
    if d.rank == 1:
        with torch.no_grad():
            ref = full(x)
        sizes = [len(c) for c in torch.tensor_split(x, a.microbatches)]
        matches = []  # where each microbatch's real rows land in the merged output (each took microbatch 0's size)
        for i, n in enumerate(sizes):
            got = out[i * sizes[0]: i * sizes[0] + n]
            want = ref[sum(sizes[:i]): sum(sizes[:i]) + n]
            matches.append(bool(torch.allclose(got, want)))
        worker.write_json(Path(os.environ.get("LABKIT_RUN_DIR", ".")) / "result.json", {
            "batch_rows": a.batch, "microbatch_rows": sizes, "output_rows": int(out.shape[0]),
            "real_rows_match_unsplit_model": matches, "extra_rows": int(out.shape[0]) - a.batch,
        })
        print(f"[uneven] step 1: a batch of {a.batch} rows in microbatches of {sizes} rows came back "
              f"as {out.shape[0]} rows", flush=True)

    # Step 2: the same, with the check on. Stages read the debug level when they are created.
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    forward_step(full, d.rank, d.device, x, a.microbatches)
    worker.teardown()


if __name__ == "__main__":
    main()
