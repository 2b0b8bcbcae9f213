"""The `labkit` command line: run, launch, doctor (and timeline / theory once those modules exist).

Each subcommand is a thin wrapper over the Python API; bad input exits 2 with a fix-it message
before torchrun starts.
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import PRESETS, SCHEDULES, ConfigError, RunConfig


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run the reference pipelining script (tutorial Transformer) under torchrun")
    p.add_argument("--schedule", required=True, help=f"one of {', '.join(SCHEDULES)}")
    p.add_argument("--nproc", type=int, default=2, help="ranks in the pipeline (pp_size)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--split", default="manual", choices=["manual", "tracer"])
    p.add_argument("--stages-per-rank", type=int, default=None)
    p.add_argument("--inference", action="store_true", help="forward only (loss_fn=None)")
    p.add_argument("--preset", default="small", choices=list(PRESETS))
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--layout", default="batch", choices=["batch", "tutorial"],
                   help="tutorial: the official tutorial's layout (microbatches cut the sequence; fails the check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, seconds")
    p.add_argument("--timeout", type=float, default=None, help="deadline for the whole job, seconds")
    p.add_argument("--out", default=None, help="run directory (new or empty); default runs/<stamp>-<name>")
    p.add_argument("--stream", default="output", choices=["output", "all", "none"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_launch(sub) -> None:
    p = sub.add_parser("launch", help="launch ANY torchrun script with the kit's run directory and logs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--stream", default="output", choices=["output", "all", "none"])
    p.add_argument("--quiet", action="store_true")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)


def cmd_run(a) -> int:
    from .launch import LaunchError, run

    cfg = RunConfig(schedule=a.schedule, pp_size=a.nproc, n_microbatches=a.microbatches, split=a.split,
                    stages_per_rank=a.stages_per_rank, inference=a.inference, preset=a.preset,
                    batch_size=a.batch_size, steps=a.steps, device=a.device, layout=a.layout, seed=a.seed,
                    pg_timeout=a.pg_timeout)
    try:
        r = run(cfg, out=a.out, timeout=a.timeout, stream=a.stream, progress=not a.quiet)
    except LaunchError as e:
        print(f"labkit run: {e}", file=sys.stderr)
        return e.run.job_exitcode
    res = r.result or {}
    print(f"[labkit] {r.status}: {res.get('schedule')} on {res.get('pp_size')} ranks, reference_match="
          f"{res.get('reference_match')}, max_abs_diff={res.get('max_abs_diff', float('nan')):.2e}; run directory {r.run_dir}")
    return 0


def cmd_launch(a) -> int:
    from .launch import LaunchError, launch

    args = a.script_args[1:] if a.script_args[:1] == ["--"] else a.script_args
    try:
        r = launch(a.script, args, nproc=a.nproc, out=a.out, timeout=a.timeout, stream=a.stream, progress=not a.quiet)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit", description="PP Lab: launch and read pipeline-parallel jobs.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_launch(sub)
    d = sub.add_parser("doctor", help="what can run here, and how to fix what is missing")
    d.add_argument("--json", action="store_true")
    for hook in _EXTRA_COMMANDS:
        hook(sub)
    return p


_EXTRA_COMMANDS: list = []  # other modules register subcommands here (timeline, theory, clean, ...)
_HANDLERS = {"run": cmd_run, "launch": cmd_launch, "doctor": cmd_doctor}


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return _HANDLERS[a.command](a)
    except ConfigError as e:
        print(f"labkit {a.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
