"""A learner-sized pipeline for the instruments benchmark (scripts/benches/fidelity.py instrument_fidelity):

    labkit launch --nproc 2 scripts/mlp_pipeline.py [--hidden 256] [--steps 3] [--profile]

Two stages of an MLP block (64 -> hidden -> 64), 16 samples in 4 microbatches, Schedule1F1B, on gloo;
a plain torchrun script (the kit records its spans and PP logs as it does for any script). With
--profile, torch.profiler runs over all steps with the kit's stage annotations (worker.annotate_stages),
written to profile/rank<N>.json in the run directory, as `labkit run --profile` does.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from labkit.worker import distributed as worker


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    d = worker.init_distributed("cpu", 60.0)
    torch.manual_seed(d.rank)
    block = nn.Sequential(nn.Linear(64, a.hidden), nn.ReLU(), nn.Linear(a.hidden, 64))
    stage = PipelineStage(block, d.rank, d.world_size, d.device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    if a.profile:
        worker.annotate_stages([stage])
    with worker.maybe_profile(a.profile, d, worker.run_dir()):
        for _ in range(a.steps):
            if stage.is_first:
                schedule.step(x)
            elif stage.is_last:
                schedule.step(target=y)
            else:
                schedule.step()
    worker.teardown()
    return 0


if __name__ == "__main__":
    worker.exit_now(main())
