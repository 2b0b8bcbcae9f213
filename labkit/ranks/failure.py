"""How a cell's failure is told: `RanksError` (what failed, on which rank, what was kept) and the
hints read off the failed ranks' schedules (a wrong stage_index, different n_microbatches). Used by
the pool (`labkit.ranks.pool`)."""

from __future__ import annotations


class RanksError(RuntimeError):
    """A cell that failed on some rank. `failed`: {rank: traceback}; `blocked`: {rank: stack} of ranks
    that never finished; `restarted`: the pool was restarted (namespaces lost); `results`: what the
    ranks that finished returned."""

    def __init__(self, message: str, cell: int | None = None, failed: dict | None = None,
                 blocked: dict | None = None, restarted: bool = False, results: dict | None = None):
        super().__init__(message)
        self.cell, self.failed, self.blocked = cell, failed or {}, blocked or {}
        self.restarted, self.results = restarted, results or {}

    def _render_traceback_(self):
        # IPython shows this instead of a traceback through the kit's own frames: the message
        # already holds the rank's traceback, which is the one that matters.
        return [f"{type(self).__name__}: {self}"]


def _indent(text: str, pad: str = "    ") -> str:
    return "\n".join(pad + l for l in text.rstrip().splitlines())


def _in_distributed(stack: str | None) -> bool:
    """The innermost frame of a rank's stack (as `rank.main_stack` gives it) is torch.distributed's."""
    files = [l for l in (stack or "").splitlines() if l.strip().startswith('File "')]
    return bool(files) and "torch/distributed/" in files[-1].replace("\\", "/")


def _pipeline_hint(facts: dict) -> str | None:
    """The mistake that the failed ranks' schedules show side by side (`rank._schedule_facts`), or None."""
    facts = {r: f for r, f in sorted(facts.items()) if f}
    if len(facts) < 2:
        return None
    holders: dict[int, list[int]] = {}
    for r, f in facts.items():
        for index, _, _ in f["stages"]:
            holders.setdefault(index, []).append(r)
    hints = [f"stage {i} was built on {_names(rs)}: each rank must build its own stages (a wrong stage_index? "
             f"With one stage per rank it is `rank`: PipelineStage(module, rank, world_size, device))."
             for i, rs in sorted(holders.items()) if len(rs) > 1]
    ms = {r: f["n_microbatches"] for r, f in facts.items()}
    if len(set(ms.values())) > 1:
        hints.append("the ranks' schedules were built with different n_microbatches ("
                     + ", ".join(f"rank {r}: {m}" for r, m in ms.items())
                     + "): every rank must build its schedule with the same n_microbatches.")
    sizes = {r: {s[1] for s in f["stages"]} for r, f in facts.items()}
    if len({frozenset(v) for v in sizes.values()}) > 1:
        hints.append("the ranks' stages were built with different num_stages: every rank must pass the same one.")
    return ("Likely mistake: " + " ".join(hints)) if hints else None


def _names(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
