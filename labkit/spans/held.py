"""torch's pipelining records (TORCH_LOGS=+pp) written a moment later, where nothing waits for them: inside a
rank the kit starts, on CPU (gloo), while a schedule steps.

Between the end of a stage's forward (or backward) and the post of its send, torch makes three records
("Forwarded chunk i, outputs: ...", "Sending tensor to Stage k", "batch_p2p fwd_send, [...]"); formatting and
writing them there delayed every hand-off from one rank to the next, on the step's critical path (about
0.2 ms a hand-off on the bench's 8-block LM). Here each such record is made where torch makes it (its
time, `created`, is the moment torch logged it) and handed to the same handlers, with the same format,
in the same order, a moment later: right after the send or receive is posted, before the rank waits
for a peer, before the next compute starts, when the step ends (or raises), at exit, and whenever
`CAP` records are held. So a rank that hangs in a wait, in a compute or in a collective of its own
has written every record made before it (labkit.timeline.stuck reads them); only the posts themselves
come before their records, and on gloo a post never blocks. On CUDA (NCCL, whose first post to a peer
can block until that peer joins) and outside a schedule's step, records are written at once, as torch
writes them.

A filter on each of torch's pipelining loggers (`torch.distributed.pipelining` and the loggers below it,
taken again when new ones appear) holds a record while `HOLD` is on; `release` passes the held records
to their loggers' handlers (`Logger.callHandlers`, which the filter does not see again). Nothing of the
user's logging is changed: other loggers, handlers and formats are left alone, and a pipelining record
reaches every handler it reached before. `labkit.spans.record` turns `HOLD` on and calls `release`.

May import: labkit.versions (the schedule's stages), torch (where a schedule's stages are read)."""

from __future__ import annotations

import logging
import sys

PP_LOGGER = "torch.distributed.pipelining"
CAP = 256  # never more records held than this


class _Hold:
    on = False  # inside a schedule's step, on CPU: set by labkit.spans.record
    records: list = []  # [(logger, record)] in the order torch made them


HOLD = _Hold()
_FILTERED: dict = {}  # logger name: its filter (each logger filtered once)
_SEEN = [0]  # how many loggers logging knew when they were last looked through


class _Held(logging.Filter):
    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger = logger

    def filter(self, record) -> bool:
        if not HOLD.on:
            return True
        HOLD.records.append((self.logger, record))
        if len(HOLD.records) >= CAP:
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


def release() -> None:
    """The held records, to their handlers, in order. Never raises: where passing them on fails, holding stops
    (every later record is written at once) and that is said once on stderr."""
    try:
        while HOLD.records:
            held, HOLD.records = HOLD.records, []
            for lg, record in held:
                lg.callHandlers(record)
    except Exception as e:  # noqa: BLE001  (never break the user's step over the kit's logs)
        HOLD.on, HOLD.records = False, []
        _BROKEN.append(str(e))
        if len(_BROKEN) == 1:
            print(f"[labkit] pipelining records not held: {type(e).__name__}: {e}", file=sys.stderr)


_BROKEN: list[str] = []  # why holding stopped (then it stays off)


def holds(schedule) -> bool:
    """Whether this step's pipelining records may be held a moment: every stage of the schedule on the CPU
    (gloo: a post never blocks), and holding never failed in this process."""
    if _BROKEN:
        return False
    try:
        import torch

        from ..versions import schedule_state

        stages = schedule_state(schedule)[1]
        return bool(stages) and all(torch.device(st.device).type == "cpu" for st in stages)
    except Exception:  # noqa: BLE001  (a schedule the kit cannot read: written at once, as torch does)
        return False
