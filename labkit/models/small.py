"""A small pre-norm transformer LM that the verdict's lesson cuts, breaks and checks (notebook 09b).

Token embedding, `n_blocks` pre-norm blocks (LayerNorm, causal attention with separate q, k, v and
output projections, LayerNorm, a GELU MLP `up` -> `down`, each with its residual), a final LayerNorm
and the output head: the layout of GPT-style models, small enough for two CPU ranks.

Every part is built from its own seed (the embedding, each block, the head), so a rank can build
only the blocks of its stages (`small_lm(blocks=[2, 3], first=False)`) and hold exactly the unsplit
model's values for them without the whole model ever existing (`check_stages`). A stage cut by hand
keeps the unsplit model's names (`blocks.2.down.weight` on both sides): `cut`.

Two switches plant the bugs a learner makes (the lesson turns them on in a stage only): a block's
`down.bias_scale` (the MLP's output bias enters scaled) and its `attn_residual` (False: the
attention's residual is skipped).

May import: torch."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn


class Linear(nn.Linear):
    """nn.Linear with a switch for a planted bug: `bias_scale` (1.0: the plain layer)."""

    bias_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.bias_scale == 1.0 else self.bias * self.bias_scale
        return nn.functional.linear(x, self.weight, bias)


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln1(x)), then + down(gelu(up(ln2(x))))."""

    def __init__(self, dim: int = 64, n_heads: int = 4):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), Linear(4 * dim, dim)
        self.attn_residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        a = self.ln1(x)
        q, k, v = (m(a).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = self.o(att.transpose(1, 2).reshape(b, t, d))
        x = x + a if self.attn_residual else a
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class SmallLM(nn.Module):
    """Embedding, blocks (a ModuleDict keyed "0", "1"...: names survive a cut), final norm, head. A
    stage holds some of them; the ones it lacks are None (the embedding, the norm and head) or absent
    (blocks), and its forward runs what it holds: token ids in on the first stage, hidden states
    `(batch, seq, dim)` after it, logits out of the last."""

    def __init__(self, vocab: int = 128, dim: int = 64, n_heads: int = 4):
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict()
        self.norm: nn.Module | None = nn.LayerNorm(dim)
        self.head: nn.Module | None = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.head(self.norm(h)) if self.head is not None else h


def small_lm(n_blocks: int = 4, blocks: list[int] | None = None, first: bool = True, last: bool = True,
             seed: int = 0, vocab: int = 128, dim: int = 64, n_heads: int = 4) -> SmallLM:
    """The unsplit model (the defaults), or the part of it that holds `blocks` (and the embedding if
    `first`, the norm and head if `last`): each part from its own seed, so a part holds exactly the
    unsplit model's values for what it holds."""
    torch.manual_seed(seed)
    model = SmallLM(vocab, dim, n_heads)
    for i in range(n_blocks) if blocks is None else blocks:
        torch.manual_seed(seed + 1 + i)
        model.blocks[str(i)] = Block(dim, n_heads)
    torch.manual_seed(seed + 1000)
    model.norm, model.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
    if not first:
        model.embed = None
    if not last:
        model.norm = model.head = None
    return model


def cut_small_lm(full: SmallLM, blocks: list[int], first: bool, last: bool) -> SmallLM:
    """A stage cut by hand from the unsplit model: a copy without the other blocks (names kept)."""
    part = copy.deepcopy(full)
    for key in [k for k in part.blocks if int(k) not in blocks]:
        del part.blocks[key]
    if not first:
        part.embed = None
    if not last:
        part.norm = part.head = None
    return part


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of every position's next token, in float32 at least (under bf16 autocast the
    logits are bf16; the check's float64 truth stays float64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
