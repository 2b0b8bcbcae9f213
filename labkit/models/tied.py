"""Tied weights across stages (GPT-2's `lm_head.weight` is `transformer.wte.weight`): find them and
keep their copies equal by summing their gradients over the ranks that hold one (notebook 11)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of one parameter under several names (tied weights), canonical name first (the name
    `named_parameters()` shows, the one the reference gradient is kept under)."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return [names for names in by_id.values() if len(names) > 1]


@dataclass
class TiedWeights:
    """The tied parameters held as more than one tensor (by several stages, or twice by one traced
    stage), and how their gradients are summed.

    groups: for each tied parameter, its copies as (stage, name in that stage); canonical: the
    unsplit model's name for it; ranks: the ranks that hold a copy; pgs: the process group of those
    ranks (None when one rank holds every copy)."""

    groups: list[list[tuple[int, str]]] = field(default_factory=list)
    canonical: list[str] = field(default_factory=list)
    ranks: list[list[int]] = field(default_factory=list)
    pgs: list = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)
    """A tied parameter held once, under another of its names (a traced BERT's last stage keeps
    `cls.predictions.decoder.bias` where the unsplit model shows `cls.predictions.bias`)."""

    @property
    def aliases(self) -> dict[str, str]:
        """{name of a copy: the unsplit model's (canonical) name}, for the reference check."""
        return {n: canon for g, canon in zip(self.groups, self.canonical) for _, n in g if n != canon}

    @property
    def extra_copies(self) -> frozenset:
        """(stage, name) of every copy but the first of each tied parameter: what a norm over the
        pipeline's gradients must skip to count the unsplit model's one parameter once."""
        return frozenset(c for g in self.groups for c in g[1:])

    def sync(self, stages) -> None:
        """Sum each tied parameter's gradient over its copies (all-reduce in the holders' group),
        so every copy holds the gradient of the one tied parameter. Call after the step, before the
        optimizer. A rank holding no copy does nothing."""
        import torch.distributed as dist

        mine = {s.stage_index: s.submod for s in stages}
        for g, ranks, pg in zip(self.groups, self.ranks, self.pgs):
            here = [mine[s].get_parameter(n) for s, n in g if s in mine]
            if not here:
                continue
            # FSDP2 (--fsdp): the gradients are DTensor shards, cut the same way on every copy: their
            # local parts are summed (the collective sees plain tensors), the placement is kept
            local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
            total = torch.zeros_like(local(here[0]))
            for p in here:
                if p.grad is not None:
                    total += local(p.grad)
            if len(ranks) > 1:
                dist.all_reduce(total, group=pg)
            for p in here:
                if p.grad is not None and hasattr(p.grad, "to_local"):
                    local(p.grad).copy_(total)
                else:
                    p.grad = total.clone()


def find_tied(model: nn.Module, bounds: list[int], stage_names, rank_of_stage, make_group) -> TiedWeights:
    """The tied parameters held as more than one tensor. `stage_names(s)`: the parameter names of
    stage s (one name per tensor); `rank_of_stage(s)`; `make_group(ranks)`: a process group (called
    on EVERY rank in the same order, as `dist.new_group` requires)."""
    tw = TiedWeights()
    n_stages = len(bounds) - 1
    names = {s: list(stage_names(s)) for s in range(n_stages)}
    for g in tied_groups(model):
        copies = [(s, n) for s in range(n_stages) for n in names[s] if n in g]
        if len(copies) < 2:
            tw.renamed.update({n: g[0] for _, n in copies if n != g[0]})
            continue
        ranks = sorted({rank_of_stage(s) for s, _ in copies})
        tw.groups.append(copies)
        tw.canonical.append(g[0])
        tw.ranks.append(ranks)
        tw.pgs.append(make_group(ranks) if len(ranks) > 1 else None)
    return tw
