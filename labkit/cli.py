"""The `labkit` command line: run, launch, doctor (and timeline / theory once those modules exist).

Each subcommand is a thin wrapper over the Python API; bad input exits 2 with a fix-it message
before torchrun starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .core.errors import ConfigError
from .config.run import RunConfig, field_docs


def config_flags(p: argparse.ArgumentParser, cls=RunConfig) -> None:
    """One flag per config field, named by the field's metadata (else `--field-name`), with the
    field's docstring as help: the config class is the one owner of what a run is."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        flags = f.metadata.get("flags", ("--" + f.name.replace("_", "-"),))
        if not flags:
            continue  # not for the command line (e.g. free-form extras)
        help_ = docs.get(f.name, "")
        if "choices" in f.metadata:
            help_ += f" Choices: {', '.join(f.metadata['choices'])}."
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is not None and default is not False:
            help_ += f" Default: {default}."
        kw = dict(dest=f.name, default=None, help=help_.replace("%", "%%"))
        if f.type in ("bool", bool):
            p.add_argument(*flags, action="store_true", **{**kw, "default": False})
            continue
        kw["metavar"] = flags[0].lstrip("-").upper().replace("-", "_")
        if f.type in ("int", "int | None", int):
            p.add_argument(*flags, type=int, **kw)
        elif f.type in ("float", "float | None", float):
            p.add_argument(*flags, type=float, **kw)
        elif f.type in ("list[str] | None",):
            p.add_argument(*flags, type=lambda v: [x for x in v.split(",") if x], **{**kw, "metavar": "A,B,..."})
        else:
            p.add_argument(*flags, **kw)


def config_from_flags(a: argparse.Namespace, cls=RunConfig, **fixed):
    """The config the flags name (unset flags keep the config's defaults)."""
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(cls)
             if getattr(a, f.name, None) is not None}
    return cls(**{**given, **fixed})


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run the reference pipelining job (tutorial Transformer) under torchrun",
                       description="Run the reference job (python -m labkit.jobs.train) for a RunConfig made "
                                   "from these flags; the pipelined step is checked against the unsplit model.")
    config_flags(p)
    p.add_argument("--out", default=None, help="run directory (new or empty); default runs/<stamp>-<name>")
    _add_common(p)


def _add_launch(sub) -> None:
    p = sub.add_parser("launch", help="launch ANY torchrun script with the kit's run directory and logs")
    p.add_argument("--nproc", type=int, default=2, help="ranks on this node")
    p.add_argument("--out", default=None)
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT names a module to run with python -m")
    _add_common(p)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)


def _add_common(p) -> None:
    from .launching.launch import DEFAULT_TIMEOUT_S

    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"deadline for the whole job in seconds (default {DEFAULT_TIMEOUT_S:g}; 0: none); "
                        "on expiry every rank's stack is dumped, then the job is ended")
    p.add_argument("--stall", type=float, default=None,
                   help="seconds without new output from any rank, once every rank has written some, before the "
                        "job is ended as hung (stacks dumped as at the deadline; default: never)")
    p.add_argument("--stream", default="output", choices=["output", "all", "none"],
                   help="live output: rank output (default), also the pipelining DEBUG lines (all), or none")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (multi-node: run on every node)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default=None, help="job id shared by all nodes (default: from the endpoint)")


def _nodes(a) -> dict:
    return {"nnodes": a.nnodes, "node_rank": a.node_rank, "rdzv_endpoint": a.rdzv_endpoint, "rdzv_id": a.rdzv_id}


def cmd_run(a) -> int:
    from .launching.launch import LaunchError, run

    per_node = a.pp_size if a.pp_size is not None else RunConfig.pp_size
    cfg = config_from_flags(a, pp_size=per_node * a.nnodes)  # --nproc is ranks per node
    try:
        r = run(cfg, out=a.out, timeout=a.timeout, stall=a.stall, stream=a.stream, progress=not a.quiet, **_nodes(a))
    except LaunchError as e:
        print(f"labkit run: {e}", file=sys.stderr)
        return e.run.job_exitcode
    res = r.result or {}
    ranks = res.get("world_size") or res.get("pp_size")
    mesh = f" (pp {res['pp_size']} x dp {res['dp_size']} x tp {res['tp_size']})" if res.get("world_size") else ""
    print(f"[labkit] {r.status}: {res.get('schedule')} on {ranks} ranks{mesh}, reference_match="
          f"{res.get('reference_match')}, max_abs_diff={res.get('max_abs_diff', float('nan')):.2e}; "
          f"run directory {r.run_dir}")
    return 0


def cmd_launch(a) -> int:
    from .launching.launch import LaunchError, launch

    args = a.script_args[1:] if a.script_args[:1] == ["--"] else a.script_args
    try:
        r = launch(a.script, args, nproc=a.nproc, out=a.out, timeout=a.timeout, stall=a.stall, stream=a.stream,
                   module=a.module, progress=not a.quiet, **_nodes(a))
    except LaunchError as e:
        print(f"labkit launch: {e}", file=sys.stderr)
        return e.run.job_exitcode
    print(f"[labkit] {r.status} in {r.wall_time_s:.1f}s; run directory {r.run_dir}")
    return 0


def cmd_doctor(a) -> int:
    from .doctor import doctor

    report = doctor()
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        from .doctor import format_report

        print(format_report(report))
    return 0 if report["ok"] else 1


def cmd_clean(a) -> int:
    from .launching.clean import clean, describe

    print(describe(clean(all_jobs=a.all)))
    return 0


def cmd_slurm(a) -> int:
    from .launching.slurm import slurm_script

    kit_args = a.kit_args[1:] if a.kit_args[:1] == ["--"] else a.kit_args
    text = slurm_script(kit_args, nodes=a.nodes, gpus_per_node=a.gpus_per_node, job_name=a.job_name,
                        time_limit=a.time, partition=a.partition, port=a.port)
    if a.output == "-":
        print(text, end="")
    else:
        from pathlib import Path

        Path(a.output).write_text(text)
        print(f"wrote {a.output}; submit it with: sbatch {a.output}")
    return 0


def cmd_timeline(a) -> int:
    from .timeline.compare import load_timeline, with_pipelines

    if a.compare or a.numbers:
        return _compare(a)
    from .launching.rundir import unfinished

    stuck = unfinished(a.paths[0]) if len(a.paths) == 1 else ""
    if stuck:  # where a stopped or failed run's ranks were, on stderr: stdout stays the timeline's JSON
        print(stuck, file=sys.stderr)
    try:
        tl = with_pipelines(load_timeline(a.paths, a.source), a.paths[0] if len(a.paths) == 1 else None)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        if not stuck:
            raise
        print(f"labkit timeline: no timeline to draw ({e})", file=sys.stderr)
        return 1
    if a.perfetto:
        from .timeline.perfetto import write_chrome_trace

        write_chrome_trace(tl, a.perfetto)
        print(f"wrote {a.perfetto} (open it in ui.perfetto.dev)", file=sys.stderr)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")

        if len(a.paths) == 1:  # one measured step above its fitted ideal; one pair per pipeline (pp x dp)
            from .timeline.compare import measured_vs_ideal_by_pipeline
            from .timeline.plot import plot_pipelines

            fig = plot_pipelines(measured_vs_ideal_by_pipeline(a.paths[0], a.source))
        else:
            import matplotlib.pyplot as plt

            from .timeline.plot import plot_timeline

            fig, ax = plt.subplots(figsize=(12, 3 + 0.4 * len(tl.ranks)))
            plot_timeline(ax, tl)
        fig.savefig(a.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {a.plot}", file=sys.stderr)
    if a.idle:
        from .spans import explain_idle_by_pipeline

        if tl.source != "spans":
            print("labkit timeline --idle reads spans, and this run has none: use labkit.logs.explain_idle on its "
                  "logs instead", file=sys.stderr)
            return 2
        print(explain_idle_by_pipeline(a.paths[0] if len(a.paths) == 1 else Path(a.paths[0]).parent).text())
        return 0
    if a.json or not (a.plot or a.perfetto):
        out = tl.to_json()
        out["source"] = "logs" if out["source"] == "measured" else out["source"]  # say where it came from
        if len(tl.pipelines) > 1:  # several pipelines (pp x dp): each its own metrics and fitted ideal
            out["pipelines"] = _pipelines_json(tl, a.paths[0] if len(a.paths) == 1 else None, a.source)
        brief = {"metrics": out["metrics"], "meta": out["meta"],
                 **({"pipelines": out["pipelines"]} if "pipelines" in out else {})}
        print(json.dumps(out if a.json else brief, indent=None if a.json else 2))
    return 0


def _compare(a) -> int:
    """`labkit timeline --compare BEFORE AFTER`: why AFTER's step is slower, by cause, and how sure (`explain_slowdown`:
    two runs' steps, paired in order, are the units its noise is read over)."""
    from .timeline.slowdown import explain_slowdown

    if len(a.paths) != 2:
        raise ConfigError(f"--compare takes two runs, BEFORE then AFTER (got {len(a.paths)} paths), e.g. "
                          f"labkit timeline --compare runs/quiet runs/busy")
    if a.numbers:  # what the two runs computed, bit for bit (labkit.timeline.runs_compare)
        from .timeline.runs_compare import compare_numbers

        print((numbers := compare_numbers(*a.paths)).text())
        return 0 if numbers.equal else 1
    slowdown = explain_slowdown(*a.paths, source=a.source)
    print(slowdown.report())  # the verdict and how sure (as pool.compare's .text()), the table, the notes
    if a.plot:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(5, 4))
        slowdown.plot(fig.subplots())
        fig.savefig(a.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {a.plot}", file=sys.stderr)
    return 0


def _pipelines_json(tl, path, source: str) -> list[dict]:
    """Per pipeline: its ranks, its metrics (the same steps as the whole timeline's) and, for a run
    directory, its last step beside its own fitted ideal (`labkit.timeline.compare.measured_vs_ideal_by_pipeline`)."""
    from .timeline.compare import measured_vs_ideal_by_pipeline

    vs_ideal = []
    if path is not None and Path(path).is_dir():
        try:
            vs_ideal = [summary for _, _, summary in measured_vs_ideal_by_pipeline(path, source)]
        except ValueError as e:
            print(f"labkit timeline: no ideal per pipeline: {e}", file=sys.stderr)
    out = []
    for i, part in enumerate(tl.split_pipelines()):
        row = {"pipeline": i, "ranks": tl.pipelines[i], "metrics": part.metrics()}
        ideal = next((v for v in vs_ideal if v.get("ranks") == tl.pipelines[i]), None)
        if ideal is not None:
            row["vs_ideal"] = ideal
        out.append(row)
    return out


def cmd_theory(a) -> int:
    from .theory import Cost, simulate, theory_json

    tl = simulate(a.schedule, a.pp_size, a.microbatches, a.stages_per_rank, Cost.parse(a.cost) if a.cost else Cost())
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from .timeline.plot import plot_timeline

        fig, ax = plt.subplots(figsize=(12, 2 + 0.5 * a.pp_size))
        plot_timeline(ax, tl)
        fig.savefig(a.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {a.plot}", file=sys.stderr)
    data = theory_json(tl)
    if a.json:
        print(json.dumps(data))
    elif not a.plot:
        print(f"{a.schedule}: makespan {data['makespan']:g}, bubble_fraction {data['bubble_fraction']:.4f} "
              f"(idle share of wall time), bubble_ratio {data['bubble_ratio']:.4f} (idle / compute)")
    return 0


def cmd_search(a) -> int:
    from .theory import Cost, fit_cost
    from .theory.search import search, zb_h1_makespan

    if a.cost_from:
        from .timeline.compare import load_timeline

        cost = fit_cost(load_timeline(a.cost_from), p2p=a.comm or 0.0)
        print(f"costs fitted from {a.cost_from}: F={cost.F:.4g} I={cost.input_grad:.4g} W={cost.weight_grad:.4g} "
              f"{cost.unit}", file=sys.stderr)
    elif a.cost:
        cost = Cost.parse(a.cost)
        if a.comm is not None:
            cost = Cost(**{**cost.to_dict(), "p2p": a.comm})
    else:
        raise ConfigError("give the costs: --cost F=1,I=1,W=1 (any unit), or --cost-from RUN_DIR to fit them "
                          "from a measured run")
    r = search(a.pp_size, a.microbatches, cost, a.memory_limit, a.stages_per_rank, weight_memory=a.weight_memory,
               objective=a.objective, time_limit=a.time_limit, workers=a.workers, progress=a.time_limit > 0)
    if a.csv:
        Path(a.csv).write_text(r.csv())
        spr = " --schedule ZBVZeroBubble --stages-per-rank 2" if a.stages_per_rank != 1 else ""  # its V placement
        print(f"wrote {a.csv} (torch's compute-only CSV: run it on torch's runtime, checked against the unsplit "
              f"model, with `labkit run --nproc {a.pp_size} --microbatches {a.microbatches}{spr} "
              f"--schedule-csv {a.csv}`)",
              file=sys.stderr)
    data = r.to_json()
    data["zb_h1_makespan"] = zb_h1_makespan(a.pp_size, a.microbatches, cost)
    if a.json:
        print(json.dumps(data))
    else:
        print(f"searched order (K={a.memory_limit:g}, R={a.weight_memory:g}): makespan {r.makespan:g} (lower bound "
              f"{r.lower_bound:g}), steady-state period {r.period:g}, {r.objective} {r.value:g} (proven bound "
              f"{r.bound:g}, {100 * r.gap:.1f}% above), bubble_fraction {r.bubble:.4f}, peak per rank {data['peak']}; "
              f"rule: {r.rule}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit", description="PP Lab: launch and read pipeline-parallel jobs.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_launch(sub)
    d = sub.add_parser("doctor", help="what can run here, and how to fix what is missing")
    d.add_argument("--json", action="store_true")
    t = sub.add_parser("timeline", help="a run's per-stage timeline: its spans (both ends of every action), "
                                        "else its PP logs or profiler traces")
    t.add_argument("paths", nargs="+", help="a run or cell directory, log files (the kit's or torch's default format, "
                                            "plain or .gz, all ranks in one file or one per rank) or profiler traces: "
                                            "read by what they hold, whatever their names")
    t.add_argument("--json", action="store_true", help="print actions and metrics as JSON")
    t.add_argument("--plot", default=None,
                   help="save the measured timeline beside its fitted ideal (PNG; with --compare, both runs by cause)")
    t.add_argument("--perfetto", default=None, help="save a Chrome/Perfetto trace JSON (one pid per rank)")
    t.add_argument("--source", default="auto", choices=["auto", "spans", "logs", "profiler"],
                   help="spans (measured at both ends of every action; the default where the run has them), logs "
                        "(derived from torch's PP log lines: GPipe/1F1B starts are inferred), profiler (a run with "
                        "--profile); auto: by what the paths hold (a directory: spans, else profiler, else logs)")
    t.add_argument("--idle", action="store_true", help="say where the last step's idle time went, by cause (spans)")
    t.add_argument("--compare", action="store_true",
                   help="PATHS are two runs of one schedule, BEFORE AFTER: why AFTER's mean step is slower, by cause "
                        "(machine, compute per stage, waiting, communication, kit); --plot draws both by cause")
    t.add_argument("--numbers", action="store_true",
                   help="with --compare A B: whether the runs computed the same losses and stages' gradient norms "
                        "bit for bit: steps compared, the first that differs and in what, the largest difference")
    th = sub.add_parser("theory", help="the ideal timeline of a schedule (simulated from its own action order)")
    th.add_argument("--schedule", required=True)
    th.add_argument("--pp-size", type=int, required=True)
    th.add_argument("--microbatches", type=int, required=True)
    th.add_argument("--stages-per-rank", type=int, default=None)
    th.add_argument("--cost", default=None, help="durations, e.g. F=1,B=2 or F=1,I=1,W=1,p2p=0.1")
    th.add_argument("--json", action="store_true")
    th.add_argument("--plot", default=None)
    se = sub.add_parser("search", help="search an order of F/I/W actions under a memory limit (zero-bubble style)")
    se.add_argument("--pp-size", type=int, required=True, help="ranks, one stage each")
    se.add_argument("--microbatches", type=int, required=True)
    se.add_argument("--cost", default=None, help="durations, e.g. F=1,I=1,W=1 (any unit)")
    se.add_argument("--comm", type=float, default=None, help="latency of a send between ranks (same unit)")
    se.add_argument("--cost-from", default=None, help="fit the costs from a measured run directory instead")
    se.add_argument("--memory-limit", type=float, required=True,
                    help="most activation memory any rank may hold, in microbatches of one 1F1B stage (1F1B: pp_size)")
    se.add_argument("--stages-per-rank", type=int, default=1, help="1, or 2 in torch's V placement (ZBVZeroBubble's)")
    se.add_argument("--weight-memory", type=float, default=1.0,
                    help="share of a microbatch's activations still held from I until W (1: all, the default; "
                         "the zero-bubble paper's models: 32h/(34h+5as), labkit.theory.paper.weight_memory)")
    se.add_argument("--objective", default="period", choices=["period", "makespan"],
                    help="period: the longest rank's span (the paper's, steps overlapping); makespan: one step")
    se.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds for the exact model (OR-Tools CP-SAT, pip install 'labkit[search]'); 0: list "
                         "scheduling only")
    se.add_argument("--workers", type=int, default=1, help="CP-SAT's worker threads")
    se.add_argument("--csv", default=None, help="write the order as torch's compute-only CSV")
    se.add_argument("--json", action="store_true", help="print makespan, bubble, peak, bounds, order as JSON")
    c = sub.add_parser("clean", help="end processes the kit left running (orphans; --all: every kit job)")
    c.add_argument("--all", action="store_true", help="also end jobs whose notebook or terminal is still alive")
    sl = sub.add_parser("slurm", help="write an sbatch script that runs a labkit command on several nodes")
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, default=0)
    sl.add_argument("--job-name", default="pplab")
    sl.add_argument("--time", default="00:30:00")
    sl.add_argument("--partition", default=None)
    sl.add_argument("--port", type=int, default=29400)
    sl.add_argument("-o", "--output", default="-", help="file to write (default: print)")
    sl.add_argument("kit_args", nargs=argparse.REMAINDER, help="-- run|launch ... (the command for every node)")
    return p


_HANDLERS = {"run": cmd_run, "launch": cmd_launch, "doctor": cmd_doctor, "clean": cmd_clean, "slurm": cmd_slurm,
             "timeline": cmd_timeline, "theory": cmd_theory, "search": cmd_search}


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return _HANDLERS[a.command](a)
    except (ConfigError, FileNotFoundError) as e:
        print(f"labkit {a.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
