"""IPython magics for live ranks: `%load_ext labkit`, then `%%ranks` cells and `%ranks` commands.

    %ranks start --nproc 2 --device auto     # a pool (the cell magic starts one itself if needed)
    %%ranks                                  # this cell runs on every rank, output prefixed [rankN]
    %%ranks --ranks 0,1 --timeout 30         # on some ranks, with a deadline
    %%ranks --timeline                       # ... then draw the cell's measured timeline beside its ideal
    %ranks status | restart | stop

Owns the notebook face of `labkit.Ranks`: argument parsing, the default pool, printing each rank's
last value (`[rank0] Out: ...`) and the timeline figure. Taught in notebook 01 (live ranks).
"""

from __future__ import annotations

import argparse
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..core.shown import shown
from . import pool as _pool
from .pool import DEFAULT_TIMEOUT_S, Ranks, RanksError

DEFAULTS = {"nproc": 2, "device": "auto"}


class _Parser(argparse.ArgumentParser):
    """argparse that never exits the kernel: errors become UsageError (`%ranks?` shows the help)."""

    def __init__(self, **kwargs):
        super().__init__(add_help=False, **kwargs)

    def error(self, message):
        raise UsageError(f"{message}\n{self.format_usage()}")

    def exit(self, status=0, message=None):
        raise UsageError(message or self.format_usage())


def _line_parser() -> _Parser:
    p = _Parser(prog="%ranks", description="Start, stop, restart or show the pool of live ranks.")
    p.add_argument("command", choices=["start", "stop", "restart", "status"])
    p.add_argument("--nproc", type=int, default=None, help="ranks in the pool (default 2)")
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"], help="default auto")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="a cell's default deadline, seconds")
    return p


def _cell_parser() -> _Parser:
    p = _Parser(prog="%%ranks", description="Run this cell on every rank of the pool (or on --ranks).")
    p.add_argument("--ranks", default=None, help="comma-separated ranks, e.g. 0,1 (default: all)")
    p.add_argument("--timeline", action="store_true", help="draw the cell's measured timeline beside its ideal")
    p.add_argument("--timeout", type=float, default=None, help="this cell's deadline in seconds")
    return p


def _parse_ranks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(f"--ranks takes rank numbers separated by commas, e.g. --ranks 0,1; got {text!r}.") from None


def status_text(st: dict) -> str:
    """A short table of `Ranks.status()` (pids vary: keep it out of tested outputs); the run directory
    as `labkit.core.shown` writes it (relative to the current folder)."""
    head = (f"pool: {'running' if st['running'] else 'stopped'}, {st['nproc']} ranks, device {st['device']}, "
            f"backend {st['backend']}, cells run {st['cells_run']}, restarts {st['restarts']}\n"
            f"run dir: {shown(st['run_dir'])}")
    rows = [f"  rank {r['rank']}: pid {r['pid']}, {'alive' if r['alive'] else 'gone'}, "
            f"{'busy' if r['busy'] else 'idle'}" for r in st["ranks"]]
    return "\n".join([head, *rows])


def draw_timeline(pool: Ranks, cell: int | None = None):
    """The cell's measured timeline (its last step) above the ideal one with fitted costs; returns the
    Figure. Ranks that formed several pipelines (a (pp, dp) mesh) get one pair per pipeline."""
    from ..timeline.compare import one_step, pipelines_vs_ideal
    from ..timeline.plot import plot_pipelines

    measured = one_step(pool.timeline(cell))
    try:
        views = pipelines_vs_ideal(measured)
    except ValueError as e:
        raise RanksError(f"Cannot draw the ideal timeline: {e} Build the schedule in a %%ranks cell of this "
                         f"pool (torch logs its name when it is built).") from None
    n = pool.last_cell if cell is None else cell
    for part, _, summary in views:
        counts = part.counts()
        kinds = "".join(f", {sum(v for (s, k), v in counts.items() if k == kind)} {kind}"
                        for kind in ("F", "B", "I", "W") if any(k == kind for (_, k) in counts))
        which = (f" pipeline {summary['pipeline']} (ranks {', '.join(map(str, summary['ranks']))}):"
                 if "pipeline" in summary else "")
        print(f"[labkit] cell {n} timeline:{which} {summary['schedule']}, pp_size {summary['pp_size']}, "
              f"{summary['n_microbatches']} microbatches{kinds}")
    return plot_pipelines(views)


@magics_class
class RanksMagics(Magics):
    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None):
        """%ranks start|stop|restart|status [--nproc N] [--device D];
        %%ranks [--ranks 0,1] [--timeline] [--timeout S]"""
        if cell is None:
            return self._line(line)
        return self._cell(line, cell)

    def _line(self, line: str) -> None:
        args = _line_parser().parse_args(shlex.split(line))
        pool = _pool.current()
        nproc, device = args.nproc or DEFAULTS["nproc"], args.device or DEFAULTS["device"]
        if args.command == "start":
            if pool is not None:
                print(f"A pool is already running ({pool.nproc} ranks); `%ranks restart` gives fresh ranks, "
                      f"`%ranks stop` ends it.")
                return
            pool = Ranks(nproc=nproc, device=device, timeout=args.timeout)
            print(f"Started a pool of {pool.nproc} ranks (device {device}).")
        elif args.command == "status":
            if pool is None:
                print("No pool is running: `%ranks start` starts one (a `%%ranks` cell too).")
            else:
                print(status_text(pool.status()))
        elif pool is None:
            print(f"No pool is running: nothing to {args.command}. `%ranks start` starts one.")
        elif args.command == "stop":
            pool.close()
            print(f"Stopped the pool ({pool.nproc} ranks); no rank is left running.")
        elif (args.nproc or pool.nproc) != pool.nproc or (args.device or pool.device) != pool.device:
            pool.close()  # another size or device: a new pool
            pool = Ranks(nproc=args.nproc or pool.nproc, device=args.device or pool.device, timeout=args.timeout)
            print(f"Restarted as a new pool of {pool.nproc} ranks (device {pool.device}), empty namespaces.")
        else:
            pool.restart()
            print(f"Restarted the pool: {pool.nproc} fresh ranks, empty namespaces.")

    def _cell(self, line: str, cell: str):
        args = _cell_parser().parse_args(shlex.split(line))
        pool = _pool.current()
        if pool is None:
            pool = Ranks(**DEFAULTS)
            print(f"[labkit] No pool was running: started one with {DEFAULTS['nproc']} ranks (device "
                  f"{DEFAULTS['device']}). `%ranks start --nproc N` picks the size; `%ranks stop` ends it.")
        results = pool.exec(cell, ranks=_parse_ranks(args.ranks), timeout=args.timeout)
        for r, value in sorted(results.items()):
            if value is not None:
                print(f"[rank{r}] Out: {value!r}")
        if args.timeline:
            from IPython.display import display

            display(draw_timeline(pool))


def load_ipython_extension(ip) -> None:
    ip.register_magics(RanksMagics)
