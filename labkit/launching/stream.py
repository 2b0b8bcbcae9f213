"""Live output of a running job: tail every rank's log files and echo new lines, prefixed by rank.

torchrun writes each rank's stdout/stderr to files (`--redirects 3`), so no pipe can fill up and
block a rank; this module follows those files. Pipelining DEBUG records (TORCH_LOGS=+pp) stay in
the files unless `stream="all"`; `[labkit] progress i/n` lines drive the progress bar.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from ..core.progress import Progress, in_notebook

PROGRESS_RE = re.compile(r"\[labkit\] progress (\d+)/(\d+)")
STREAMS = ("output", "all", "none")

# Where a new record begins (so the continuation lines of a multi-line pipelining record, such as
# the tracer's printed graph, can be told apart): a log header in labkit's or torch's default
# format, a traceback, a Python warning, or the kit's own lines.
_RECORD_START = re.compile(r"^(\d{9,}\.\d+ [A-Z] |(\[rank\d+\]:)*[VDIWEC]\d{4} |Traceback "
                           r"|\S+\.py:\d+: \w*Warning|\[labkit\]|\[rank)")


def is_pp_log(line: str) -> bool:
    return "torch.distributed.pipelining" in line or "torch/distributed/pipelining" in line


class Tail:
    """Follows one growing file and yields complete new lines."""

    def __init__(self, path: Path, prefix: str, rank: int | None = None):
        self.path, self.prefix, self.rank, self.pos, self.buf = path, prefix, rank, 0, b""
        self.in_pp_record = False  # inside a multi-line pipelining log record

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        if final and self.buf:
            lines.append(self.buf)
            self.buf = b""
        return [l.decode(errors="replace") for l in lines]


class Streamer:
    """Echoes the new lines of a run directory's logs at each `poll()`."""

    def __init__(self, run_dir: Path, nproc: int, stream: str, progress: Progress | None, echo=None):
        self.run_dir, self.nproc, self.stream, self.progress = run_dir, nproc, stream, progress
        self.echo = echo or (lambda line: print(line, flush=True))
        self.tails: dict[Path, Tail] = {}
        self.pp_lines = 0
        self.heard: dict[int, float] = {}  # rank: when its last output was read (monotonic)

    def _discover(self) -> None:
        if len(self.tails) >= 2 * self.nproc + (self.stream == "all"):
            return  # every file found: no more globbing at each poll while the ranks run
        p = self.run_dir / "launcher.log"
        if p not in self.tails and self.stream == "all":  # torchrun's own chatter; errors reach LaunchError
            self.tails[p] = Tail(p, "[launcher] ")
        for rank in range(self.nproc):
            for s in ("stdout", "stderr"):
                for f in self.run_dir.glob(f"logs/*/attempt_*/{rank}/{s}.log"):
                    if f not in self.tails:
                        self.tails[f] = Tail(f, f"[rank{rank}] " if s == "stdout" else f"[rank{rank}:err] ", rank)

    def poll(self, final: bool = False) -> None:
        self._discover()
        for tail in self.tails.values():
            before = tail.pos
            lines = tail.read(final)
            if tail.pos != before and tail.rank is not None:  # any new output, a line or part of one
                self.heard[tail.rank] = time.monotonic()
            for line in lines:
                m = PROGRESS_RE.search(line)
                if m and self.progress is not None:
                    self.progress.update(int(m.group(1)), int(m.group(2)))
                    if self.progress.enabled and (in_notebook() or sys.stderr.isatty()):
                        continue  # the bar shows it
                if _RECORD_START.match(line):
                    tail.in_pp_record = is_pp_log(line)
                if tail.in_pp_record:
                    self.pp_lines += 1
                    if self.stream != "all":
                        continue
                if self.stream != "none":
                    self.echo(tail.prefix + line)
        if self.progress is not None:
            self.progress.tick()

    def silent_for(self) -> float | None:
        """Seconds since any rank last wrote anything (stdout, stderr, pipelining logs); None until every
        rank has written something (the start-up, importing torch, is not silence)."""
        if len(self.heard) < self.nproc:
            return None
        return time.monotonic() - max(self.heard.values())

    def close(self) -> None:
        """The last lines, and a word on the pipelining lines kept out of the output."""
        self.poll(final=True)
        if self.pp_lines and self.stream == "output":
            self.echo(f"[labkit] {self.pp_lines} pipelining log lines saved in the rank logs (stream='all' shows them)")
