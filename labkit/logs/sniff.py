"""What a file holds, told by its content, never by its name: a PP log, a profiler trace, a spans file,
or none of these (and why not).

`labkit timeline PATH` and `labkit.timeline.compare.load_timeline` ask this before they choose a reader, so a
log from a plain `torchrun` run (`run.log`, `out.txt`, gzipped or not, any of the formats
`labkit.logs.parse` reads) goes to the log reader and a Chrome trace to the profiler's, whatever
they are called; anything else gets one error that says what was expected (`not_readable`).
Taught in notebook 06.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from itertools import islice
from pathlib import Path

__all__ = ["EXPECTED", "NO_PP_LINES", "file_kind", "not_readable", "open_binary", "read_json"]

GZIP_MAGIC = b"\x1f\x8b"
_HEAD = 1 << 20  # bytes read to find "traceEvents" (torch writes it after a few kB of device properties)
_LINES = 5000  # lines parsed at a time while looking for a first pipelining record
NO_PP_LINES = ("is text without a single torch.distributed.pipelining log line (was the run launched with "
               "TORCH_LOGS=+pp? labkit run and labkit launch set it)")

EXPECTED = ("labkit timeline reads a run or cell directory (its spans, else its profiler traces, else its "
            "logs), a log of a run launched with TORCH_LOGS=+pp (the kit's format or torch's default one, "
            "plain or .gz, one rank per file or all ranks in one file as plain torchrun prints them), or a "
            "torch.profiler Chrome trace (JSON with traceEvents, as labkit run --profile writes).")


def open_binary(path: str | os.PathLike):
    """The file's bytes, gunzipped when they are gzip's (by the magic bytes, not the name)."""
    with open(path, "rb") as f:
        gz = f.read(2) == GZIP_MAGIC
    return gzip.open(path, "rb") if gz else open(path, "rb")


def read_json(path: str | os.PathLike):
    """A JSON file (gzipped or not); a file that is not JSON raises ValueError saying where it broke."""
    with open_binary(path) as f:
        data = f.read()
    try:
        return json.loads(data)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def _has_pp_record(path: Path) -> bool:
    """True when the parser finds at least one torch.distributed.pipelining record in the file."""
    from .parse import parse_lines

    with open_binary(path) as raw, io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="") as f:
        while True:
            chunk = list(islice(f, _LINES))
            if not chunk:
                return False
            if parse_lines(chunk, rank=0, year=2000):
                return True


def file_kind(path: str | os.PathLike) -> tuple[str | None, str]:
    """(`"log"`, `"trace"`, `"spans"` or None, why): what the file at `path` holds.

    - `"trace"`: a JSON object with `traceEvents` (a Chrome trace, e.g. torch.profiler's);
    - `"spans"`: the kit's spans file (JSON lines, `labkit.spans.record`);
    - `"log"`: text in which `labkit.logs.parse` finds at least one pipelining record;
    - None: anything else; `why` says what it is instead (empty, binary, JSON without traceEvents,
      text without any pipelining record).
    """
    p = Path(path)
    if not p.exists():
        return None, "does not exist"
    if p.is_dir():
        return None, "is a directory"
    with open_binary(p) as f:
        head = f.read(_HEAD)
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not text:
        return None, "is empty"
    if b"\x00" in head[:4096]:
        return None, "is a binary file, not text"
    first = text[:1]
    if first == b"[" and _has_pp_record(p):  # `[` opens torch's default log lines too (`[rank0]:V1122 ...`)
        return "log", "a PP log"
    if first in (b"{", b"["):
        line = text.split(b"\n", 1)[0]
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and ("meta" in row or {"kind", "step", "start", "end"} <= row.keys()) \
                and "traceEvents" not in row:
            return "spans", "the kit's spans (JSON lines)"
        if b'"traceEvents"' in head:
            return "trace", "a Chrome trace (JSON with traceEvents)"
        try:
            data = read_json(p)
        except ValueError as e:  # not JSON: a log whose first line a script printed (`{'lr': 0.1}`)?
            if first == b"{" and _has_pp_record(p):
                return "log", "a PP log"
            return None, str(e).replace(f"{p} ", "", 1) if first == b"{" else NO_PP_LINES
        if isinstance(data, dict) and "traceEvents" in data:
            return "trace", "a Chrome trace (JSON with traceEvents)"
        what = (f"an object with keys {', '.join(list(map(str, data))[:6]) or 'none'}" if isinstance(data, dict)
                else f"a JSON {type(data).__name__}")
        return None, f"is JSON without traceEvents ({what}), not a profiler trace"
    if first != b"[" and _has_pp_record(p):
        return "log", "a PP log"
    return None, NO_PP_LINES


def not_readable(path: str | os.PathLike, why: str) -> str:
    """The one message for a path that is neither a run directory, a PP log nor a profiler trace."""
    return (f"{path} {why}. {EXPECTED} Pass the run's directory, its log file(s), or --source to say "
            f"which reader to use.")
