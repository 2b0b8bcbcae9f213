"""Part 3's reading: the kit's spans beside the profiler's own view of the same actions in the same run
(the kernels each action launched on a GPU, the CPU operators inside it on CPU)."""

from __future__ import annotations

import json
import statistics
from bisect import bisect_left, bisect_right
from pathlib import Path
from typing import TYPE_CHECKING

from .common import FAIL, PASS, Check

if TYPE_CHECKING:
    from .suite import Item

SPAN_BUBBLE_TOLERANCE = 0.03  # spans vs the profiler on CPU, as tests/test_spans.py states it
CONTAINED_SHARE = 0.9         # actions whose profiler window fits in their span (by duration), at least


def conclude_spans(check: Check, it: Item, seconds: float) -> None:
    """Part 3: the profiled run's spans against the profiler (`compare_spans`); a reader that fails on
    this torch's trace fails the part instead of the check."""
    if it.result is None:
        check.conclude("3_spans", FAIL, f"no profiled run: {it.error}", seconds)
        return
    try:
        verdict, why, figures = compare_spans(it.out, check.device)
    except Exception as e:  # a reader that fails on this torch's trace is a finding, not a crash of the check
        check.conclude("3_spans", FAIL, f"could not compare: {type(e).__name__}: {e}", seconds, run_dir=str(it.out))
        return
    check.conclude("3_spans", verdict, why, seconds, run_dir=str(it.out), **figures)


def compare_spans(run_dir: Path, device: str) -> tuple[str, str, dict]:
    """The last (warm) step's actions from the kit's spans against the profiler's view of the same actions
    in the same run: on CUDA the kernels each action launched (device times), on CPU the CPU operators
    inside it; the kit's own host-side annotations (`labkit::<stage><kind><mb>`) beside both."""
    from labkit.core.actions import COMPUTE_KINDS
    from labkit.logs.profiler import profile_files
    from labkit.spans import quiet_baseline
    from labkit.timeline.compare import load_timeline, one_step

    measured = load_timeline(run_dir, "spans")
    spans = [a for a in one_step(measured).actions if a.kind in COMPUTE_KINDS]
    traces = profile_files(run_dir)
    if 0 not in traces:
        raise FileNotFoundError(f"no profiler trace in {run_dir}/profile (the run had --profile)")
    trace = json.loads(traces[0].read_text())
    inner = "kernels" if device == "cuda" else "cpu_ops"
    host, windows = profiler_windows(trace, inner)
    vs_inner, vs_host = compare_actions(spans, windows), compare_actions(spans, host)
    figures = {"clock": "spans: CUDA events placed on the host clock" if device == "cuda" else "spans: time.time()",
               "profiler_view": f"the {inner.replace('_', ' ')} inside each labkit:: annotation "
                                "(first start to last end)",
               f"spans_vs_{inner}": vs_inner, "spans_vs_host_annotations": vs_host}
    problems = []
    if (not spans or vs_inner["matched"] != len({key(a) for a in spans})
            or vs_inner["matched"] != vs_inner["other_actions"]):
        problems.append(f"{vs_inner['matched']} actions matched of {vs_inner['actions']} spans and "
                        f"{vs_inner['other_actions']} {inner} windows")
    if vs_inner["contained_share"] < CONTAINED_SHARE:
        problems.append(f"only {vs_inner['contained_share']:.0%} of the {inner} windows fit in their span's duration "
                        f"(at least {CONTAINED_SHARE:.0%} expected)")
    host_gap = abs(vs_host["bubble_fraction"]["spans"] - vs_host["bubble_fraction"]["other"])
    # a bound on a timing holds where the machine was quiet (labkit.spans.quiet, the kit's one rule)
    quiet = quiet_baseline([measured])
    figures["machine"] = quiet.text()
    if device != "cuda" and host_gap > SPAN_BUBBLE_TOLERANCE:  # on a GPU the annotations time the launches
        gap = (f"bubble fractions of the spans and of the kit's annotations differ by {host_gap:.3f} "
               f"(> {SPAN_BUBBLE_TOLERANCE}, tests/test_spans.py's tolerance)")
        if quiet.ok:
            problems.append(gap)
        else:
            figures["not_compared"] = f"{gap}; {quiet.text()}"
    summary = (f"{vs_inner['matched']} actions (median {fmt_us(vs_inner['median_action_us'])}); the {inner} "
               f"inside each start {fmt_us(vs_inner['start_offset_us']['median'])} after its span and last "
               f"{fmt_us(vs_inner['duration_diff_us']['median'])} less (medians); bubble fraction: spans "
               f"{vs_inner['bubble_fraction']['spans']:.3f}, {inner} {vs_inner['bubble_fraction']['other']:.3f}, "
               f"host annotations {vs_host['bubble_fraction']['other']:.3f}")
    if device == "cuda":  # where the kernels' bubble exceeds the spans': the device waited for the host
        summary += (f"; the device waited for the host {vs_inner['waited_for_host']['share']:.3f} of the step "
                    f"(from a span's start to its first kernel, median "
                    f"{fmt_us(vs_inner['waited_for_host']['median_us'])})")
    if "not_compared" in figures:
        summary += f"; {figures['not_compared']}"
    return (FAIL if problems else PASS), ("; ".join(problems) + " | " if problems else "") + summary, figures


def fmt_us(v: float) -> str:
    return f"{v / 1000:.2f} ms" if abs(v) >= 1000 else f"{v:.0f} us"


def profiler_windows(trace: dict, inner: str):
    """Per `labkit::` annotation of a profiler trace: its host range, and the window of the work inside
    it (`inner`: "kernels" or "cpu_ops", see `kernels_inside` and `cpu_ops_inside`). Times in seconds on
    the trace's own clock, its `baseTimeNanoseconds` added: the host clock the spans use."""
    from labkit.core.actions import Action
    from labkit.logs.messages import decode_action
    from labkit.logs.profiler import ANNOTATION_PREFIX

    base_us = float(trace.get("baseTimeNanoseconds", 0)) / 1e3
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    inside = kernels_inside(events) if inner == "kernels" else cpu_ops_inside(events)

    def action(d, lo, hi):
        return Action(0, d[1], d[2], d[0], (base_us + lo) / 1e6, (base_us + hi) / 1e6)

    host, windows = [], []
    for e in events:
        name = str(e.get("name", ""))
        d = decode_action(name[len(ANNOTATION_PREFIX):]) if (
            e.get("cat") == "user_annotation" and name.startswith(ANNOTATION_PREFIX)) else None
        if d is None:
            continue
        lo, hi = e["ts"], e["ts"] + e["dur"]
        host.append(action(d, lo, hi))
        work = inside(lo, hi)
        if work:
            windows.append(action(d, min(a for a, _ in work), max(b for _, b in work)))
    return host, windows


def kernels_inside(events: list[dict]):
    """(lo, hi) -> the device events (kernels, copies, sets) launched between lo and hi, matched to their
    launch by the profiler's correlation id: a backward's launches come from autograd's device thread,
    inside the annotation's range in time but not on its thread."""
    device: dict = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get("args", {}):
            device.setdefault(e["args"]["correlation"], []).append((e["ts"], e["ts"] + e["dur"]))
    launches = sorted((e["ts"], e["args"]["correlation"]) for e in events
                      if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}))

    def inside(lo: float, hi: float) -> list:
        i, j = bisect_left(launches, (lo,)), bisect_right(launches, (hi, float("inf")))
        return [w for _, c in launches[i:j] for w in device.get(c, [])]

    return inside


def cpu_ops_inside(events: list[dict]):
    """(lo, hi) -> the CPU operators that run entirely between lo and hi."""
    ops = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "cpu_op")

    def inside(lo: float, hi: float) -> list:
        return [(s, t) for s, t in ops[bisect_left(ops, (lo,)):bisect_right(ops, (hi, float("inf")))] if t <= hi]

    return inside


def key(a) -> tuple:
    return (a.stage, a.kind, a.microbatch)


def last_by_key(actions) -> dict:
    """Each (stage, kind, microbatch)'s last occurrence: the last step of a multi-step run."""
    out = {}
    for a in sorted(actions, key=lambda a: a.start):
        out[key(a)] = a
    return out


def waited_for_host(spans, other) -> dict:
    """The device's idle time while the host launches, as its own cause: in each action, from its span's
    start to its first kernel (`other`'s window start), the device had nothing of it to run yet. Its sum
    over the step's matched actions, as a share of ranks x the spans' makespan (the bubble's unit), and
    the median per action in microseconds. On CPU the same reading is the time before the first
    operator (the runtime's own, inside the span)."""
    a, b = last_by_key(spans), last_by_key(other)
    common = sorted(set(a) & set(b))
    waits = [max(0.0, min(b[k].start, a[k].end) - a[k].start) for k in common]
    acts = [a[k] for k in common]
    ranks = {x.rank for x in acts} or {0}
    span = (max(x.end for x in acts) - min(x.start for x in acts)) if acts else 0.0
    return {"share": sum(waits) / (len(ranks) * span) if span > 0 else 0.0,
            "median_us": statistics.median(waits) * 1e6 if waits else 0.0}


def compare_actions(spans, other) -> dict:
    """How far `other` (a profiler view) is from the spans, action by action: start and end offsets,
    duration differences (microseconds), the share of actions whose `other` window is no longer than
    the span (within 10 us + 2%: a span brackets its action's work), and each side's bubble fraction."""
    from labkit.core.actions import Timeline

    a, b = last_by_key(spans), last_by_key(other)
    common = sorted(set(a) & set(b))
    us = 1e6
    starts = [(b[k].start - a[k].start) * us for k in common]
    ends = [(b[k].end - a[k].end) * us for k in common]
    shorter = [(a[k].duration - b[k].duration) * us for k in common]
    fits = [b[k].duration <= a[k].duration * 1.02 + 10e-6 for k in common]

    def stats(v):
        return ({"median": statistics.median(v), "min": min(v), "max": max(v)} if v
                else {"median": 0.0, "min": 0.0, "max": 0.0})

    def bubble(acts):
        return Timeline(sorted(acts, key=lambda x: x.start)).metrics()["bubble_fraction"] if acts else float("nan")

    waits = waited_for_host(spans, other)
    return {"actions": len(a), "other_actions": len(b), "matched": len(common), "waited_for_host": waits,
            "median_action_us": statistics.median(x.duration * us for x in a.values()) if a else 0.0,
            "start_offset_us": stats(starts), "end_offset_us": stats(ends), "duration_diff_us": stats(shorter),
            "contained_share": sum(fits) / len(fits) if fits else 0.0,
            "bubble_fraction": {"spans": bubble([a[k] for k in common]), "other": bubble([b[k] for k in common])}}
