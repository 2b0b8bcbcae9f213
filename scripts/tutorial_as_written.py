"""The official pipelining tutorial's program, as written, with a stopwatch around its step.

    torchrun --nnodes 1 --nproc-per-node 2 scripts/tutorial_as_written.py                # the tutorial
    labkit launch --nproc 2 scripts/tutorial_as_written.py --sizes small --steps 10      # on a laptop

The benchmark (`tutorial_vs_kit` in scripts/benches/tutorial.py) times this against the kit's reference script doing
the same work (`--split manual --schedule GPipe --microbatches 4 --layout tutorial`), so the ratio
says what the kit's script costs over the tutorial's. The tutorial's program is kept as it is
written in ../shared/seeds (Introduction to Distributed Pipeline Parallelism):
- its ModelArgs and Transformer (decoder layers with their default dropout, `batch_first=False`);
- `init_distributed` (rank = LOCAL_RANK, device `cuda:{rank}` when CUDA is there, else CPU,
  `init_process_group()` with the default backend, `pp_group = new_group()`);
- the manual split of 8 layers in two halves, `PipelineStage(..., input_args=...)`;
- tokens `torch.ones(32, 500)`, targets random, `ScheduleGPipe` over 4 microbatches with the
  tokenwise cross entropy; rank 0 steps with the tokens, rank 1 with the targets and losses.
What is added (lines marked `# added:`), none of it inside the timed step:
- `--steps N` repeats the step (default 1, as written) and times each one;
- `--sizes small|tiny` shrinks ModelArgs and the batch to the kit's presets, for CPUs (the
  tutorial's own sizes take about a minute per step on 2 CPU cores);
- rank 0 writes the per-step times (max over the two ranks) to result.json in $LABKIT_RUN_DIR.
It needs exactly two ranks, and on GPUs one GPU per rank (`cuda:{rank}`, NCCL): a one-GPU machine
cannot run it as written (NCCL refuses two ranks on one GPU).
"""

import argparse  # added
import json  # added
import os
import time  # added
from dataclasses import dataclass
from pathlib import Path  # added

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

SIZES = {  # added: (dim, n_layers, n_heads, vocab_size, batch, seq), the kit's presets
    "tutorial": (512, 8, 8, 10000, 32, 500),
    "small": (64, 8, 4, 256, 8, 32),
    "tiny": (32, 8, 2, 64, 8, 16),
}


@dataclass
class ModelArgs:
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    vocab_size: int = 10000


class Transformer(nn.Module):
    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        # The tutorial keeps its layers in a ModuleDict, so deleting some keeps the names of the rest.
        self.layers = torch.nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(model_args.dim, model_args.n_heads)
        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size)

    def forward(self, tokens: torch.Tensor):
        # A deleted part is None: that is how the tutorial's stages skip what they do not own.
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values():
            h = layer(h, h)
        h = self.norm(h) if self.norm else h
        output = self.output(h).float() if self.output else h
        return output


def init_distributed():
    global rank, device, pp_group, stage_index, num_stages
    rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group()
    pp_group = dist.new_group()
    stage_index = rank
    num_stages = world_size


def manual_model_split(model, example_input_microbatch, model_args) -> PipelineStage:
    if stage_index == 0:  # the first half: embedding and layers 0-3
        for i in range(4, 8):
            del model.layers[str(i)]
        model.norm = None
        model.output = None
        stage_input_microbatch = example_input_microbatch
    elif stage_index == 1:  # the second half: layers 4-7, norm and output
        for i in range(4):
            del model.layers[str(i)]
        model.tok_embeddings = None
        stage_input_microbatch = torch.randn(example_input_microbatch.shape[0], example_input_microbatch.shape[1],
                                             model_args.dim)
    stage = PipelineStage(model, stage_index, num_stages, device, input_args=stage_input_microbatch)
    return stage


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # added
    ap.add_argument("--steps", type=int, default=1)  # added
    ap.add_argument("--sizes", choices=sorted(SIZES), default="tutorial")  # added
    a = ap.parse_args()  # added
    if int(os.environ.get("WORLD_SIZE", "0")) != 2:  # added: the tutorial's program is for two ranks
        raise SystemExit("The tutorial's program runs on exactly 2 ranks: torchrun --nproc-per-node 2 ...")
    dim, n_layers, n_heads, vocab, batch, seq = SIZES[a.sizes]  # added

    init_distributed()
    num_microbatches = 4
    model_args = ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab)
    model = Transformer(model_args)

    # Dummy data
    x = torch.ones(batch, seq, dtype=torch.long)
    y = torch.randint(0, model_args.vocab_size, (batch, seq), dtype=torch.long)
    example_input_microbatch = x.chunk(num_microbatches)[0]

    stage = manual_model_split(model, example_input_microbatch, model_args)
    model.to(device)
    x = x.to(device)
    y = y.to(device)

    def tokenwise_loss_fn(outputs, targets):
        loss_fn = nn.CrossEntropyLoss()
        outputs = outputs.reshape(-1, model_args.vocab_size)
        targets = targets.reshape(-1)
        return loss_fn(outputs, targets)

    schedule = ScheduleGPipe(stage, n_microbatches=num_microbatches, loss_fn=tokenwise_loss_fn)

    times = []  # added
    for _ in range(a.steps):  # added
        if device.type == "cuda":  # added
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()  # added
        if rank == 0:
            schedule.step(x)
        elif rank == 1:
            losses = []
            output = schedule.step(target=y, losses=losses)
            print(f"losses: {losses}")
        if device.type == "cuda":  # added
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)  # added

    # added: the slower rank's time for each step, written by rank 0
    gathered = [torch.zeros(a.steps, dtype=torch.float64, device=device) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor(times, dtype=torch.float64, device=device))
    if rank == 0 and os.environ.get("LABKIT_RUN_DIR"):
        per_step = [max(v) for v in zip(*(g.cpu().tolist() for g in gathered))]
        result = {"script": "tutorial_as_written", "sizes": a.sizes, "device": str(device), "torch": torch.__version__,
                  "step_time_s": per_step}
        Path(os.environ["LABKIT_RUN_DIR"], "result.json").write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
