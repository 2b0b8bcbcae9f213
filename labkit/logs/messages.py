"""What torch's pipelining log messages mean: `Event`, `decode_message`, `decode_action`.

This module owns the meaning of each message; `labkit.logs.parse` owns the line formats around
them and `labkit.logs.intervals` turns the meanings into a timeline. Taught in notebook 06
(reading PP logs).

What the messages mean (torch 2.11-2.14; the wording has been stable, line numbers move):

- `_PipelineScheduleRuntime running time_step <t>, action <a>` (multi-stage schedules, the runtime):
  START of action `a` (`0F1`, `2I0`, `3W0`, `0B2`, `2SEND_F0`, `(0F3;3B1)OVERLAP_F_B`, `0UNSHARD`,
  and since torch 2.15 `1WAIT_SEND_F0`, `1WAIT_SEND_B0`, `0WAIT_REDUCE_GRAD`, ...);
- `[<stage>] Forwarded microbatch <i>` / `Backwarded microbatch <i>` (GPipe, and forward-only):
  END of F / B (after the sends are posted);
- `[Stage <s>] Forwarded chunk <i>, outputs: ...` (every stage's forward): END of the forward compute;
- `[Stage <s>] Backwarded chunk <i>` (every stage's backward, B and I): END of the backward compute;
- `Using <ScheduleClass>` (schedule constructor), `Rank determined inference_mode=...` (the first
  step's stage set-up): no action;
- `[Stage <s>] Sending tensor|gradient to Stage <d>` (a stage building its send): when the
  neighbour's input left (`waits="split"`);
- `batch_p2p ...`, `Grad send info ...` (p2p details): nothing.

W (backward for weights) has no line of its own, so only the runtime's START lines time it. GPipe
even logs `Backwarded microbatch` lines when no backward ran (loss_fn=None); the timeline drops them.
`labkit.logs.intervals.to_timeline` says how intervals are built from these marks.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ..core.actions import COMM_KINDS, COMPUTE_KINDS

__all__ = ["Event", "START", "END", "TIMELINE_KINDS", "decode_action", "decode_message"]

_RUN_PREFIX = "_PipelineScheduleRuntime running time_step "
_RUNTIME_RE = re.compile(r"running time_step (\d+), action (\S+)")
_DONE_RE = re.compile(r"\[(Stage )?(\d+)\] (Forwarded|Backwarded)(?: (input|weight))? (chunk|microbatch) (\d+)(?:\D|$)")
_SENDING_RE = re.compile(r"\[Stage (\d+)\] Sending (?:zero )?(tensor|gradient) to Stage \d+")
_ACTION_RE = re.compile(r"(\d+)([A-Z][A-Z_]*?)(\d*)$")
_OVERLAP_RE = re.compile(r"\((.*)\)([A-Z][A-Z_]*)$")

# torch _ComputationType value -> timeline kind
_KINDS = {"F": "F", "B": "B", "I": "I", "W": "W", "SEND_F": "SEND", "SEND_B": "SEND", "RECV_F": "RECV",
          "RECV_B": "RECV"}
TIMELINE_KINDS = COMPUTE_KINDS + COMM_KINDS  # the kinds an action of a Timeline can have

START, END = "start", "end"


class Event(NamedTuple):
    """One pipelining log record, with what it means.

    `kind`: F, B, I, W, SEND, RECV for work; UNSHARD, RESHARD, REDUCE_GRAD, OVERLAP_F_B (with
    `sub`, its (kind, stage, microbatch) parts) for other runtime actions; SCHEDULE (`Using ...`,
    the class name in `action`); INIT (`Rank determined inference_mode`); None for anything else
    (p2p details, errors); P2P (`[Stage s] Sending tensor|gradient to Stage d`, `action` SEND_F or
    SEND_B, stage = the sender; the microbatch is the one the stage just finished). `mark`: START
    ("running ... action", printed BEFORE the work), END (a completion line), or None. `origin`:
    "runtime" (running time_step), "schedule" (GPipe's `[s] Forwarded microbatch i`), "stage"
    (`[Stage s] Forwarded chunk i`), or None. A completion
    line says "Backwarded" for both B and I: its kind is B. `time_step` numbers the runtime's
    actions (it restarts each step). `time` is in seconds (epoch; local time for the default format).
    """

    time: float
    rank: int | None
    pid: int | None
    level: str  # D I W E C
    message: str
    kind: str | None = None
    stage: int | None = None
    microbatch: int | None = None
    mark: str | None = None
    origin: str | None = None
    time_step: int | None = None
    action: str | None = None
    sub: tuple = ()
    source: str = ""  # "schedules.py:2614": where torch logged it
    lineno: int = 0  # line number in its input (1-based)


# ---------------------------------------------------------------------------------------------
# decoding


_action_cache: dict[str, tuple | None] = {}


def decode_action(text: str) -> tuple | None:
    """Decode a runtime action string: `2F0` -> ("F", 2, 0, "F", ()); `2SEND_F0` -> ("SEND", 2, 0,
    "SEND_F", ()); `(0F3;3B1)OVERLAP_F_B` -> ("OVERLAP_F_B", None, None, "OVERLAP_F_B", (("F", 0, 3),
    ("B", 3, 1))). Returns (kind, stage, microbatch, torch type, sub-actions) or None."""
    hit = _action_cache.get(text, False)
    if hit is not False:
        return hit
    out = None
    m = _ACTION_RE.match(text)
    if m:
        ctype = m.group(2)
        kind = _KINDS.get(ctype, ctype)
        mb = int(m.group(3)) if m.group(3) else None
        if not (kind in TIMELINE_KINDS and mb is None):  # "3I" is a cut line, not an action
            out = (kind, int(m.group(1)), mb, ctype, ())
    else:
        m = _OVERLAP_RE.match(text)
        if m:
            subs = []
            for part in m.group(1).split(";"):
                d = decode_action(part.strip())
                if d is None or d[0] not in TIMELINE_KINDS:
                    subs = None
                    break
                subs.append((d[0], d[1], d[2]))
            if subs:
                out = (m.group(2), None, None, m.group(2), tuple(subs))
    if len(_action_cache) < 100_000:
        _action_cache[text] = out
    return out


_NOTHING = (None, None, None, None, None, None, None, ())


def decode_message(msg: str) -> tuple:
    """(kind, stage, microbatch, mark, origin, time_step, action, sub) of one pipelining message."""
    if msg.startswith(_RUN_PREFIX):
        ts, sep, act = msg[len(_RUN_PREFIX):].partition(", action ")
        if sep and ts.isdigit():
            act = act.strip()
            d = decode_action(act)
            if d is None:
                return (None, None, None, START, "runtime", int(ts), act, ())
            return (d[0], d[1], d[2], START, "runtime", int(ts), act, d[4])
    if msg[:1] == "[":
        m = _DONE_RE.match(msg)
        if m:
            word, part = m.group(3), m.group(4)
            kind = "F" if word == "Forwarded" else {"input": "I", "weight": "W"}.get(part, "B")
            origin = "stage" if (m.group(1) or m.group(5) == "chunk") else "schedule"
            return (kind, int(m.group(2)), int(m.group(6)), END, origin, None, None, ())
        m = _SENDING_RE.match(msg)
        if m:  # a stage builds its send: the data a neighbour waits for leaves now
            return ("P2P", int(m.group(1)), None, None, "stage", None,
                    "SEND_F" if m.group(2) == "tensor" else "SEND_B", ())
        return _NOTHING
    if "running time_step" in msg:  # another wording of the runtime line
        m = _RUNTIME_RE.search(msg)
        if m:
            d = decode_action(m.group(2)) or (None, None, None, None, ())
            return (d[0], d[1], d[2], START, "runtime", int(m.group(1)), m.group(2), d[4])
        return _NOTHING
    if msg.startswith("Using "):
        return ("SCHEDULE", None, None, None, None, None, msg[6:].strip(), ())
    if msg.startswith("Rank determined inference_mode"):
        return ("INIT", None, None, None, None, None, None, ())
    return _NOTHING
