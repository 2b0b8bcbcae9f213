"""torch's pipelining records (TORCH_LOGS=+pp) written where the rank would idle anyway: inside a rank the kit
starts, on CPU (gloo), while a schedule steps.

Formatting and writing a record takes 10-60 us of the rank's only thread (torch's `logger.debug`, its
handler, the format, the write); a step makes 17 on each rank of a 2-stage 1F1B. Written where torch makes
them, between a stage's compute and the post of its send, they delay every hand-off to the next rank, so
the step. Here each record is made where torch makes it (its time, `created`, is the moment torch logged
it) and handed to the same handlers, with the same format, in the same order, later:

- when the rank is about to wait for a peer whose transfer has not completed (`labkit.spans.record`'s wait
  wrapper): the time the rank would idle;
- when the step ends or raises, at exit, and whenever `CAP` records are held;
- by a watcher thread, once the oldest record was held `LATE` seconds: a rank that stopped inside a compute
  (a collective in a stage's forward that never completes, a loop) has its records written all the same.

So a rank that hangs in a wait, a compute, a collective of its own or a loader has written every record
made before (labkit.timeline.stuck reads them). On CUDA (NCCL, whose first post to a peer can block until
that peer joins) and outside a schedule's step, records are written at once, as torch writes them.

A filter on each of torch's pipelining loggers (`torch.distributed.pipelining` and the loggers below it,
taken again when new ones appear) holds a record while `HOLD.on`; `release` passes the held records to
their loggers' handlers (`Logger.callHandlers`, which the filter does not see again). Nothing of the user's
logging is changed: other loggers, handlers and formats are left alone, and a pipelining record reaches
every handler it reached before. Records of other loggers (a user's `TORCH_LOGS=recompiles`) are written at
once, so a held pipelining record may follow one made after it in a shared stream; each line carries
torch's own time (the kit's format, `%(created)`). The watcher also writes a step's span lines left due for
LATE seconds (`TICKS`: labkit.spans.record). It is a daemon thread that takes no signal (a stack dump's
SIGABRT still lands on the rank's main thread), one per process, started when a first record or step line
is held.
`labkit.spans.record` turns `HOLD.on` on and calls `release`.

May import: labkit.versions (the schedule's stages), torch (where a schedule's stages are read)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

PP_LOGGER = "torch.distributed.pipelining"
CAP = 256  # never more records held than this
LATE = 1.0  # seconds a record may be held before the watcher writes it
SOON = 0.05  # seconds the watcher, woken, leaves the rank to reach a blocking wait first (`wake`)


class _Hold:
    on = False  # inside a schedule's step, on CPU: set by labkit.spans.record
    records: list = []  # [(logger, record)] in the order torch made them


HOLD = _Hold()
_FILTERED: dict = {}  # logger name: its filter (each logger filtered once)
_SEEN = [0]  # how many loggers logging knew when they were last looked through
_LOCK = threading.RLock()  # the held records, between the rank's thread and the watcher
_WATCHER = [0]  # the pid whose watcher runs (a forked rank starts its own)


class _Held(logging.Filter):
    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger = logger

    def filter(self, record) -> bool:
        if not HOLD.on:
            return True
        with _LOCK:
            HOLD.records.append((self.logger, record))
            n = len(HOLD.records)
        if n == 1:
            nudge()  # the watcher, waiting with nothing due, looks again every LATE / 4 s from now
        if n >= CAP:
            release()
        return False


def watch_loggers() -> None:
    """A filter on every pipelining logger that has none yet (cheap when no logger was made since)."""
    names = logging.Logger.manager.loggerDict
    if len(names) == _SEEN[0]:
        return
    _SEEN[0] = len(names)
    for name, lg in list(names.items()):
        if (name == PP_LOGGER or name.startswith(PP_LOGGER + ".")) and isinstance(lg, logging.Logger) \
                and name not in _FILTERED:
            f = _FILTERED[name] = _Held(lg)
            lg.addFilter(f)


def release(more=None) -> None:
    """The held records, to their handlers, in order; with `more`, one at a time while `more()` says to go on
    (the rank's wait has not completed: labkit.spans.later.idle). Never raises: where passing them on fails,
    holding stops (every later record is written at once) and that is said once on stderr."""
    try:
        with _LOCK:
            while HOLD.records:
                if more is None:
                    held, HOLD.records = HOLD.records, []
                    for lg, record in held:
                        lg.callHandlers(record)
                else:
                    lg, record = HOLD.records.pop(0)
                    lg.callHandlers(record)
                    if not more():
                        return
    except Exception as e:  # noqa: BLE001  (never break the user's step over the kit's logs)
        HOLD.on, HOLD.records = False, []
        _BROKEN.append(str(e))
        if len(_BROKEN) == 1:
            print(f"[labkit] pipelining records not held: {type(e).__name__}: {e}", file=sys.stderr)


_BROKEN: list[str] = []  # why holding stopped (then it stays off)


def overdue(now: float | None = None) -> bool:
    """Whether the oldest held record was made `LATE` seconds ago or more."""
    records = HOLD.records
    return bool(records) and (now if now is not None else time.time()) - records[0][1].created >= LATE


TICKS: list = []  # what the watcher also calls, with whether it was woken (labkit.spans.record: a step's lines);
# each returns whether it still has something due (then the watcher looks again LATE / 4 s later)
_WAKE = [threading.Event()]  # set: the watcher looks now (`wake`, and the first record held)
_WOKEN = [False]  # ... and runs its TICKS at once (`wake`)


def watch() -> None:
    """This process's watcher started, unless it runs."""
    if _WATCHER[0] != os.getpid():
        _watch()


def wake() -> None:
    """The watcher woken (started where it does not run): `SOON` s later its `TICKS` are called with `True` (a
    step's span lines are ready, labkit.spans.record: written from the watcher while the rank goes on, unless
    the rank wrote them first where it idled, at a blocking wait, with no other thread wanting the GIL)."""
    _WOKEN[0] = True
    nudge()


def nudge() -> None:
    """The watcher (started where it does not run) looks now, and every LATE / 4 s while anything is held or due:
    a first record held, a step's lines left due (whatever else wakes it)."""
    watch()
    _WAKE[0].set()


def _watch() -> None:
    """This process's watcher: when woken (`wake`, or a first record held) and then every LATE / 4 s while
    anything is held or due, the held records written if the oldest is overdue, and `TICKS` called with whether
    it was woken. With nothing held or due it waits without a timeout, never running: a stack dump of all
    threads (faulthandler, from the rank's main thread: labkit.launching.stop) walks no frame that moves."""
    _WATCHER[0] = os.getpid()

    def loop() -> None:
        try:  # signals go to the rank's main thread (a stack dump's SIGABRT names what it was doing)
            signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
        except (AttributeError, OSError, ValueError):  # pragma: no cover (not on Linux)
            pass
        due = True
        while True:
            event = _WAKE[0]
            event.wait(LATE / 4 if due else None)
            event.clear()
            woke, _WOKEN[0] = _WOKEN[0], False
            if woke:
                time.sleep(SOON)
            if overdue():
                release()
            due = bool(HOLD.records)
            for tick in TICKS:
                try:
                    due = bool(tick(woke)) or due
                except Exception:  # noqa: BLE001  (the watcher never dies over one of them)
                    pass

    try:
        threading.Thread(target=loop, name="labkit-held-pp-records", daemon=True).start()
    except RuntimeError as e:  # pragma: no cover (no thread can start: at interpreter shutdown)
        HOLD.on = False
        _BROKEN.append(str(e))


def _after_fork() -> None:
    """A forked child (a warm rank) holds nothing of its parent's and starts its own watcher when it holds."""
    global _LOCK
    _LOCK = threading.RLock()
    _WAKE[0] = threading.Event()
    _WOKEN[0] = False
    HOLD.records = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def holds(schedule) -> bool:
    """Whether this step's pipelining records may be held: every stage of the schedule on the CPU (gloo: a
    post never blocks), and holding never failed in this process."""
    if _BROKEN:
        return False
    try:
        import torch

        from ..versions import schedule_state

        stages = schedule_state(schedule)[1]
        return bool(stages) and all(torch.device(st.device).type == "cpu" for st in stages)
    except Exception:  # noqa: BLE001  (a schedule the kit cannot read: written at once, as torch does)
        return False
