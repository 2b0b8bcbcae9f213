"""Reading torch.distributed.pipelining's own log lines (TORCH_LOGS=+pp) into `Event`s.

This module owns the log formats: which lines are pipelining records, their time stamps, ranks and
continuation lines (what each message means is `labkit.logs.messages`'s). It reads:

- the kit's format (`PP_LOG_FORMAT`, defined here, one file per rank, microsecond epoch stamps):
  `1732241358.636123 D torch.distributed.pipelining.schedules schedules.py:2614] msg`;
  the rank comes from the file path (torchrun's `.../attempt_N/<rank>/stderr.log`) or `rank=`.
- torch's default format (glog style, whole milliseconds, local time without a year), either one
  file per rank or every rank interleaved in one captured stream:
  `[rank0]:V1122 01:49:18.636000 7438 torch/distributed/pipelining/schedules.py:2614] msg`.
  Launchers add their own prefixes (`[rank0]:[rank0]:`, `[default0]:[rank0]:`); torch's own
  `[rankN]:` (global rank) wins over the file path.

Unrelated lines, warnings, tracebacks and a truncated last line are skipped; continuation lines of
a multi-line record (kit format) are appended to that record's message.

Taught in notebook 06 (reading PP logs).
"""

from __future__ import annotations

import gc
import io
import re
from contextlib import contextmanager
from datetime import datetime
from typing import Iterable, Iterator

from .messages import _NOTHING, Event, decode_message

__all__ = ["PP_LOG_FORMAT", "parse_lines", "parse_files", "parse_run_dir", "rank_from_path", "log_files"]

# The kit's format for the pipelining logger: DEBUG, microsecond epoch stamps (Python's default gives
# whole ms). Defined here, beside its reader, because both sides write it: the launcher sets it as
# TORCH_LOGS_FORMAT for a job's ranks (labkit.launching.command), and a live rank formats its cell's
# log file with it (labkit.ranks.rank), which must not import the launcher's side.
PP_LOG_FORMAT = "%(created).6f %(levelname).1s %(name)s %(filename)s:%(lineno)d] %(message)s"

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
# A record that starts in the middle of a line: in one stream that merges several writers (2>&1,
# `torchrun ... | tee`), a write without its newline yet (a progress line, a print(end="")) and
# another rank's record share a line: "[labkit] progress 1/1 step[rank1]:V1125 20:22:25.210000 ...".
_EMBEDDED_RE = re.compile(r"(?:\[[\w:.-]{1,40}\]:)+[VDIWEC]\d{4} \d\d:\d\d:\d\d"
                          r"|\d{9,11}\.\d+ [DIWEC] torch\.distributed\.pipelining")


def _strip_trace(msg: str) -> str:
    m = _TRACE_RE.match(msg)
    return msg[m.end():] if m else msg


_GLOG_LEVELS = {"V": "D", "D": "D", "I": "I", "W": "W", "E": "E", "C": "C"}  # glog V(erbose) = DEBUG


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: the millions of small tuples a big log makes would trigger it over and
    over, and none of them can be part of a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_new_event = tuple.__new__  # Event(...) without NamedTuple's keyword handling: the hot loop makes millions

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
        with gc_paused():
            return self._parse(lines)

    def _parse(self, lines: Iterable[str]) -> list[Event]:
        events: list[Event] = []
        append = events.append
        new = _new_event
        levels = _GLOG_LEVELS
        cont = -1  # index in `events` of the record that continuation lines belong to (kit format)
        prev_raw = last_raw = ""
        last_is_event = False
        rank0, meaning_only = self.rank, self.meaning_only
        kit_lines = self.kit_lines
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
                    ev = self._default_line(p, n)
                    if ev is not None:
                        if ev is not False:
                            append(ev)
                        # torch's formatter prefixes every line of a multi-line record itself
                        last_is_event, cont = ev is not False, -1
                        continue
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
        cut = last_is_event and prev_raw[-1:] == "\n" and last_raw[-1:] != "\n"
        return self._finish(events, cut)

    def _default_line(self, p: list[str], n: int) -> Event | bool | None:
        """Line n in torch's default format, split at its first two spaces ("[rank0]:V1122
        01:49:18.636000 7438 torch/.../schedules.py:2614] msg"): its event, False when `meaning_only`
        drops it, None when the general path must read it. What follows the time (pid, source,
        message) repeats within a process, so it is looked up whole."""
        tok, hms = p[0], p[1]
        tail = self.default_tails.get(p[2])
        if tail is None:
            tail = self._default_tail(p[2])
        if not tail:
            return None
        pid, static, keep = tail
        if not keep:
            return False
        pre = tok[:-5]
        ranks = self.prefix_rank
        rank = (ranks[pre] if pre in ranks else self._rank(pre)) if pre else self.rank
        key = tok[-4:] + hms[:8]
        t = self.clock.get(key)
        if t is None:
            t = self.clock[key] = self._seconds(tok[-4:], hms)
        if t is not None and len(hms) > 8:
            try:
                t += float(hms[8:])
            except ValueError:
                t = None
        if t is None:
            return None
        return _new_event(Event, (t, rank, pid, _GLOG_LEVELS[tok[-5]], *static, n))

    def _finish(self, events: list[Event], cut: bool) -> list[Event]:
        """The parsed events, their last one's meaning dropped when `cut`, ranks filled in by pid."""
        # A last line without its newline (when the others have one) was cut mid-write: its numbers
        # may be cut too ("chunk 1" of "chunk 12"), so it keeps its text but loses its meaning.
        if cut:
            events[-1] = events[-1]._replace(kind=None, stage=None, microbatch=None, mark=None, origin=None,
                                             time_step=None, action=None, sub=())
        # Lines of a single stream logged before init_process_group carry no [rankN]: use the pid.
        if self.rank is None and any(e.rank is None for e in events):
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
            e = _EMBEDDED_RE.search(line, 1)
            return self._slow(line[e.start():], n) if e is not None else (None, False)
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
