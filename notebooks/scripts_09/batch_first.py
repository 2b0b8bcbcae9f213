"""Notebook 09, gotcha 2: `batch_first=True` decoder layers fail on gloo in the backward.

    labkit launch --nproc 2 notebooks/scripts_09/batch_first.py            # fails
    labkit launch --nproc 2 notebooks/scripts_09/batch_first.py --static   # works

A two-stage decoder (embedding + 1 layer | 1 layer + output), batch-major tokens (batch, seq),
GPipe with 2 microbatches. Without --static, PipelineStage infers its tensor metadata at run time,
including the strides of the gradient stage 1 sends back; with batch_first=True that gradient is
a transposed (non-contiguous) view, stage 0 allocates its receive buffer with those strides, and
gloo refuses to receive into it: "input tensor has to be contiguous". With --static every stage is
given example inputs AND outputs (PipelineStage's static mode): the gradient buffers then follow
the outputs' (contiguous) layout. Rank 1 checks the losses against the unsplit model on the WHOLE
batch and writes result.json.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from labkit.worker import distributed as worker

VOCAB, DIM, HEADS, BATCH, SEQ, MICROBATCHES = 16, 8, 2, 4, 6, 2


class Half(nn.Module):
    """One stage: [embedding] + one decoder layer + [output projection]."""

    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM) if first else None
        self.layer = nn.TransformerDecoderLayer(DIM, HEADS, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.out = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, h):
        if self.emb is not None:
            h = self.emb(h)
        h = self.layer(h, h)
        return self.out(h) if self.out is not None else h


def loss_fn(out, target):
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--static", action="store_true", help="give PipelineStage example inputs and outputs")
    a = p.parse_args()

    d = worker.init_distributed("cpu", timeout_s=60)
    torch.manual_seed(0)
    halves = [Half(True, False), Half(False, True)]  # same weights on both ranks
    mb = BATCH // MICROBATCHES
    kwargs = {}
    if a.static:  # one microbatch of what each stage receives and returns (requires_grad: it has a backward)
        inputs = [torch.zeros(mb, SEQ, dtype=torch.long), torch.zeros(mb, SEQ, DIM, requires_grad=True)]
        outputs = [torch.zeros(mb, SEQ, DIM, requires_grad=True), torch.zeros(mb, SEQ, VOCAB, requires_grad=True)]
        kwargs = {"input_args": inputs[d.rank], "output_args": outputs[d.rank]}
    stage = PipelineStage(halves[d.rank], d.rank, 2, d.device, **kwargs)
    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if d.rank == 0:
        schedule.step(x)
    else:
        losses = []
        schedule.step(target=y, losses=losses)
        # the reference: ONE forward of the unsplit model on the WHOLE batch, cut into microbatch losses
        torch.manual_seed(0)
        ref_model = nn.Sequential(Half(True, False), Half(False, True))
        out = ref_model(x)
        ref = [loss_fn(o, t) for o, t in zip(out.chunk(MICROBATCHES), y.chunk(MICROBATCHES))]
        diff = max(abs(float(l.detach()) - float(r.detach())) for l, r in zip(losses, ref))
        worker.write_json(Path(os.environ.get("LABKIT_RUN_DIR", ".")) / "result.json",
                          {"static": a.static, "n_losses": len(losses), "max_abs_diff_losses": diff})
        print(f"[batch_first] static={a.static}: {len(losses)} microbatch losses, max abs diff from the "
              f"unsplit model {diff:.1e}", flush=True)
    worker.teardown()


if __name__ == "__main__":
    main()
