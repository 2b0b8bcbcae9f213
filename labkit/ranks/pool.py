"""`labkit.Ranks`: a pool of live torchrun ranks that run code sent from the notebook, cell by cell.

    with labkit.Ranks(nproc=2) as pool:
        pool.exec("x = torch.ones(2) * rank")
        pool.exec("x.sum().item()")          # {0: 0.0, 1: 2.0}
        pool.timeline()                       # the PP timeline of the last cell

Owns what a cell means across ranks: sending it, streaming its output, collecting each rank's
result, and every way it can go wrong. One rank raising: `RanksError` with that rank's traceback,
and every other rank keeps its namespace. Ranks left blocked by that failure (a send, recv or
collective waiting for the failed rank, no answer within `PEER_GRACE_S`), or stranded (still
waiting there `STRANDED_S` after every other rank left the cell: a step() run on some ranks
only), or past the cell's deadline while waiting there: the error shows where each rank was (its
Python stack, then in pipeline terms: step, action, microbatch, peer, cause), and on gloo the pool
releases them (every rank ends its connections of the process group, the waits fail, every rank
joins a new group): namespaces are kept. A rank that died, a hang in Python or C code, or a
release that fails: the pool restarts, namespaces are lost, and the message says so. Jupyter's
Stop (KeyboardInterrupt) sends SIGINT to the ranks; KeyboardInterrupt is raised again once they
stopped (or the pool was restarted because some would not: their stacks and where they were in
pipeline terms are printed). Every cell's code and per-rank PP logs are kept under
`<run dir>/cells/<NNN>/`. Taught in notebook 01 (live ranks); notebook 00 introduces it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time

from ..core.errors import ConfigError
from ..launching.command import preflight_device
from ..launching.rundir import new_run_dir
from . import channel
from .cell import Cell
from .failure import RanksError, _in_distributed, _indent, _names, _pipeline_hint, failed_start, pipeline_terms
from .job import Job, StartError
from .output import LIVE_MODES, CellOutput
from .readings import CellReadings

DEFAULT_TIMEOUT_S = float(os.environ.get("LABKIT_RANKS_TIMEOUT", "120"))  # a cell's deadline
START_TIMEOUT_S = 120.0
PEER_GRACE_S = 3.0       # after one rank fails, how long the others get to finish before they count as blocked
STRANDED_S = 3.0         # after the other ranks left a cell, how long one may wait in torch.distributed
                         # before it is stranded
RELEASE_WAIT_S = 10.0    # after its gloo connections were ended, how long a blocked rank gets to leave the cell
REGROUP_WAIT_S = 60.0    # ... and every rank to join the new process group
INTERRUPT_GRACE_S = 3.0  # after SIGINT, how long the ranks get to stop
STACKS_WAIT_S = 1.5
DEVICES = ("auto", "cpu", "cuda")

_POOLS: dict = {}  # every open pool in the order it (re)started: an ordered set, closed at exit


def current():
    """The pool `%%ranks` runs cells on, or None: the open pool started (or restarted) last.

    Closing it hands the magic back the pool that was current before: a `with labkit.Ranks(...)`
    block in the middle of a notebook leaves `%%ranks` and `%ranks stop` on the magic's own pool."""
    return next((p for p in reversed(list(_POOLS)) if not p.closed), None)


class Ranks(CellReadings):
    """A pool of `nproc` live ranks under torchrun (real launcher, real process group).

    device: "auto" (one GPU per rank when there are enough, else CPU), "cpu" or "cuda".
    timeout: a cell's default deadline in seconds ($LABKIT_RANKS_TIMEOUT or 120); exec(timeout=) overrides it.
    live: "auto" (a Jupyter kernel shows live lines, then the output grouped by rank), "print", "notebook", or
    "none" or None (shown nowhere: a script's or a bench's pool; each cell's output is still in the rank logs).
    runs_root / out: where the pool's run directory goes (as for `labkit.launching.launch`).
    start_timeout: seconds for every rank to join (a start hung inside init_process_group: told, launched once more).
    """

    def __init__(self, nproc: int = 2, device: str = "auto", *, timeout: float = DEFAULT_TIMEOUT_S,
                 start_timeout: float = START_TIMEOUT_S, runs_root=None, out=None, live: str = "auto",
                 pg_timeout: float = 600.0):
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise ConfigError(f"nproc must be a whole number >= 1, got {nproc!r}.")
        if device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}.")
        live = "none" if live is None else live  # None: shown nowhere, as "none"
        if live not in LIVE_MODES:
            raise ConfigError(f"live must be one of {', '.join(map(repr, LIVE_MODES))}, got {live!r}: \"auto\" shows "
                              "a cell's lines live in Jupyter and prints them elsewhere.")
        self.timeout = self._check_timeout(timeout)
        preflight_device(device, nproc)
        self.nproc, self.device, self.live = nproc, device, live
        self.start_timeout, self.pg_timeout = start_timeout, pg_timeout
        self.run_dir = new_run_dir(out, "ranks", runs_root).resolve()
        (self.run_dir / "config.json").write_text(json.dumps({"pool": "labkit.Ranks", "nproc": nproc, "device": device,
                                                              "timeout": timeout}, indent=2))
        self.closed = True
        self.restarts = self.launches = -1  # the pool's restarts; torchrun launches (a start hung once: two)
        self.cells_run = 0
        self.last_cell: int | None = None
        self._job: Job | None = None
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._start()

    # ---- life cycle

    def _start(self) -> None:
        if self.restarts == -1:
            from ..launching.clean import clean, describe

            ended = clean(all_jobs=False)  # orphans of an earlier kernel that died hard
            channel.sweep_stale()  # ... and the socket folders it left
            if ended:
                print(f"[labkit] before starting the pool: {describe(ended)}", file=sys.stderr, flush=True)
        self.restarts += 1
        for attempt in (1, 2):
            self.launches += 1
            job = Job(self.run_dir, self.nproc, self.device, self.pg_timeout, self.launches)
            try:
                job.start(self.start_timeout)
                break
            except StartError as e:
                text, hung = failed_start(job, str(e), self.nproc, self.start_timeout)
                if attempt == 2 or not hung:
                    first = f"\nThe launch before it hung too: {kept}" if attempt == 2 else ""
                    raise RanksError(text + first) from None
                # A rare hang inside torch's process-group set-up (seen in CI under heavy load, every rank alive
                # in gloo's connect): told, kept in the run directory, and the pool is launched once more.
                kept = self.run_dir / f"start-{self.launches}-hung.txt"
                kept.write_text(text + "\n")
                print(f"[labkit] the pool's {self.nproc} ranks were still setting up their process group after "
                      f"{self.start_timeout:g} s (every rank inside init_process_group; where each was: {kept}): "
                      "launching them once more.", file=sys.stderr, flush=True)
            except BaseException:
                job.stop()
                raise
        self._job, self.closed = job, False
        _POOLS.pop(self, None)
        _POOLS[self] = None  # last in the order: the current pool

    def close(self) -> None:
        """End every rank and the torchrun agent; nothing is left running. Safe to call twice.
        `stop()` is the same call (the word of `%ranks stop`)."""
        job, self._job, self.closed = self._job, None, True
        if job is not None:
            job.stop()
        _POOLS.pop(self, None)  # the pool started before it is current again

    def stop(self) -> None:
        """The same as `close()`: end every rank and the torchrun agent (`%ranks stop` from Python)."""
        self.close()

    def restart(self) -> None:
        """A fresh process group and fresh namespaces (same run directory; cell numbers go on)."""
        if self._job is not None:
            self._job.stop()
            self._job = None
        self.closed = True
        self._start()

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- cells

    def exec(self, code: str, ranks=None, timeout: float | None = None) -> dict:
        """Run `code` on every rank (or the listed ones); {rank: value of the cell's last expression, or None}.

        Raises RanksError when any rank fails (see the module docstring for what is kept), and
        KeyboardInterrupt (after stopping the ranks) when interrupted.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}.")
        if self.closed or self._job is None:
            raise RanksError("This pool is closed. Start a new one with labkit.Ranks(...) (or %ranks start), "
                             "or call pool.restart().")
        targets = self._targets(ranks)
        limit = self._check_timeout(self.timeout if timeout is None else timeout)
        if not self._lock.acquire(blocking=False):
            raise RanksError("The pool is already running a cell (from another thread); wait for it to finish.")
        try:
            return self._exec(code, targets, limit)
        finally:
            self._busy = set()
            self._lock.release()

    def _exec(self, code: str, targets: list[int], limit: float) -> dict:
        job = self._job
        self.cells_run += 1
        n = self.last_cell = self.cells_run
        cell_dir = self.cell_dir(n)
        cell_dir.mkdir(parents=True, exist_ok=True)
        (cell_dir / "cell.py").write_text(code)
        cell = Cell(n, targets, job, CellOutput(self.live))
        self._busy = cell.busy
        try:
            try:
                for r in targets:
                    if not job.send(r, {"t": "exec", "cell": n, "code": code, "log": str(cell_dir / f"rank{r}.log")}):
                        cell.handle(r, None)
                self._pump_cell(cell, time.monotonic() + limit)
                if cell.busy and cell.failed():  # the others get a grace to finish (or to show they are blocked)
                    cell.pump(time.monotonic() + PEER_GRACE_S, lambda: not cell.busy)
            except KeyboardInterrupt:
                self._interrupted(cell)
                raise
        finally:
            cell.out.finish()
            if cell.note:
                print(cell.note, file=sys.stderr, flush=True)
        return self._conclude(cell, limit)

    def _pump_cell(self, cell: Cell, deadline: float) -> None:
        """Until every rank finished, one failed, or the deadline; or until the ranks still busy are
        stranded: waiting in torch.distributed (a send, recv or collective) for STRANDED_S after every
        other rank left the cell, so no rank can ever answer them in this cell (`cell.stranded`)."""
        cell.stranded = False
        while True:
            cell.pump(min(deadline, max(cell.last_done + STRANDED_S, time.monotonic() + 0.5)),
                      lambda: not cell.busy or cell.failed())
            if not cell.busy or cell.failed() or time.monotonic() >= deadline:
                return
            left = cell.busy != set(cell.targets) or len(cell.targets) < self.nproc  # someone is out of the cell
            if left and time.monotonic() - cell.last_done >= STRANDED_S and self._all_waiting(cell, twice=True):
                cell.stranded = True
                return

    def _all_waiting(self, cell: Cell, twice: bool = False) -> bool:
        """Every busy rank's innermost frame is in torch.distributed (a wait), twice in a row when asked."""
        for attempt in range(2 if twice else 1):
            cell.stacks = {}
            stacks = self._stacks(cell, cell.busy)
            if not stacks or not all(_in_distributed(t) for t in stacks.values()):
                return False
            if attempt == 0 and twice:
                time.sleep(0.5)
        return True

    def _conclude(self, cell: Cell, limit: float) -> dict:
        n = cell.n
        failed = {r: m["error"] for r, m in sorted(cell.failures.items())}
        parts = []
        if failed:
            same: dict[str, list[int]] = {}
            for r, tb in failed.items():  # the same error on several ranks (check_step's refusal): shown once
                same.setdefault(tb, []).append(r)
            for tb, rs in same.items():
                parts.append(f"Cell {n} failed on {_names(rs)}{' (the same error on each)' if len(rs) > 1 else ''}:"
                             f"\n{_indent(tb)}")
        if cell.busy:
            blocked = self._stacks(cell, cell.busy)
            if blocked:
                if cell.failed():
                    who = _names(set(failed) | set(cell.dead))
                    parts.append(f"{_names(blocked).capitalize()} did not finish within {PEER_GRACE_S:g} s after "
                                 f"{who} failed: blocked, most likely in a send, recv or collective waiting for "
                                 f"{who}. Where each was:")
                elif getattr(cell, "stranded", False):
                    gone = sorted(set(range(self.nproc)) - set(blocked))
                    parts.append(f"{_names(blocked).capitalize()} kept waiting in torch.distributed (a send, recv or "
                                 f"collective) for {STRANDED_S:g} s after {_names(gone)} had left cell {n}: no rank "
                                 f"could answer. A schedule's step() (or a collective) ran on some ranks only? "
                                 f"Every rank of the pipeline must call schedule.step() in the same cell (the first "
                                 f"stage with the inputs, the last with target= and losses=, the others with "
                                 f"nothing), and every collective must be called on every rank of its group. "
                                 f"Where each was:")
                else:
                    parts.append(f"Cell {n} did not finish within its {limit:g} s deadline on {_names(blocked)}. "
                                 f"Where each rank was:")
                parts += [f"  rank {r}:\n{_indent(s, '      ')}" for r, s in sorted(blocked.items())]
                parts += pipeline_terms(self.cell_dir(n), cell, blocked, self.nproc)  # step, action, peer; cause
                if not cell.failed() and not getattr(cell, "stranded", False):
                    parts.append("If the cell is just slow, raise the deadline: exec(..., timeout=S) "
                                 "or %%ranks --timeout S.")
                if not cell.dead and self._release(cell, blocked):
                    hint = _pipeline_hint({r: m.get("pipeline") for r, m in cell.failures.items()})
                    if hint:
                        parts.insert(0, hint)
                    parts.append(f"The pool released {_names(blocked)}: every rank ended its connections of the "
                                 f"process group, so the wait failed with gloo's 'Connection closed' error, and "
                                 f"the ranks joined a new process group. Every rank keeps its namespace; groups "
                                 f"made from the old one (dist.new_group, a DeviceMesh, a stage built with group=) "
                                 f"must be made again. Fix the cell and run it again.")
                    raise RanksError("\n".join(parts), n, failed, blocked, False, dict(cell.results))
                return self._restart_and_raise(cell, parts, failed, blocked)
        if cell.dead:
            root = cell.job.root_cause() if len(cell.dead) > 1 else None  # the agent's first observed failure
            first, *rest = sorted(cell.dead, key=lambda r: r != root)
            parts.append(f"Rank {first}'s process ended during cell {n} (pid {cell.job.pid(first)}). "
                         f"Last lines of its log:\n{_indent(cell.job.tail(first))}")
            if rest:
                parts.append(f"Then {_names(rest)} ended too (torchrun ends a job when one of its ranks does).")
            return self._restart_and_raise(cell, parts, failed, {})
        if failed:
            hint = _pipeline_hint({r: m.get("pipeline") for r, m in cell.failures.items()})
            if hint:
                parts.insert(0, hint)
            parts.append(f"The pool keeps running and every rank keeps its namespace (on the failed "
                         f"{_names(failed)}, what the cell did before the error stays done). "
                         "Fix the cell and run it again.")
            raise RanksError("\n".join(parts), n, failed, {}, False, dict(cell.results))
        return {r: cell.results.get(r) for r in cell.targets}

    def _stacks(self, cell: Cell, ranks) -> dict[int, str]:
        """Where each still-busy rank is: its reader thread answers with the main thread's stack;
        faulthandler (SIGUSR1, into its stderr.log) when it cannot. Ranks that finish meanwhile drop out."""
        ask = sorted(ranks)
        for r in ask:
            cell.job.send(r, {"t": "stacks", "id": cell.n})
        cell.pump(time.monotonic() + STACKS_WAIT_S, lambda: all(r in cell.stacks or r not in cell.busy for r in ask))
        return {r: cell.stacks.get(r) or cell.job.faulthandler_stack(r) for r in ask if r in cell.busy}

    def _release(self, cell: Cell, blocked: dict) -> bool:
        """Free ranks blocked in a send, recv or collective without ending them (gloo only): every rank
        ends its gloo connections (`rank.release_connections`), the waits fail, the cell ends on
        every rank, and every rank joins a new process group (`rank.regroup`). False (the caller
        restarts the pool) when a blocked rank was elsewhere, did not leave the cell, or a rank died."""
        job = cell.job
        if job.hello.get(0, {}).get("backend") != "gloo" or not all(_in_distributed(t) for t in blocked.values()):
            return False  # nccl: no such release here; a rank in Python or C code is not waiting on a peer
        for r in range(self.nproc):
            job.send(r, {"t": "release", "id": cell.n})
        cell.pump(time.monotonic() + RELEASE_WAIT_S, lambda: not cell.busy or bool(cell.dead))
        if cell.busy or cell.dead:
            return False
        self.regroups = getattr(self, "regroups", 0) + 1
        for r in range(self.nproc):
            job.send(r, {"t": "regroup", "gen": self.regroups})
        cell.pump(time.monotonic() + REGROUP_WAIT_S, lambda: len(cell.regrouped) == self.nproc or bool(cell.dead))
        return len(cell.regrouped) == self.nproc and all(m.get("ok") for m in cell.regrouped.values())

    def _restart_and_raise(self, cell: Cell, parts: list[str], failed: dict, blocked: dict):
        try:
            self.restart()
            parts.append(f"The pool was restarted ({self.nproc} fresh ranks, a new process group): every rank's "
                         f"namespace was lost. Run your set-up cells again.")
        except Exception as e:
            parts.append(f"Restarting the pool failed too ({e}); call pool.restart() (or %ranks restart).")
        raise RanksError("\n".join(parts), cell.n, failed, blocked, True, dict(cell.results))

    def _interrupted(self, cell: Cell) -> None:
        """Jupyter's Stop while a cell runs: SIGINT to the busy ranks, a grace, a restart if some stay blocked."""
        busy = sorted(cell.busy)
        cell.job.signal(busy, signal.SIGINT)
        try:
            cell.pump(time.monotonic() + INTERRUPT_GRACE_S, lambda: not cell.busy)
        except KeyboardInterrupt:
            pass  # a second Stop: stop waiting
        if cell.busy or cell.dead:
            stuck = sorted(cell.busy | set(cell.dead))
            stacks = self._stacks(cell, cell.busy) if cell.busy else {}
            where = "".join(f"\n  rank {r}:\n{_indent(s, '      ')}" for r, s in sorted(stacks.items()))
            where += "".join("\n" + t for t in pipeline_terms(self.cell_dir(cell.n), cell, stacks, self.nproc))
            try:
                self.restart()
                after = "the pool was restarted: every rank's namespace was lost. Run your set-up cells again."
            except Exception as e:
                after = f"restarting the pool failed ({e}); call pool.restart()."
            cell.note = (f"[labkit] cell {cell.n} interrupted: {_names(stuck)} did not stop within "
                         f"{INTERRUPT_GRACE_S:g} s of SIGINT"
                         f"{' (blocked in a send, recv or collective?)' if cell.busy else ''}; "
                         f"{after}{where}")
        else:
            cell.note = (f"[labkit] cell {cell.n} interrupted: {_names(busy)} stopped (KeyboardInterrupt); "
                         f"every rank keeps its namespace.")

    def status(self) -> dict:
        """Per-rank pid / alive / busy, the run directory, cells run and restarts."""
        job = self._job
        hello = job.hello.get(0, {}) if job else {}
        return {"running": not self.closed and job is not None, "nproc": self.nproc,
                "device": hello.get("device", self.device), "backend": hello.get("backend"),
                "run_dir": str(self.run_dir), "cells_run": self.cells_run,
                "restarts": max(self.restarts, 0),
                "ranks": [{"rank": r, "pid": job.pid(r) if job else None, "alive": bool(job) and job.alive(r),
                           "busy": r in self._busy} for r in range(self.nproc)]}

    def pids(self) -> list[int]:
        """The rank processes' pids, in rank order (plus nothing else: the agent is `agent_pid`)."""
        return [self._job.pid(r) for r in range(self.nproc)] if self._job else []

    @property
    def agent_pid(self) -> int | None:
        return self._job.proc.pid if self._job and self._job.proc else None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return (f"Ranks(nproc={self.nproc}, device={self.device!r}, {state}, cells_run={self.cells_run}, "
                f"run_dir='{self.run_dir}')")

    # ---- checks

    def _targets(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.nproc))
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        out = sorted(set(ranks))
        bad = [r for r in out if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.nproc]
        if bad or not out:
            raise ConfigError(f"ranks must be rank numbers from 0 to {self.nproc - 1}, got {ranks!r}.")
        return out

    @staticmethod
    def _check_timeout(t) -> float:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {t!r}.")
        return float(t)


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        try:
            pool.close()
        except Exception:
            pass
