"""Exporting a timeline as one Chrome / Perfetto trace (open it at ui.perfetto.dev or chrome://tracing).

One process (pid) per rank, one thread (tid) per stage, one complete event ("X") per action,
named like torch's actions (`2F1` = stage 2, forward, microbatch 1). Taught in notebook 06b.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..core.actions import Timeline


def to_chrome_trace(tl: Timeline) -> dict:
    t = tl.shifted()
    events = []
    for r in t.ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for s in sorted({(a.rank, a.stage) for a in t.actions}):
        events.append({"ph": "M", "name": "thread_name", "pid": s[0], "tid": s[1], "args": {"name": f"stage {s[1]}"}})
    for a in t.actions:
        events.append({"ph": "X", "name": f"{a.stage}{a.kind}{a.microbatch}", "cat": a.kind, "pid": a.rank,
                       "tid": a.stage, "ts": round(a.start * 1e6, 3), "dur": round(a.duration * 1e6, 3),
                       "args": {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": tl.source,
                          **{k: v for k, v in tl.meta.items() if isinstance(v, (str, int, float))}}}


def write_chrome_trace(tl: Timeline, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome_trace(tl)))
    return path
