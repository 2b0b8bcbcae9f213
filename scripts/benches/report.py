"""bench/RESULTS.md from results.json: `markdown` writes the main table (every measure against its target,
with its detail rows: launch, capture, spans, start-up), the fidelity and instruments tables, and each
section that a benchmark's own module writes (warm.py, check_cost.py, paper.py); `kept_notes` keeps the
hand-kept tail from KEPT_HEADING on, which a run never rewrites."""

from __future__ import annotations

import os

from .check_cost import _check_cost_rows
from .check_scale import _check_scale_rows
from .as_launched import _as_launched_rows
from .observer import _observer_rows
from .watch import _watch_rows
from .watch_memory import _watch_memory_rows
from .live import NOTEBOOKS_BEFORE_LIVE_RANKS_S
from .paper import _paper_rows
from .warm import _warm_rows, _warm_section

# RESULTS.md from this heading on is kept by hand (figures the modules' docstrings used to carry, each under its
# module's name, with its date); a run of scripts/bench.py rewrites the tables above it and keeps that part as is.
KEPT_HEADING = "## Figures behind the modules"


def kept_notes(path) -> str:
    """The hand-kept tail of an existing RESULTS.md (from KEPT_HEADING on), "" where there is none."""
    text = path.read_text() if path.exists() else ""
    i = text.find(KEPT_HEADING)
    return "\n" + text[i:] if i >= 0 else ""


def markdown(res: dict) -> str:
    f = res["fidelity"]
    worst = max(abs(r["measured_bubble"] - r["ideal_bubble"]) for r in f) if f else float("nan")
    lines = [
        "# PP Lab benchmark results", "",
        f"Machine: {res['machine']} ({res['machine_detail']['cpus']} CPUs), torch {res['torch']}, {res['date']}.",
        "Every figure is a ratio or fraction measured within this run (A/B interleaved pair by pair); rows that "
        "say 'measured <date>' were updated later with `scripts/bench.py --only`.", "",
        "| measure | result | target | met |", "| --- | --- | --- | --- |",
        "| launch overhead (labkit launch / plain torchrun, whole process"
        f"{_launch_when(res.get('launch_overhead') or {})}) | {res['launch_overhead_ratio']:.3f}x | <= 1.03x | "
        f"{'yes' if res['launch_overhead_ratio'] <= 1.03 else 'no'} |",
        *_launch_detail_rows(res.get("launch_overhead") or {}),
        *_warm_rows(res.get("warm_start")),
        f"| PP log capture overhead (step time, +pp to files / none) | {res['capture_overhead_ratio']:.3f}x | "
        f"<= 1.05x | {'yes' if res['capture_overhead_ratio'] <= 1.05 else 'no'} |",
        *_capture_detail_rows(res.get("capture_overhead") or {}),
        *_spans_rows(res.get("spans_overhead")),
        *_startup_rows(res.get("startup")),
        f"| profiler overhead (step time, profiler / none) | {res['profiler_overhead_ratio']:.3f}x | (reported) | - |",
        f"| fidelity: worst abs(measured - ideal) bubble, {len(f)} shapes | {worst:.3f} | <= 0.05 | "
        f"{'yes' if worst <= 0.05 else 'no'} |",
    ]
    for n, v in res["parser_lines_per_s"].items():
        lines.append(f"| parser throughput (parse_lines) at {int(n):,} lines | {v:,.0f} lines/s | >= 500k | "
                     f"{'yes' if v >= 5e5 else 'no'} |")
    for n, v in (res.get("log_to_timeline_lines_per_s") or {}).items():
        lines.append(f"| log -> timeline (parser + to_timeline) at {int(n):,} lines | {v:,.0f} lines/s | (reported) "
                     "| - |")
    lines.append(f"| parser time per line, largest / smallest size | {res['parser_linearity']:.2f} | ~1 (linear) | "
                 f"{'yes' if res['parser_linearity'] < 1.5 else 'no'} |")
    lr = res.get("live_ranks")
    if lr:
        lines += [
            f"| live ranks: fresh 2-rank job / a cell on 2 warm ranks (one 1F1B step, tiny preset, output and "
            f"timeline back; medians {lr['fresh_job_median_s']:.2f} s / {lr['cell_median_s'] * 1000:.0f} ms"
            + (f"; measured {lr['date']}" if lr.get("date") else "") + ") "
            f"| {lr['ratio']:.1f}x faster | >= 20x | {'yes' if lr['ratio'] >= 20 else 'no'} |",
            f"| live ranks: an empty cell's round trip (median of {lr['round_trips']}, max "
            f"{lr['empty_cell_max_ms']:.1f} ms) | {lr['empty_cell_median_ms']:.2f} ms | <= 50 ms | "
            f"{'yes' if lr['empty_cell_median_ms'] <= 50 else 'no'} |",
        ]
    nb = res.get("notebook_suite_s")
    when = f" (measured {res['notebook_suite_date']})" if res.get("notebook_suite_date") else ""
    lines.append(f"| notebook suite under nbval{when} | {nb:.0f} s | <= 600 s | {'yes' if nb <= 600 else 'no'} |"
                 if nb else "| notebook suite under nbval | not measured | <= 600 s | - |")
    if nb:
        speed = NOTEBOOKS_BEFORE_LIVE_RANKS_S / nb
        lines.append(f"| notebook suite: before live ranks ({NOTEBOOKS_BEFORE_LIVE_RANKS_S:.0f} s, bench of 740ea78) "
                     f"/ now (across runs: noisy) | {speed:.2f}x faster | >= 1.5x | "
                     f"{'yes' if speed >= 1.5 else 'no'} |")
    tk = res.get("tutorial_vs_kit")
    if tk:
        lines.append(f"| kit's reference job / the tutorial's program as written (step time, {tk['sizes']} sizes, "
                     f"{tk['device']}) | {tk['ratio']:.3f}x | ~1 (reported) | - |")
    g = res["gpu"]
    if g.get("available") is False:
        lines.append(f"| GPU (tutorial preset, one GPU) | not measured: {g['reason']} | - | - |")
    else:
        for s, v in g["schedules"].items():
            lines.append(f"| GPU {g['device']}: {s} median step | {v['median_step_s']} s, match "
                         f"{v['reference_match']} | - | - |")
        t = g.get("tutorial_vs_kit") or {}
        lines.append(f"| GPU: kit's script / the tutorial's program as written | "
                     + (f"{t['ratio']:.3f}x |" if t.get("ratio") else f"not measured: {t.get('reason')} |")
                     + " - | - |")
    lines += ["", "## Fidelity (bubble fraction = idle share of wall time)", "",
              "| schedule | pp_size | n_microbatches | measured | ideal (p-1)/(m+p-1) |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['schedule']} | {r['pp_size']} | {r['n_microbatches']} | {r['measured_bubble']:.3f} | "
              f"{r['ideal_bubble']:.3f} |" for r in f]
    lines += _instrument_rows(res.get("instrument_fidelity"))
    lines += _paper_rows(res.get("paper_comparison"))
    lines += _check_cost_rows(res.get("check_cost"))
    lines += _check_scale_rows(res.get("check_scale"))
    lines += _as_launched_rows(res.get("as_launched"))
    lines += _observer_rows(res.get("observer"))
    lines += _watch_rows(res.get("watch"))
    lines += _watch_memory_rows(res.get("watch_memory"))
    lines += _warm_section(res.get("warm_start"))
    return "\n".join(lines) + "\n"


def _launch_when(lo: dict) -> str:
    """'; median of N pairs, measured <date>, torch <v>' for a row updated with --only launch."""
    parts = [f"median of {len(lo['pair_ratios'])} pairs"] if lo.get("pair_ratios") else []
    parts += [f"measured {lo['date']}"] if lo.get("date") else []
    parts += [f"torch {lo['torch']}"] if lo.get("torch") else []
    parts += [f"load average {lo['load'][0]} at the start, {lo['load'][1]} at the end on {os.cpu_count()} cores"] \
        if lo.get("load") else []
    return "; " + ", ".join(parts) if parts else ""


def _launch_detail_rows(lo: dict) -> list[str]:
    rows = []
    if "pair_ratio_iqr" in lo:
        lo_q, hi_q = lo["pair_ratio_iqr"]
        rows.append(f"| launch overhead: middle half of the {len(lo['pair_ratios'])} pair ratios | "
                    f"{lo_q:.3f}x - {hi_q:.3f}x "
                    f"| (spread) | - |")
    if "kit_outside_torchrun_s" in lo:
        rows.append(f"| launch: the kit's own time outside torchrun (start-up, run directory), share of a plain run "
                    f"| {lo['kit_outside_torchrun_s']:.3f} s ({lo['kit_outside_share']:.1%}) | <= 5% | "
                    f"{'yes' if lo['kit_outside_share'] <= 0.05 else 'no'} |")
    return rows


def _capture_detail_rows(co: dict) -> list[str]:
    if "control" not in co:
        return []
    c, aa, bj = co["capture"], co["control"], co["between_jobs"]
    span = lambda r: f"{r['pair_ratio_iqr'][0]:.3f}x - {r['pair_ratio_iqr'][1]:.3f}x"
    return [
        f"| capture: how | within {c['jobs']} jobs of {c['steps']} steps, logger on/off step by step; median of "
        f"{len(c['pair_ratios'])} step pairs (middle half {span(c)}) | - | - |",
        f"| capture: A/A control (same jobs without TORCH_LOGS: what noise alone gives) | {aa['ratio']:.3f}x "
        f"(middle half {span(aa)}) | ~1 | - |",
        f"| capture between whole jobs (median step, {len(bj['pair_ratios'])} job pairs; mostly job-to-job noise) "
        f"| {bj['ratio']:.3f}x (pairs {min(bj['pair_ratios']):.3f}x - {max(bj['pair_ratios']):.3f}x) | (reported) "
        "| - |",
    ]


def _spans_rows(so: dict | None) -> list[str]:
    if not so:
        return []
    r, aa = so["spans"], so["control"]
    return [f"| span recording overhead (step time, spans on / off, within {r['jobs']} jobs of {r['steps']} steps; "
            f"median of {len(r['pair_ratios'])} step pairs{', measured ' + so['date'] if so.get('date') else ''}) | "
            f"{r['ratio']:.3f}x | <= 1.03x | "
            f"{'yes' if r['ratio'] <= 1.03 else 'no'} |",
            f"| span recording: A/A control (same jobs, no recording) | {aa['ratio']:.3f}x | ~1 | - |"]


def _startup_rows(st: dict | None) -> list[str]:
    if not st:
        return []
    names = {"agent": "torchrun's agent start-up", "rank_imports": "a rank's imports (pipelining, the kit's job)",
             "job": "a whole 2-rank `labkit run` (command, agent, ranks)"}
    when = ((f"; measured {st['date']}" if st.get("date") else "")
            + (f", torch {st['torch']}" if st.get("torch") else ""))
    return [f"| start-up CPU, collector paused / not ({names[k]}: {v['a_median_s']:.2f} s / {v['b_median_s']:.2f} s, "
            f"median of {len(v['pair_ratios'])} pairs{when}) | {v['ratio']:.2f}x | < 1 (reported) | "
            f"{'yes' if v['ratio'] < 1 else 'no'} |" for k, v in st.items() if k in names]


def _instrument_rows(rows: list[dict] | None) -> list[str]:
    if not rows:
        return []
    out = ["", "Instruments on ms-scale real models (last of 3 steps, one profiled job each; error = reading - "
           "spans):", "",
           "| model | schedule | spans | profiler (err) | logs raw (err) | logs split (err) | logs trimmed (err) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cell = lambda k: f"{r[k]:.3f} ({r[k] - r['spans']:+.3f})"  # noqa: E731
        out.append(f"| {r['model']} | {r['schedule']} | {r['spans']:.3f} | {cell('profiler')} | {cell('logs raw')} | "
                   f"{cell('logs split')} | {cell('logs trimmed')} |")
    return out
