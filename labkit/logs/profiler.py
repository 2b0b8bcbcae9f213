"""Timelines from torch.profiler traces (`labkit run --profile`): each rank's compute actions, as
the host saw them.

The kit's scripts name each stage's compute themselves when profiling (`labkit::<stage><kind><mb>`,
see `labkit.worker.distributed.annotate_stages`). On a CPU those ranges are the compute itself, for every
schedule (they agree with the kit's spans within 0.03: notebook 06b, bench). On a GPU they are not:
an annotation is a host-side range (`cat: user_annotation`), and so are the operators that narrow
torch's own annotations below (`cat: cpu_op`), so with asynchronous kernels they time the *launch*
of an action's work, not the kernels (which the trace holds as separate device events, `cat: kernel`, on the GPU's
streams; this reader does not use them). A GPU timeline needs device times: the kit's spans, CUDA
events around each action (`labkit.spans.record`); what the profiler reads on a GPU has not been
measured in this lab (notebook 06, section 4). For any other script, the schedules' own annotations
are used: they wrap each action in `record_function`: `Forward <i>` / `Backward <i>` in the
single-stage schedules (GPipe, 1F1B) and `PP:<action>` in the multi-stage runtime (`PP:0F1`,
`PP:2I0`, `PP:3W0`, `PP:(0F3;3B1)OVERLAP_F_B`). Those spans begin BEFORE the wait for the
incoming activation or gradient, so an action's compute is taken as the span of the operators
that run inside the annotation (first op start to last op end), with the communication ops
(`gloo:*`, `nccl:*`, `c10d::*`, `record_param_comms`) left out. That is what makes the measured
bubble comparable with the ideal one. This module owns reading those traces; action names are
decoded as the logs' are (`labkit.logs.messages.decode_action`). Taught in notebook 06b.
"""

from __future__ import annotations

import json
import os
import re
from bisect import bisect_left
from pathlib import Path
from typing import Iterable

from ..core.errors import ConfigError
from ..core.actions import COMPUTE_KINDS, Action, Timeline
from .messages import decode_action

__all__ = ["ANNOTATION_PREFIX", "actions_from_trace", "profile_files", "timeline_from_profile"]

ANNOTATION_PREFIX = "labkit::"  # the same as labkit.worker.distributed.ANNOTATION_PREFIX (worker imports torch)

_SINGLE = re.compile(r"^(Forward|Backward) (\d+)$")
_COMM = ("gloo:", "nccl:", "c10d::", "record_param_comms", "ProfilerStep")


def profile_files(path: str | Path | Iterable[str | Path]) -> dict[int, Path]:
    """{rank: trace} from a run directory (`profile/rank<N>.json`), a trace file, or several: a file
    counts when its content is a Chrome trace (`labkit.logs.sniff`), whatever its name; the rank
    comes from the name (`rank1.json`), else the order."""
    if isinstance(path, (str, os.PathLike)) and Path(path).is_dir():
        files = sorted(Path(path).glob("profile/rank*.json"))
    else:
        from .sniff import file_kind

        given = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        files = [Path(f) for f in given if file_kind(f)[0] == "trace"]
    out = {}
    for f in files:
        m = re.search(r"rank(\d+)", f.name)
        out[int(m.group(1)) if m else len(out)] = f
    return out


def _stage_placement(run_dir: Path) -> list[list[int]] | None:
    res = run_dir / "result.json"
    if res.exists():
        try:
            return json.loads(res.read_text()).get("stage_placement")
        except ValueError:
            return None
    return None


def actions_from_trace(trace: dict, rank: int, stage_of_rank: int | None = None) -> list[Action]:
    """Compute actions of one rank's chrome trace (times in seconds, the profiler's clock).

    The kit's own annotations (`labkit::0F1`, from `worker.annotate_stages`) wrap exactly the
    compute and are used when present; otherwise torch's schedule annotations are narrowed to
    the operators inside them.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kit = [e for e in events
           if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(ANNOTATION_PREFIX)]
    if kit:
        out = []
        for e in kit:
            d = decode_action(e["name"][len(ANNOTATION_PREFIX):])
            if d and d[0] in COMPUTE_KINDS:
                out.append(Action(rank, d[1], d[2], d[0], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
        return out
    ops = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("cat") == "cpu_op" and not str(e.get("name", "")).startswith(_COMM))
    starts = [s for s, _ in ops]
    actions = []
    for e in events:
        if e.get("cat") != "user_annotation":
            continue
        name = str(e.get("name", ""))
        parts: list[tuple[str, int, int]] = []
        m = _SINGLE.match(name)
        if m:
            parts = [("F" if m.group(1) == "Forward" else "B", stage_of_rank if stage_of_rank is not None else rank,
                      int(m.group(2)))]
        elif name.startswith("PP:"):
            d = decode_action(name[3:])
            if d is None:
                continue
            if d[4]:
                parts = [tuple(s) for s in d[4]]
            elif d[0] in COMPUTE_KINDS:
                parts = [(d[0], d[1], d[2])]
        if not parts:
            continue
        lo, hi = e["ts"], e["ts"] + e["dur"]
        i = bisect_left(starts, lo)
        inside = []
        while i < len(ops) and ops[i][0] <= hi:
            if ops[i][1] <= hi:
                inside.append(ops[i])
            i += 1
        s, t = (min(a for a, _ in inside), max(b for _, b in inside)) if inside else (lo, hi)
        # an overlapped F;B pair shares one span: split it evenly (the trace cannot tell them apart)
        step = (t - s) / len(parts)
        for k, (kind, stage, mb) in enumerate(parts):
            actions.append(Action(rank, int(stage), int(mb), kind, (s + k * step) / 1e6, (s + (k + 1) * step) / 1e6))
    return actions


def timeline_from_profile(path: str | Path | Iterable[str | Path]) -> Timeline:
    """The measured timeline of a run directory's profiler traces (or trace files)."""
    from .sniff import EXPECTED, file_kind, read_json

    files = profile_files(path)
    one = path if isinstance(path, (str, os.PathLike)) else None
    if not files:
        if one is not None and Path(one).is_dir():
            raise FileNotFoundError(f"No profiler traces in {one}: run with --profile (labkit run ... --profile).")
        for f in ([one] if one is not None else list(path)):
            kind, why = file_kind(f)
            if kind != "trace":
                raise ConfigError(f"{f} is not a profiler trace: it {why if kind is None else 'is ' + why}. "
                                  f"{EXPECTED} Pass --source auto (the default) to read a file as what it holds.")
    placement = _stage_placement(Path(one)) if one is not None and Path(one).is_dir() else None
    acts: list[Action] = []
    for rank, f in files.items():
        stage = placement[rank][0] if placement and rank < len(placement) else None
        try:
            trace = read_json(f)
        except ValueError as e:
            raise ConfigError(f"{e}: a trace cut short (by a rank that died while writing it?) cannot be read; "
                              f"profile the run again. {EXPECTED}") from None
        acts += actions_from_trace(trace, rank, stage)
    # Only the first step: the reference script checks step 1 and later steps repeat it.
    return Timeline(sorted(acts, key=lambda a: (a.start, a.rank)), source="profiler",
                    meta={"files": {str(r): str(f) for r, f in files.items()},
                          "spans": "operators inside each record_function, communication left out"})
