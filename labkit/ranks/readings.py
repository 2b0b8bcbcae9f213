"""What a finished cell left, read back: its directory, its PP log events, its measured timeline (spans,
else logs), where its idle time went, one pipeline at a time (notebooks 04-06 and 12), and why one
cell's steps are slower than another's (`compare`). `Ranks` inherits these."""

from __future__ import annotations

from .failure import RanksError


class CellReadings:
    """Readings of the cells a pool ran: needs `run_dir` and `last_cell`."""

    def cell_dir(self, n: int | None = None):
        n = self.last_cell if n is None else n
        if n is None:
            raise RanksError("No cell has run on this pool yet.")
        return self.run_dir / "cells" / f"{n:03d}"

    def events(self, cell: int | None = None):
        """The parsed PP log lines (`labkit.logs.Event`s) of a cell (the last by default), for
        `labkit.logs.explain_idle` and anything else that reads the lines themselves."""
        from ..logs import parse_files

        return parse_files(sorted(self.cell_dir(cell).glob("rank*.log")))

    def timeline(self, cell: int | None = None):
        """The measured `Timeline` of a cell (the last by default): its spans (both ends of every action
        measured in the ranks), or, for a cell without spans, its PP logs with the waits taken out.
        Every rank's actions; when the ranks formed several pipelines (pp x dp), `tl.pipelines` lists
        them (from the groups the ranks' stages were built on) and `tl.split_pipelines()` splits it."""
        from ..timeline.compare import load_timeline

        from ..spans.paths import span_files

        d = self.cell_dir(cell)
        if span_files(d):  # both ends of every action measured in the ranks (labkit.spans)
            tl = load_timeline(d, "spans")
            if tl.compute():
                return tl
        files = {int(p.stem[4:]): p for p in d.glob("rank*.log") if p.stem[4:].isdigit() and p.stat().st_size > 0}
        if not files:
            raise RanksError(f"Cell {int(d.name)} logged no pipelining actions ({d} has no rank*.log): run a "
                             f"schedule's step() in the cell, then ask for its timeline.")
        tl = load_timeline([p for _, p in sorted(files.items())])  # rank from the name: cells/007/rank1.log -> 1
        tl.meta["files"] = [str(p) for _, p in sorted(files.items())]
        if not tl.compute():
            raise RanksError(f"Cell {int(d.name)}'s PP logs hold no forward/backward actions ({d}): did the cell "
                             f"call schedule.step()?")
        return tl

    def idle(self, cell: int | None = None, which: str | int = "last"):
        """Where the cell's last step's idle time went, by cause and per gap, from its spans
        (`labkit.spans.explain_idle_spans`; `.text()` says it in words). `which="all"` reads every step
        of the cell as one (steps of a few ms: one timer tick moves a single step's shares by points),
        "first" or a step index one step. When the ranks formed several pipelines (a (pp, dp) mesh):
        one report per pipeline (`labkit.spans.idle.IdleByPipeline`)."""
        from ..spans import explain_idle_by_pipeline

        return explain_idle_by_pipeline(self.cell_dir(cell), which)

    def compare(self, before: int | list[int], after: int | list[int]):
        """Why cell `after`'s steps take longer than cell `before`'s (or less), by cause, over all their
        steps (`labkit.timeline.explain_slowdown`: the machine, compute per stage and kind, waiting,
        communication, the kit's own share). Lists of cells: rounds, paired in order; two cells: their
        steps, paired in order. Either way it reads each cell's `timeline(cell)` (which carries every clock
        the cell's ranks recorded), so its `.text()` is, word for word, `explain_slowdown` on those Timelines
        and what `labkit timeline --compare` prints for the cells' directories: every cause that changed
        beyond its noise, and how sure that is (the units' spread and agreement, whether the before cells had
        a quiet baseline by `labkit.spans.quiet`'s rule, what was not measured); steps in which torch.compile
        compiled are left out and named apart. Notebook 06b."""
        from ..timeline.slowdown import explain_slowdown

        cells = [[self.timeline(c) for c in (x if isinstance(x, (list, tuple)) else [x])] for x in (before, after)]
        return explain_slowdown(*cells)

    def rounds(self, a: str, b: str, n: int = 3, timeout: float | None = None) -> tuple[list[int], list[int]]:
        """The cells `a` and `b` (code run on every rank) run alternately, `n` times each, in the order A B,
        B A, A B...: whatever the machine drifts into weighs on both sides alike. Returns their cell
        numbers, for `compare(as, bs)` (its verdict weighs each cause against the rounds' spread and says
        whether the `a` cells were a quiet baseline) and for `labkit.spans.quiet_baseline([self.timeline(c)
        for c in as])` (the same rule, alone). Notebooks 06b and 14."""
        cells: tuple[list[int], list[int]] = ([], [])
        for i in range(n):
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                self.exec((a, b)[side], timeout=timeout)
                cells[side].append(self.last_cell)
        return cells
