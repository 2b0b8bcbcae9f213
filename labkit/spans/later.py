"""The kit's deferred work in a rank, done where the rank would idle (a wait for a transfer not yet complete:
`blocks`), at a step's end, or later: torch's held pipelining records written (labkit.spans.held), the
activations' deferred fingerprints taken (labkit.spans.received), and the spans recorder's finished lines
written out, the last step's included (labkit.spans.recorder: `Recorder.ahead`, `Recorder.write_due`).
`labkit.spans.record`'s wrappers call it.

May import: labkit.spans.held, labkit.spans.received."""

from __future__ import annotations

import sys

from . import held, received


def not_recorded(stage, e: Exception) -> None:
    """Said once a stage (`stage` None: once for the deferred fingerprints of every stage)."""
    holder = stage if stage is not None else not_recorded
    if not getattr(holder, "_labkit_received_said", False):
        holder._labkit_received_said = True
        which = f"stage {getattr(stage, 'stage_index', '?')}" if stage is not None else "a stage"
        print(f"[labkit] {which}: inputs not recorded for the step check: {type(e).__name__}: {e}",
              file=sys.stderr)


def settle(more=None) -> None:
    """The activations' deferred fingerprints taken (labkit.spans.received.settle; `more`: as in `idle`)."""
    try:
        received.settle(more)
    except Exception as e:  # noqa: BLE001  (never break the user's step over the check's record)
        received.PENDING.clear()
        not_recorded(None, e)


def idle(rec=None, works=None) -> None:
    """Where the rank would idle (a wait that blocks), or at the step's end: torch's held records written, the
    activations' deferred fingerprints taken (labkit.spans.held, labkit.spans.received) and, with `rec`, the
    step's finished spans written out, the last step's still due first (`Recorder.write_due`, `Recorder.ahead`).
    With the wait's `works`, a piece at a time (a record, a fingerprint, a step's lines), and no more once they
    complete: the rank idles for its peer, and goes on the moment the peer's transfer is in; what is left waits
    for the next wait that blocks, the step's end or the watcher."""
    more = None if works is None else (lambda: blocks(works))

    def go() -> bool:
        return more is None or more()

    if held.HOLD.records:
        held.release(more)
    if received.PENDING and go():
        settle(more)
    if rec is not None:
        if rec.due is not None and go():  # the last step's lines (recorded while recording was on)
            rec.write_due()
        if rec.enabled and go():
            rec.ahead()


def due(rec) -> bool:
    """Whether any of the kit's deferred work is due (`idle`)."""
    return bool(held.HOLD.records or received.PENDING
                or (rec is not None and (rec.due is not None or len(rec.buf) > len(rec.lines) + 1)))


def blocks(works) -> bool:
    """Whether waiting for `works` would block: one of them is not complete yet (the time the rank would idle,
    where the kit's deferred work costs the step nothing). Where it cannot be told: True."""
    try:
        return not all(w.is_completed() for w in works)
    except Exception:  # noqa: BLE001  (a work without is_completed)
        return True
