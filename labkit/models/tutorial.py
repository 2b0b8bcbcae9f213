"""The official tutorial's Transformer, and the batch it trains on.

Kept as close to the tutorial as possible (ModelArgs, a ModuleDict of decoder layers, optional
embedding / norm / output so that a stage can delete what it does not own). One change, `layout`:

- `"batch"` (the kit's default): tokens are `(batch, seq)`. The model transposes to
  `(seq, batch, dim)` after the embedding (the decoder layers are `batch_first=False`, as in the
  tutorial) and back before the output. Microbatches then cut the *batch*, and a pipelined step
  equals one step of the unsplit model on the whole batch.
- `"tutorial"`: the tutorial as written. Its `(32, 500)` tokens are read as `(seq, batch)`, so the
  schedules' dim-0 chunking cuts the *sequence*: attention sees 8 tokens instead of 32 and the
  pipelined step no longer equals the whole-batch step (notebook 03 shows it by numbers).

Dropout is 0 (the tutorial's layers default to 0.1): with dropout on, the pipelined run and the
reference draw different random masks and can never be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config.presets import PRESETS, ModelPreset


@dataclass
class ModelArgs:
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    vocab_size: int = 10000
    dropout: float = 0.0
    layout: str = "batch"

    @classmethod
    def from_preset(cls, preset: str | ModelPreset, layout: str = "batch") -> "ModelArgs":
        p = PRESETS[preset] if isinstance(preset, str) else preset
        return cls(dim=p.dim, n_layers=p.n_layers, n_heads=p.n_heads, vocab_size=p.vocab_size, layout=layout)


class Transformer(nn.Module):
    """The tutorial's decoder-only Transformer (see the module docstring for `layout`)."""

    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        # A ModuleDict lets a stage delete layers without renaming the rest (checkpoints still load).
        self.layers = nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(
                model_args.dim, model_args.n_heads, dropout=model_args.dropout
            )
        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch_major = self.model_args.layout == "batch"
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if batch_major:  # (batch, seq, dim) -> (seq, batch, dim) for batch_first=False layers
                h = h.transpose(0, 1)
        else:
            h = tokens  # a later stage receives (seq, batch, dim) activations
        for layer in self.layers.values():
            h = layer(h, h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            if batch_major:
                # contiguous: gloo cannot send or receive strided tensors (with batch_first=True the
                # backward's gradient buffer keeps these strides: "input tensor has to be contiguous")
                h = h.transpose(0, 1).contiguous()
            h = self.output(h).float()
        return h


def make_batch(cfg, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic tokens and targets `(batch, seq)` for a RunConfig (same on every rank)."""
    p = cfg.model
    g = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randint(0, p.vocab_size, (cfg.batch_size, p.seq_len), generator=g)
    y = torch.randint(0, p.vocab_size, (cfg.batch_size, p.seq_len), generator=g)
    return x.to(device), y.to(device)


def tokenwise_loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The tutorial's loss: cross entropy over every token of a microbatch (mean)."""
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def build_model(cfg) -> Transformer:
    """The full model with the config's seed: every rank builds identical initial weights."""
    torch.manual_seed(cfg.seed)
    return Transformer(ModelArgs.from_preset(cfg.preset, layout=cfg.layout))
