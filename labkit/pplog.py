"""Reading torch.distributed.pipelining's own logs (TORCH_LOGS=+pp) into a measured `Timeline`.

This module owns the log formats and what each pipelining message means. It reads:

- the kit's format (`labkit.launch.PP_LOG_FORMAT`, one file per rank, microsecond epoch stamps):
  `1732241358.636123 D torch.distributed.pipelining.schedules schedules.py:2614] msg`;
  the rank comes from the file path (torchrun's `.../attempt_N/<rank>/stderr.log`) or `rank=`.
- torch's default format (glog style, whole milliseconds, local time without a year), either one
  file per rank or every rank interleaved in one captured stream:
  `[rank0]:V1122 01:49:18.636000 7438 torch/distributed/pipelining/schedules.py:2614] msg`.
  Launchers add their own prefixes (`[rank0]:[rank0]:`, `[default0]:[rank0]:`); torch's own
  `[rankN]:` (global rank) wins over the file path.

Unrelated lines, warnings, tracebacks and a truncated last line are skipped; continuation lines of
a multi-line record (kit format) are appended to that record's message.

What the messages mean (torch 2.11-2.14; the wording has been stable, line numbers move):

| message | emitted by | marks |
|---|---|---|
| `_PipelineScheduleRuntime running time_step <t>, action <a>` | multi-stage schedules (runtime) | START of action `a` (`0F1`, `2I0`, `3W0`, `0B2`, `2SEND_F0`, `(0F3;3B1)OVERLAP_F_B`, `0UNSHARD`, ...) |
| `[<stage>] Forwarded microbatch <i>` / `Backwarded microbatch <i>` | GPipe (and forward-only) | END of F / B (after the sends are posted) |
| `[Stage <s>] Forwarded chunk <i>, outputs: ...` | every stage's forward | END of the forward compute |
| `[Stage <s>] Backwarded chunk <i>` | every stage's backward (B, and I) | END of the backward compute |
| `Using <ScheduleClass>` | schedule constructor | (no action) |
| `Rank determined inference_mode=...` | first step's stage set-up | (no action) |
| `[Stage <s>] Sending tensor|gradient to Stage <d>` | a stage building its send | when the neighbour's input left (`waits="split"`) |
| `batch_p2p ...`, `Grad send info ...` | p2p details | (nothing) |

W (backward for weights) has no line of its own, so only the runtime's START lines time it. GPipe
even logs `Backwarded microbatch` lines when no backward ran (loss_fn=None); the timeline drops them.
`to_timeline` says how intervals are built from these marks. Taught in notebooks 04-06 (measured
timelines, and how they compare with theory).
"""

from __future__ import annotations

import bisect
import gc
import gzip
import io
import operator
import os
import re
import time as _time
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Iterable, NamedTuple

from .timeline import Action, Timeline

__all__ = [
    "Event", "parse_lines", "parse_files", "parse_run_dir", "to_timeline", "timeline_from_path",
    "decode_action", "decode_message", "rank_from_path", "log_files",
]

# ---------------------------------------------------------------------------------------------
# line formats
#
# The hot loop splits lines with str methods (a regex per line costs more than the rest of the
# work together); regexes only handle prefixes, completion messages and unusual formats.

# Launcher prefixes before the record: torch's `[rank0]:`, torchrun --tee's `[default0]:`, a
# TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE's `[rank0]:`, the kit's live stream `[rank0:err] `.
_PREFIX_RE = re.compile(r"(?:\[[\w:.-]{1,40}\]:? ?)+")
_PREFIX_RANK_RE = re.compile(r"\[rank(\d+)[\]:]")
_PREFIX_LOCAL_RE = re.compile(r"\[[a-z_]*?(\d+)[\]:]")
# Any other TORCH_LOGS_FORMAT that starts with %(created)f and holds %(name)s, e.g.
# "%(created).6f %(process)d %(name)s %(message)s".
_GENERIC_RE = re.compile(r"(\d{9,11}\.\d+)((?: [^\s\]]+)*?) (torch\.distributed\.pipelining[\w.]*)"
                         r"(?: ([^\s:]+):(\d+)\])? ?(.*)")
# torch's formatter can put a trace id ` [0/1]` and an artifact ` [__name]` after `file:line]`.
_TRACE_RE = re.compile(r"\[\d+/\d+[^\]\s]*\] ?(?:\[__\w+\] ?)?|\[__\w+\] ?")
# A line that starts another log record (so it is not a continuation of the previous one).
_RECORD_START_RE = re.compile(r"(?:\[[\w:.-]{1,40}\]:? ?)*(?:\d{9,11}\.\d|[VDIWEC]\d{4} |\d{4}-\d\d-\d\d|"
                              r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[: ])")
_KIT_NAME = "torch.distributed.pipelining"


def _strip_trace(msg: str) -> str:
    m = _TRACE_RE.match(msg)
    return msg[m.end():] if m else msg


_GLOG_LEVELS = {"V": "D", "D": "D", "I": "I", "W": "W", "E": "E", "C": "C"}  # glog V(erbose) = DEBUG

# ---------------------------------------------------------------------------------------------
# messages

_RUN_PREFIX = "_PipelineScheduleRuntime running time_step "
_RUNTIME_RE = re.compile(r"running time_step (\d+), action (\S+)")
_DONE_RE = re.compile(r"\[(Stage )?(\d+)\] (Forwarded|Backwarded)(?: (input|weight))? (chunk|microbatch) (\d+)(?:\D|$)")
_SENDING_RE = re.compile(r"\[Stage (\d+)\] Sending (?:zero )?(tensor|gradient) to Stage \d+")
_ACTION_RE = re.compile(r"(\d+)([A-Z][A-Z_]*?)(\d*)$")
_OVERLAP_RE = re.compile(r"\((.*)\)([A-Z][A-Z_]*)$")

# torch _ComputationType value -> timeline kind
_KINDS = {"F": "F", "B": "B", "I": "I", "W": "W", "SEND_F": "SEND", "SEND_B": "SEND", "RECV_F": "RECV",
          "RECV_B": "RECV"}
_TIMELINE_KINDS = ("F", "B", "I", "W", "SEND", "RECV")

START, END = "start", "end"


class Event(NamedTuple):
    """One pipelining log record, with what it means.

    `kind`: F, B, I, W, SEND, RECV for work; UNSHARD, RESHARD, REDUCE_GRAD, OVERLAP_F_B (with
    `sub`, its (kind, stage, microbatch) parts) for other runtime actions; SCHEDULE (`Using ...`,
    the class name in `action`); INIT (`Rank determined inference_mode`); None for anything else
    (p2p details, errors); P2P (`[Stage s] Sending tensor|gradient to Stage d`, `action` SEND_F or
    SEND_B, stage = the sender; the microbatch is the one the stage just finished). `mark`: START ("running ... action", printed BEFORE the work), END (a
    completion line), or None. `origin`: "runtime" (running time_step), "schedule" (GPipe's
    `[s] Forwarded microbatch i`), "stage" (`[Stage s] Forwarded chunk i`), or None. A completion
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


_new_event = tuple.__new__  # Event(...) without NamedTuple's keyword handling: the hot loop makes millions

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
        if not (kind in _TIMELINE_KINDS and mb is None):  # "3I" is a cut line, not an action
            out = (kind, int(m.group(1)), mb, ctype, ())
    else:
        m = _OVERLAP_RE.match(text)
        if m:
            subs = []
            for part in m.group(1).split(";"):
                d = decode_action(part.strip())
                if d is None or d[0] not in _TIMELINE_KINDS:
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


# ---------------------------------------------------------------------------------------------
# parsing


class _Parser:
    """Line-by-line state: the rank, the date of default-format stamps, continuation lines."""

    def __init__(self, rank: int | None, year: int | None, meaning_only: bool = False):
        self.rank = rank
        self.meaning_only = meaning_only
        self.year = year if year is not None else datetime.now().year
        self.last_md = ""
        self.rolled = False
        self.clock: dict[str, float] = {}  # "MMDDHH:MM:SS" -> epoch seconds
        self.prefix_rank: dict[str, int | None] = {}
        self.messages: dict[str, tuple] = {}  # message -> (message, decoded): logs repeat their messages
        # labkit format: "D torch.distributed.pipelining.schedules schedules.py:123] msg\n" (a line
        # after its time stamp) -> ((level, message, meaning..., source), keep); see _kit_rest
        self.kit_lines: dict[str, tuple] = {}
        # torch's default format: "7438 torch/.../schedules.py:2614] msg\n" (after the time) ->
        # (pid, (message, meaning..., source), keep); see _default_tail
        self.default_tails: dict[str, tuple] = {}

    def _rank(self, prefix: str) -> int | None:
        r = self.prefix_rank.get(prefix, -1)
        if r == -1:
            hits = _PREFIX_RANK_RE.findall(prefix)
            if hits:
                r = int(hits[-1])  # torch's own [rankN]: is the innermost (global rank)
            elif self.rank is not None:
                r = self.rank
            else:
                local = _PREFIX_LOCAL_RE.findall(prefix)  # torchrun --tee's [default<local rank>]:
                r = int(local[-1]) if local else None
            self.prefix_rank[prefix] = r
        return r

    def _seconds(self, mmdd: str, hms: str) -> float | None:
        """Epoch seconds of a year-less `MMDD HH:MM:SS` stamp (local time)."""
        year = self.year
        if self.rolled and mmdd[:2] == "12":
            year -= 1  # an interleaved stream can show a rank's last December lines after another's January
        elif mmdd[:2] == "01" and self.last_md[:2] == "12":
            self.year = year = year + 1  # the log ran past new year's eve
            self.rolled = True
            self.last_md = mmdd
        elif mmdd > self.last_md:
            self.last_md = mmdd
        try:
            mo, d, h, mi, s = int(mmdd[:2]), int(mmdd[2:]), int(hms[:2]), int(hms[3:5]), int(hms[6:8])
            try:  # the whole stamp, not midnight + seconds: right across daylight-saving changes
                return datetime(year, mo, d, h, mi, s).timestamp()
            except ValueError:  # 0229 outside a leap year: the file is from an earlier year
                return datetime(year - 1, mo, d, h, mi, s).timestamp()
        except ValueError:
            return None

    def parse(self, lines: Iterable[str]) -> list[Event]:
        # Millions of small tuples would trigger the cyclic GC over and over (none of them can be
        # part of a cycle): pause it while parsing.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._parse(lines)
        finally:
            if enabled:
                gc.enable()

    def _parse(self, lines: Iterable[str]) -> list[Event]:
        events: list[Event] = []
        append = events.append
        new = _new_event
        clock, ranks = self.clock, self.prefix_rank
        levels = _GLOG_LEVELS
        cont = -1  # index in `events` of the record that continuation lines belong to (kit format)
        prev_raw = last_raw = ""
        last_is_event = False
        rank0, meaning_only = self.rank, self.meaning_only
        kit_lines, default_tails = self.kit_lines, self.default_tails
        n = 0
        for n, raw in enumerate(lines, 1):
            prev_raw = last_raw
            last_raw = raw
            if "pipelining" not in raw:
                last_is_event = False
                if cont >= 0:
                    cont = self._continue(events, cont, raw)
                continue
            if "0" <= raw[:1] <= "9":
                # labkit's format: everything after the time stamp repeats from line to line, so
                # what it means is looked up whole (one slice, one dict lookup, one float).
                i = raw.find(" ")
                rest = raw[i + 1:]
                kit = kit_lines.get(rest)
                if kit is None:
                    kit = self._kit_rest(rest)
                if kit:
                    static, keep = kit
                    if not keep:
                        last_is_event = False
                        cont = -1
                        continue
                    try:
                        t = float(raw[:i])
                    except ValueError:
                        pass
                    else:
                        append(new(Event, (t, rank0, None, *static, n)))
                        cont = len(events) - 1
                        last_is_event = True
                        continue
            else:
                p = raw.split(" ", 2)
                tok = p[0]
                if len(p) == 3 and tok[-5:-4] in levels and tok[-4:].isdigit():
                    # torch's default: "[rank0]:V1122 01:49:18.636000 7438 torch/.../schedules.py:2614] msg";
                    # what follows the time (pid, source, message) repeats within a process.
                    tail = default_tails.get(p[2])
                    if tail is None:
                        tail = self._default_tail(p[2])
                    if tail:
                        pid, static, keep = tail
                        if not keep:
                            last_is_event = False
                            cont = -1
                            continue
                        pre = tok[:-5]
                        rank = (ranks[pre] if pre in ranks else self._rank(pre)) if pre else rank0
                        hms = p[1]
                        key = tok[-4:] + hms[:8]
                        t = clock.get(key)
                        if t is None:
                            t = clock[key] = self._seconds(tok[-4:], hms)
                        if t is not None and len(hms) > 8:
                            try:
                                t += float(hms[8:])
                            except ValueError:
                                t = None
                        if t is not None:
                            append(new(Event, (t, rank, pid, levels[tok[-5]], *static, n)))
                            cont = -1  # torch's formatter prefixes every line of a multi-line record itself
                            last_is_event = True
                            continue
            ev = None
            if ev is None:
                # Prefixes with spaces (`[rank0:err] `), other TORCH_LOGS_FORMATs, short lines.
                ev, kit = self._slow(raw.rstrip("\r\n"), n)
                if ev is not None and meaning_only and ev.kind is None and ev.mark is None:
                    ev, kit = None, False
                if ev is None:
                    last_is_event = False
                    if cont >= 0:
                        cont = self._continue(events, cont, raw)
                    continue
                cont = len(events) if kit else -1
            append(ev)
            last_is_event = True
        # A last line without its newline (when the others have one) was cut mid-write: its numbers
        # may be cut too ("chunk 1" of "chunk 12"), so it keeps its text but loses its meaning.
        if last_is_event and prev_raw[-1:] == "\n" and last_raw[-1:] != "\n":
            events[-1] = events[-1]._replace(kind=None, stage=None, microbatch=None, mark=None, origin=None,
                                             time_step=None, action=None, sub=())
        # Lines of a single stream logged before init_process_group carry no [rankN]: use the pid.
        if rank0 is None and any(e.rank is None for e in events):
            by_pid = {e.pid: e.rank for e in events if e.rank is not None and e.pid is not None}
            events = [e._replace(rank=by_pid[e.pid]) if e.rank is None and e.pid in by_pid else e for e in events]
        return events

    def _kit_rest(self, rest: str) -> tuple | bool:
        """What a labkit-format line means after its time stamp (cached): ((level, message, meaning...,
        source), keep: False when `meaning_only` drops it), or False when it is not that format (the
        general path then reads the line)."""
        q = rest.rstrip("\r\n").split(" ", 3)
        out: tuple | bool = False
        if len(q) == 4 and len(q[0]) == 1 and q[1].startswith(_KIT_NAME) and q[2][-1:] == "]":
            md = self.messages.get(q[3])
            if md is None:
                md = self._decode(q[3])
            msg, d = md
            out = ((q[0], msg, *d, q[2][:-1]), not (d is _NOTHING and self.meaning_only))
            if len(self.kit_lines) < 200_000:
                self.kit_lines[rest] = out
        return out  # other formats are not cached: their text after the first space may never repeat

    def _default_tail(self, tail: str) -> tuple | bool:
        """What a default-format line means after its time stamp (cached): (pid, (message, meaning...,
        source), keep), or False when it does not look like torch's format."""
        q = tail.rstrip("\r\n").split(" ", 2)
        if len(q) != 3 or not q[0].isdigit() or q[1][-1:] != "]":
            return False
        msg = q[2]
        if msg[:1] == "[" and ("/" in msg[:12] or msg[:3] == "[__"):
            msg = _strip_trace(msg)
        md = self.messages.get(msg)
        if md is None:
            md = self._decode(msg)
        msg, d = md
        out = (int(q[0]), (msg, *d, q[1][q[1].rfind("/") + 1:-1]), not (d is _NOTHING and self.meaning_only))
        if len(self.default_tails) < 200_000:
            self.default_tails[tail] = out
        return out

    def _decode(self, msg: str) -> tuple:
        """(msg, its meaning), cached: events share one string per distinct message, which keeps a
        million-line parse from allocating (and later freeing) a million message strings."""
        md = (msg, decode_message(msg))
        if len(self.messages) < 200_000:
            self.messages[msg] = md
        return md

    def _slow(self, line: str, n: int) -> tuple[Event | None, bool]:
        """The careful path for what the hot loop does not take: (event or None, kit-like format)."""
        rank = self.rank
        m = _PREFIX_RE.match(line)
        if m is not None:
            rank = self._rank(m.group(0))
            line = line[m.end():]
        p = line.split(" ", 4)
        if len(p) == 5 and len(p[0]) == 5 and p[0][0] in _GLOG_LEVELS and p[0][1:].isdigit() and p[2].isdigit() \
                and p[3][-1:] == "]":
            t = self._seconds(p[0][1:], p[1])
            if t is not None and len(p[1]) > 8:
                try:
                    t += float(p[1][8:])
                except ValueError:
                    t = None
            if t is None:
                return None, False
            msg = _strip_trace(p[4]) if p[4][:1] == "[" else p[4]
            src = p[3][:-1]
            return Event(t, rank, int(p[2]), _GLOG_LEVELS[p[0][0]], msg, *decode_message(msg),
                         src[src.rfind("/") + 1:], n), False
        m = _GENERIC_RE.match(line)
        if m is None:
            return None, False
        t, mid, _name, fname, lno, msg = m.groups()
        pid, lvl = None, "?"
        for tok in mid.split():
            if tok.isdigit():
                pid = int(tok)
            elif tok.isalpha():
                lvl = tok[0].upper()
        ev = Event(float(t), rank, pid, lvl, msg, *decode_message(msg), f"{fname}:{lno}" if fname else "", n)
        return ev, True

    @staticmethod
    def _continue(events: list[Event], i: int, raw: str) -> int:
        """Append a continuation line to record `i`; a new record, a traceback or a blank line ends it."""
        line = raw.rstrip("\r\n")
        if not line or line.startswith("Traceback (most recent call last)") or _RECORD_START_RE.match(line):
            return -1
        events[i] = events[i]._replace(message=events[i].message + "\n" + line)
        return i


def parse_lines(lines: Iterable[str] | str, rank: int | None = None, year: int | None = None,
                meaning_only: bool = False) -> list[Event]:
    """Events of the pipelining lines among `lines` (other lines are skipped).

    `lines`: an iterable of lines (an open file, a list) or one string. Pass lines WITH their
    newlines (as a file yields them) to have a cut last line recognised. `rank`: the rank of lines
    that carry no `[rankN]:` prefix (kit format, one file per rank). `year`: the year of the
    default format's MMDD stamps (default: this year; times are only compared with each other).
    `meaning_only`: keep only records that mean something to a timeline (actions, completions, the
    schedule's set-up), skipping p2p details: about 40% fewer events, what `timeline_from_path` uses.
    """
    if isinstance(lines, str):
        lines = io.StringIO(lines)
    return _Parser(rank, year, meaning_only).parse(lines)


_RANK_DIR_RE = re.compile(r"(?:^|[/\\])(\d+)[/\\][^/\\]+$")
_RANK_NAME_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def rank_from_path(path: str | os.PathLike) -> int | None:
    """torchrun's `.../attempt_0/<rank>/stderr.log` -> rank (also `rank3.log`); None if the path says nothing."""
    s = str(path)
    m = _RANK_DIR_RE.search(s)
    if m:
        return int(m.group(1))
    m = _RANK_NAME_RE.search(os.path.basename(s))
    return int(m.group(1)) if m else None


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="")
    return open(path, encoding="utf-8", errors="replace", newline="")


def parse_files(paths: Iterable[str | os.PathLike] | str | os.PathLike, year: int | None = None,
                meaning_only: bool = False) -> list[Event]:
    """Events of several log files (plain or .gz), in file order. Each file's rank comes from its
    path (`.../attempt_N/<rank>/stderr.log`) unless its lines carry `[rankN]:`. `year` defaults to
    each file's modification year (for the default format's year-less stamps); `meaning_only` as
    in `parse_lines`."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    events: list[Event] = []
    for p in map(Path, paths):
        y = year if year is not None else datetime.fromtimestamp(p.stat().st_mtime).year
        with _open_text(p) as f:
            events += _Parser(rank_from_path(p), y, meaning_only).parse(f)
    return events


def log_files(run_dir: str | os.PathLike) -> list[Path]:
    """The log files of a run directory: torchrun's per-rank stderr.log of the newest attempt
    (`logs/<id>/attempt_<n>/<rank>/stderr.log[.gz]`), else the *.log / *.log.gz / *.txt files in it."""
    d = Path(run_dir)
    newest: dict[int, tuple[int, Path]] = {}
    for f in list(d.glob("logs/*/attempt_*/*/stderr.log")) + list(d.glob("logs/*/attempt_*/*/stderr.log.gz")):
        rank_dir = f.parent
        if not rank_dir.name.isdigit():
            continue
        attempt = int(rank_dir.parent.name.split("_")[-1]) if rank_dir.parent.name.split("_")[-1].isdigit() else 0
        rank = int(rank_dir.name)
        if rank not in newest or attempt >= newest[rank][0]:
            newest[rank] = (attempt, f)
    if newest:
        return [newest[r][1] for r in sorted(newest)]
    return sorted(p for pat in ("*.log", "*.log.gz", "*.txt") for p in d.glob(pat)
                  if p.is_file() and p.name != "launcher.log")


def parse_run_dir(run_dir: str | os.PathLike, year: int | None = None, meaning_only: bool = False) -> list[Event]:
    """Events of a run directory made by `labkit.launch` (or a folder of captured logs)."""
    files = log_files(run_dir)
    if not files:
        raise FileNotFoundError(
            f"No logs in {run_dir}: expected torchrun's logs/<id>/attempt_0/<rank>/stderr.log (as `labkit run` "
            f"writes them) or *.log files. Was the run launched with TORCH_LOGS=+pp (labkit does that)?")
    return parse_files(files, year, meaning_only)


# ---------------------------------------------------------------------------------------------
# timeline


def _by_rank(events: list[Event]) -> dict[int, list[Event]]:
    out: dict = defaultdict(list)
    for e in events:
        out[e.rank].append(e)
    lone = out.pop(None, None)
    if lone is not None and not out:
        out[0] = lone  # one file and no rank anywhere: it is rank 0
    for evs in out.values():
        # Several files for one rank (or a clock step): order by time, stable for equal stamps.
        times = [e.time for e in evs]
        if any(map(operator.gt, times, times[1:])):
            evs.sort(key=operator.attrgetter("time"))
    return dict(out)


_BACKWARD_FAMILY = ("B", "I", "W")


def _runtime_actions(rank: int, evs: list[Event], other: Counter, notes: list[str]) -> tuple[list[Action], int]:
    """Runtime schedules: an action runs from its "running ... action" line to the next one; a
    step's last action (the next line restarts time_step) ends at its completion line, else at the
    last line before the next step."""
    acts: list[Action] = []
    # Forward-only runs (loss_fn=None) still step through the planned B/I/W/SEND_B/RECV_B actions,
    # which return at once: with no "Backwarded chunk" line on the rank, they are dropped.
    ran_backward = any(e.origin == "stage" and e.kind == "B" for e in evs)
    dropped = 0
    steps = 0
    pending: Event | None = None
    p_last = p_done = 0.0
    p_found = False
    inside: list[Event] | None = None  # completion lines inside an OVERLAP_F_B action

    def emit(e: Event, end: float) -> None:
        nonlocal dropped
        if end < e.time:
            end = e.time
        kind = e.kind
        if not ran_backward and (kind in _BACKWARD_FAMILY or (kind in ("SEND", "RECV") and "_B" in e.action)):
            dropped += 1
        elif e.sub:
            subs = _split_overlap(rank, e, inside or [], end)
            if not ran_backward:
                dropped += sum(1 for a in subs if a.kind in _BACKWARD_FAMILY)
                subs = [a for a in subs if a.kind not in _BACKWARD_FAMILY]
            acts.extend(subs)
        elif kind in _TIMELINE_KINDS:
            acts.append(Action(rank, e.stage, e.microbatch, kind, e.time, end))
        else:
            other[kind or (e.action or "?")] += 1

    for e in evs:
        if e.origin == "runtime":
            if pending is None:
                steps += 1
            elif e.time_step > pending.time_step:
                emit(pending, e.time)
            else:  # time_step restarted: a new schedule.step()
                emit(pending, p_done if p_found else p_last)
                steps += 1
            pending, p_last, p_found = e, e.time, False
            inside = [] if e.sub else None
        elif pending is not None:
            if e.time > p_last:
                p_last = e.time
            if e.mark == END:
                if inside is not None:
                    inside.append(e)
                if not p_found and e.stage == pending.stage and e.microbatch == pending.microbatch and \
                        _same_family(e.kind, pending.kind):
                    p_done, p_found = e.time, True
    if pending is not None:
        emit(pending, p_done if p_found else p_last)
    if dropped:
        notes.append(f"rank {rank}: {dropped} backward actions (B/I/W/SEND_B/RECV_B) ran without any backward "
                     f"(forward-only run) and were dropped")
    return acts, steps


def _same_family(done_kind: str | None, kind: str | None) -> bool:
    """A completion line's kind (F, or B for any backward) matches an action's kind."""
    return done_kind == kind or (done_kind == "B" and kind in ("I", "B"))


def _split_overlap(rank: int, e: Event, inside: list[Event], end: float) -> list[Action]:
    """OVERLAP_F_B runs its sub-actions one after the other: each ends at its completion line."""
    acts, t = [], e.time
    subs = list(e.sub)
    for n, (kind, stage, mb) in enumerate(subs):
        if n == len(subs) - 1:
            stop = end
        else:
            hit = next((x.time for x in inside if x.mark == END and x.stage == stage and x.microbatch == mb
                        and _same_family(x.kind, kind) and x.time >= t), None)
            stop = hit if hit is not None else t + (end - t) / (len(subs) - n)
        stop = min(max(stop, t), end)
        acts.append(Action(rank, stage, mb, kind, t, stop))
        t = stop
    return acts


def _completion_actions(rank: int, evs: list[Event], meta_notes: list[str]) -> tuple[list[Action], int]:
    """GPipe / 1F1B: only completion lines. An action starts where the previous one on the rank
    ended (recv waits fold into the compute); the first starts at the step's set-up line."""
    use = "schedule" if any(e.origin == "schedule" for e in evs) else "stage"
    done = [e for e in evs if e.origin == use and e.mark == END and e.kind in ("F", "B", "I", "W")]
    if use == "schedule" and not any(e.origin == "stage" and e.kind == "B" for e in evs):
        # GPipe logs "Backwarded microbatch" even when no backward ran (loss_fn=None).
        dropped = sum(1 for e in done if e.kind == "B")
        if dropped:
            meta_notes.append(f"rank {rank}: {dropped} 'Backwarded microbatch' lines without any backward "
                              f"(forward-only run) were dropped")
        done = [e for e in done if e.kind != "B"]
    if not done:
        return [], 0
    first = done[0]
    before = evs[:next(i for i, e in enumerate(evs) if e is first)]
    setup = [e for e in before if e.kind in ("SCHEDULE", "INIT")]
    prev = setup[-1].time if setup else first.time
    acts, seen, steps = [], set(), 1
    for e in done:
        key = (e.stage, e.kind, e.microbatch)
        if key in seen:  # the same work again: the next schedule.step()
            seen.clear()
            steps += 1
        seen.add(key)
        acts.append(Action(rank, e.stage, e.microbatch, e.kind, min(prev, e.time), e.time))
        prev = e.time
    return acts, steps


def _send_times(by_rank: dict[int, list[Event]]) -> dict[tuple, list[float]]:
    """{("F" | "B", receiving stage, microbatch): [times its input was sent]} from the
    `Sending tensor|gradient` lines. The microbatch is the runtime SEND action's, or (single-stage
    schedules) the one the sending stage finished last."""
    sent: dict[tuple, list[float]] = defaultdict(list)
    for evs in by_rank.values():
        last: dict[tuple, int] = {}
        cur: Event | None = None
        for e in evs:
            if e.origin == "runtime":
                cur = e
            elif e.mark == END:
                last[(e.stage, "F" if e.kind == "F" else "B")] = e.microbatch
            elif e.kind == "P2P":
                fam = e.action[-1]
                if cur is not None and cur.kind == "SEND" and cur.stage == e.stage and f"SEND_{fam}" in cur.action:
                    mb = cur.microbatch
                else:
                    mb = last.get((e.stage, fam))
                if mb is not None:
                    sent[(fam, e.stage + 1 if fam == "F" else e.stage - 1, mb)].append(e.time)
    for ts in sent.values():
        ts.sort()
    return sent


def _split_waits(acts: list[Action], sent: dict[tuple, list[float]]) -> list[Action]:
    """Start each F / B / I no earlier than its input left the neighbouring rank."""
    out = []
    for a in acts:
        if a.kind in ("F", "B", "I"):
            ts = sent.get(("F" if a.kind == "F" else "B", a.stage, a.microbatch))
            if ts:
                i = bisect.bisect_right(ts, a.end) - 1  # this step's send: the last one before the work ended
                if i >= 0 and ts[i] > a.start:
                    a = Action(a.rank, a.stage, a.microbatch, a.kind, ts[i], a.end)
        out.append(a)
    return out


def to_timeline(events: list[Event], source: str = "measured", waits: str = "fold") -> Timeline:
    """Per-rank, per-stage work intervals from parsed events.

    Multi-stage (runtime) schedules print `running time_step t, action a` BEFORE each action: an
    action starts at its line and ends at the next action's line on the same rank, so the rank's
    intervals tile its time; a step's last action ends at its completion line (or the step's last
    line). `(F;B)OVERLAP_F_B` is split into its sub-actions at the first one's completion line.
    SEND and RECV actions only post the p2p ops and are kept with kind SEND / RECV; the wait for a
    RECV happens at the start of the F / B / I that needs it, so it folds into that compute.
    UNSHARD, RESHARD, REDUCE_GRAD are counted in `meta["other_actions"]`.

    GPipe and 1F1B print only completion lines (`Forwarded microbatch` / `Forwarded chunk`): an
    action starts at the previous completion on its rank (the first one at the `Using ...` /
    `inference_mode` set-up line), so time spent waiting for a recv folds into the compute that
    follows it, and from the second step on the first action also holds the time between steps.

    With the default `waits="fold"` the bubble a rank spends waiting for its neighbour is therefore
    counted as compute (GPipe's measured bubble comes out far below (p-1)/(m+p-1)).

    `waits="split"` takes the waits out of the compute: an F (B, I) whose input comes from another
    rank starts no earlier than that rank's `Sending tensor` (`Sending gradient`) line for the same
    microbatch, so the wait shows as idle time (the bubble). The data cannot have arrived before
    it was sent, so this only moves starts later; it needs one clock for all ranks (one machine,
    or well-synchronised nodes) and, in the default format, has millisecond resolution.

    Forward-only runs (loss_fn=None) still log the backward actions they skip (GPipe's
    `Backwarded microbatch`, the runtime's B/I/W/SEND_B/RECV_B): on a rank with no
    `Backwarded chunk` line at all they are dropped, and `meta["notes"]` says so.

    Runs of several steps hold every step's actions (`meta["steps"]` says how many). `meta` also
    holds the schedule class, the timing rule used per rank ("runtime" or "completion") and the
    other runtime actions seen. Times are seconds as logged (epoch; local time for the default
    format): `Timeline.shifted()` makes them start at 0.
    """
    if waits not in ("fold", "split"):
        raise ValueError(f"waits must be 'fold' (recv waits inside the compute) or 'split' (waits shown "
                         f"as idle time), got {waits!r}.")
    enabled = gc.isenabled()
    gc.disable()  # see _Parser.parse
    try:
        return _to_timeline(events, source, waits)
    finally:
        if enabled:
            gc.enable()


def _to_timeline(events: list[Event], source: str, waits: str) -> Timeline:
    notes: list[str] = []
    other: Counter = Counter()
    acts: list[Action] = []
    timing: dict[str, str] = {}
    steps: dict[str, int] = {}
    schedule = None
    by_rank = _by_rank(events)
    for rank, evs in sorted(by_rank.items()):
        schedule = schedule or next((e.action for e in evs if e.kind == "SCHEDULE"), None)
        if any(e.origin == "runtime" for e in evs):
            a, n = _runtime_actions(rank, evs, other, notes)
            timing[str(rank)] = "runtime"
        else:
            a, n = _completion_actions(rank, evs, notes)
            timing[str(rank)] = "completion"
        steps[str(rank)] = n
        acts += a
    # Each rank's actions are already in time order, and ranks come in order.
    if waits == "split":
        acts = _split_waits(acts, _send_times(by_rank))
    meta = {"schedule": schedule, "timing": timing, "waits": waits, "steps": max(steps.values(), default=0),
            "steps_per_rank": steps, "other_actions": dict(other), "notes": notes,
            "n_events": len(events)}
    return Timeline(acts, source=source, meta=meta)


def timeline_from_path(paths: str | os.PathLike | Iterable[str | os.PathLike], year: int | None = None,
                       waits: str = "fold") -> Timeline:
    """A measured Timeline from a run directory, or from one or more log files (either format);
    `waits` as in `to_timeline`."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = log_files(p)
            if not found:
                raise FileNotFoundError(f"No logs in {p}: expected logs/<id>/attempt_0/<rank>/stderr.log or *.log files.")
            files += found
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p} does not exist: pass a run directory or log files.")
    t0 = _time.perf_counter()
    tl = to_timeline(parse_files(files, year, meaning_only=True), waits=waits)
    tl.meta["files"] = [str(f) for f in files]
    tl.meta["parse_s"] = _time.perf_counter() - t0
    return tl
