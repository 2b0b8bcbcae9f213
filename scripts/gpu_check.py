"""The GPU checklist's essentials in ONE call, for the rare, brief, bare GPU machine.

    PYTHONPATH=. python3 scripts/gpu_check.py --out gpu-check            # cuda when there is one
    PYTHONPATH=. python3 scripts/gpu_check.py --out /tmp/c --device cpu  # the same parts on CPU ranks

Runs from a plain checkout with the machine's own python3 and torch: nothing installed (no `pip
install -e .`, no JupyterLab, nbval or OR-Tools, no `labkit` console script). The kit runs through its
Python API (`labkit.launching.launch`, `labkit.Ranks`) and the children find it on PYTHONPATH. Five
parts, each ending with a verdict (pass, fail, or skipped with the reason):

1. every multi-stage schedule x split (manual, tracer) on one rank (`--nproc 1 --stages-per-rank 4`,
   2 for the V-shaped ones), each pipelined step checked against the unsplit model (result.json);
2. the same with the tutorial preset (the official tutorial's sizes; GPU only: about a minute a step
   on 2 CPU cores);
3. the kit's spans (CUDA events on a GPU, the host clock on CPU) beside the profiler's own view of the
   same actions in the same run (the last of 3 steps): the kernels each action launched on a GPU, the
   CPU operators inside it on CPU. Pass: every action on both sides, and each profiler window no longer
   than its span (a span brackets its action's work) for 90% of them; on CPU also the spans' bubble
   fraction within 0.03 of the kit's profiler annotations' (tests/test_spans.py) where the machine was
   quiet (labkit.spans.quiet; otherwise the gap is reported, not judged). How far apart they
   are (start and end offsets, durations, bubble fractions) is reported, not judged, on a GPU;
4. live ranks (`labkit.Ranks(nproc=1)`, nccl on a GPU, gloo on CPU): a small pipelined step checked
   against the unsplit model, and its spans; the run watch (`labkit.watch_run`, AdamW, 6 steps checked every
   2) holds a clean run and names a lost optimizer state at its step;
5. the memory tracker (`labkit.worker.memory.SavedTensorTracker`) against the bytes the step saves by
   construction and, on a GPU, against `torch.cuda.max_memory_allocated`;
6. the kit as a transparent observer: one user script with its stages compiled in place, under plain
   torchrun and under the kit, the same dynamo counts and the same numbers bit for bit (its warm step
   and peak device memory reported beside plain torchrun's) [gpu_checks/observer.py].

Parts 1-3 are ONE torchrun job (the reference job's `--suite`: every config in turn on the same rank),
parts 4-5 one live pool, part 6 a plain torchrun job and a launch: four launches in all. Each part has a deadline; a config that hangs is stopped
at its part's deadline (its rank's stack is dumped first) and the job is launched again for the parts
after it, so one hang cannot eat the budget. Writes `gpu_check.json` (environment, each part's verdict,
figures and seconds) and `report.md` to --out, after every part. Exit code 0 only if no part failed.
README's "GPU nodes" section points here. Rehearsed on CPU, bare, by tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent  # <repo>/scripts: the steps in gpu_checks/ beside this file
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(HERE) not in sys.path:  # already first when run as a script; not when a test loads this file
    sys.path.append(str(HERE))

from gpu_checks.common import BUDGET_S, Check  # noqa: E402 (after the paths above)
from gpu_checks.environment import default_device, environment, prepare_children  # noqa: E402
from gpu_checks.live import memory_verdict, run_live  # noqa: E402, F401 (tests read memory_verdict here)
from gpu_checks.spans import compare_actions, profiler_windows  # noqa: E402, F401 (and these)
from gpu_checks.observer import run_observer  # noqa: E402
from gpu_checks.suite import run_suite, suite_items  # noqa: E402


def main(argv=None) -> int:
    """The check as its steps: the output folder, the environment, parts 1-3 (one suite job), parts 4-5
    (one live pool), every part's verdict. Exit code: 0 no part failed, 1 some part failed, 2 --out
    already holds files."""
    a = parse_args(argv)
    out = open_output(a.out)
    if out is None:
        return 2
    check = prepare(out, a.device, a.budget)
    try:
        check_schedules_and_spans(check)
        check_live_ranks(check)
        run_observer(check)
    except KeyboardInterrupt:
        check.not_run(list(check.parts), "interrupted")
        raise
    finally:
        close_parts(check)
    return conclude(check)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json, report.md and every run directory "
                                                "(new or empty)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda if torch sees a GPU, else cpu")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for the whole check (default {BUDGET_S:g}); parts left when it is spent say so")
    return p.parse_args(argv)


def open_output(out: str) -> Path | None:
    """Checks that --out is new or empty and creates it; None (said on stderr) when it already holds files."""
    folder = Path(out).resolve()
    if folder.exists() and any(folder.iterdir()):
        print(f"gpu_check: --out {folder} already holds files: pass a new or empty folder", file=sys.stderr)
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def prepare(out: Path, device: str | None, budget_s: float) -> Check:
    """The device (cuda when torch sees one, unless --device says), the versions, and how the children find
    the kit's rendezvous (a metadata folder in --out where no installed kit declares it); prints the
    header line and writes the first gpu_check.json and report.md, every part pending."""
    device = device or default_device()
    check = Check(out, device, budget_s)
    check.env = environment(device)
    check.env["rendezvous"] = prepare_children(out)
    print(f"[gpu_check] {check.env['device_name']} ({device}), torch {check.env['torch']}, budget {budget_s:g} s; "
          f"writing {out}", flush=True)
    check.save()
    return check


def check_schedules_and_spans(check: Check) -> None:
    """Parts 1-3 in one torchrun job (again for what is left after a crash or a hang): every multi-stage
    schedule x split against the unsplit model, with the small preset and (GPU only, else skipped) the
    tutorial one, then one profiled run's spans beside the profiler's view. Writes each config's run
    under --out/<part>/, the suite's specs and job folders (--out/suite<N>*), and each part's verdict
    as it concludes."""
    run_suite(check, suite_items(check))


def check_live_ranks(check: Check) -> None:
    """Parts 4-5 on one live pool of one rank (nccl on a GPU, gloo on CPU): a pipelined step against the
    unsplit model and its spans, then the memory tracker against the step's saved bytes (and the
    allocator on a GPU). Writes the pool's run under --out/live and each part's verdict."""
    run_live(check)


def close_parts(check: Check) -> None:
    """Every part still pending is skipped, saying the check ended before it; writes the final
    gpu_check.json and report.md."""
    check.not_run(list(check.parts), "the check ended before this part (see the parts above)")
    check.save()


def conclude(check: Check) -> int:
    """Prints the overall line (no part failed or some did, seconds, launches, the two files); returns the
    exit code: 0 when no part failed, else 1."""
    data = check.to_json()
    print(f"[gpu_check] {'no part failed' if data['ok'] else 'SOME PART FAILED'} in {data['seconds']:.0f} s; "
          f"{data['launches']['torchrun_jobs']} torchrun jobs ({data['launches']['processes']} processes); "
          f"{check.out / 'gpu_check.json'}, {check.out / 'report.md'}", flush=True)
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
