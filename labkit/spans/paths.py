"""Where spans live and how a rank is told (no torch here: the launcher imports this)."""

from __future__ import annotations

from pathlib import Path

SPANS_DIR_VAR = "LABKIT_SPANS_DIR"  # set by the launcher: the folder of this job's spans files
OFF_VAR = "LABKIT_SPANS"            # "0": record nothing (the overhead benchmark's control)
BOOT_DIR = Path(__file__).resolve().parent / "boot"  # holds the ranks' sitecustomize.py


def span_files(path: str | Path) -> dict[int, Path]:
    """{rank: spans file} of a run directory (`spans/rank<N>.jsonl`), a live-ranks cell directory,
    a `spans` folder, or one file; empty when there are none."""
    p = Path(path)
    if p.is_file():
        stem = p.stem[4:] if p.stem.startswith("rank") else ""
        return {int(stem) if stem.isdigit() else 0: p} if p.suffix == ".jsonl" else {}
    for d in (p / "spans", p):
        found = {int(f.stem[4:]): f for f in d.glob("rank*.jsonl") if f.stem[4:].isdigit() and f.stat().st_size > 0}
        if found:
            return dict(sorted(found.items()))
    return {}
