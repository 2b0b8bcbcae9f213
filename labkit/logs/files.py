"""Which files of a run hold its pipelining logs, the rank of each, and reading them whole (plain
or gzipped) with `labkit.logs.parse`'s line parser."""

from __future__ import annotations

import gzip
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Iterable

from .messages import Event
from .parse import _Parser

_RANK_DIR_RE = re.compile(r"(?:^|[/\\])(\d+)[/\\][^/\\]+$")
_RANK_NAME_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def rank_from_path(path: str | os.PathLike) -> int | None:
    """`rank3.log` -> 3, else torchrun's `.../attempt_0/<rank>/stderr.log` -> rank; None if the path says
    nothing. The file's own name wins: a live-ranks cell keeps `cells/007/rank1.log`, whose folder is
    the cell's number."""
    s = str(path)
    m = _RANK_NAME_RE.search(os.path.basename(s))
    if m:
        return int(m.group(1))
    m = _RANK_DIR_RE.search(s)
    return int(m.group(1)) if m else None


def _open_text(path: Path):
    with open(path, "rb") as f:  # gzip's magic bytes, not the name: a gzipped run.log is read too
        gz = f.read(2) == b"\x1f\x8b"
    if gz:
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
    """Events of a run directory made by `labkit.launching.launch` (or a folder of captured logs)."""
    files = log_files(run_dir)
    if not files:
        raise FileNotFoundError(
            f"No logs in {run_dir}: expected torchrun's logs/<id>/attempt_0/<rank>/stderr.log (as `labkit run` "
            f"writes them) or *.log files. Was the run launched with TORCH_LOGS=+pp (labkit does that)?")
    return parse_files(files, year, meaning_only)

