"""Run a pipeline schedule YOU wrote: one row of actions per rank, in a CSV file (notebook 08).

    labkit launch --nproc 2 notebooks/scripts/custom_schedule.py --order my_order.csv --fwd-ms 50 --bwd-ms 100

The CSV is torch's own schedule format (what `_PipelineScheduleRuntime._dump_csv` writes): row r
lists rank r's compute actions in order, one per cell, as `<stage><kind><microbatch>`: `0F1`
(stage 0, forward, microbatch 1), `1B0` (full backward), `1I0` / `1W0` (backward for the inputs /
for the weights). Stages live where the CSV puts them; the microbatch count is read from it.

The stages are the controlled workload's (`labkit.workload.TimedBlock`): a forward takes
`--fwd-ms`, a full backward `--bwd-ms` (half for I, half for W), with `--mode sleep` so the
schedule's shape survives a 2-core laptop. torch's runtime lowers the compute-only order into one
with SEND/RECV actions (rank 0 writes it to `order_with_comms.csv`) and runs it. The first step is
checked against ONE forward/backward of the unsplit model on the whole batch; rank 0 writes
`result.json`. Exit codes: 0 ok, 2 bad order, 3 the reference check failed.

torch API: `_PipelineScheduleRuntime` + `_load_csv(path, format="compute_only")`, the route torch's
own docstring gives ("can be instantiated directly by creating _PipelineScheduleRuntime and calling
load_csv"). Both names are PRIVATE (leading underscore) in torch 2.8-2.14: they work, but may be
renamed; `make_runtime` below is the one place to adapt.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

from labkit import worker
from labkit.workload import TimedBlock, check_step, mse, stage_grads

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--order", required=True, help="CSV file: one row of actions per rank, e.g. 0F0,0F1,0B0,...")
    p.add_argument("--fwd-ms", type=float, default=50.0)
    p.add_argument("--bwd-ms", type=float, default=100.0)
    p.add_argument("--mode", default="sleep", choices=["sleep", "spin"])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--mb-size", type=int, default=2, help="samples per microbatch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also write profile/rank<N>.json (torch.profiler)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def read_order(path: str | os.PathLike, world: int) -> tuple[dict[int, list[str]], dict[int, int], int]:
    """(rows, stage -> rank, n_microbatches) of a compute-only CSV; ValueError says what is wrong."""
    with open(path, newline="") as f:
        rows = {r: [c.strip() for c in row if c.strip()] for r, row in enumerate(csv.reader(f))}
    if len(rows) != world:
        raise ValueError(f"{path} has {len(rows)} rows but the job has {world} ranks: write one row per rank.")
    stage_rank: dict[int, int] = {}
    mbs = set()
    for r, acts in rows.items():
        for a in acts:
            m = _ACTION.match(a)
            if m is None:
                raise ValueError(f"rank {r}: cannot read action {a!r}; write <stage><kind><microbatch> with kind "
                                 f"F, B, I or W, e.g. 0F1 or 1W0 (communication is added by torch).")
            stage, mb = int(m.group(1)), int(m.group(3))
            if stage_rank.setdefault(stage, r) != r:
                raise ValueError(f"stage {stage} appears on rank {stage_rank[stage]} and rank {r}: a stage lives "
                                 f"on one rank.")
            mbs.add(mb)
    n_stages = max(stage_rank) + 1
    missing = sorted(set(range(n_stages)) - set(stage_rank))
    if missing:
        raise ValueError(f"stages {missing} appear in no row: every stage 0..{n_stages - 1} needs actions.")
    return rows, stage_rank, max(mbs) + 1


def make_runtime(stages: list, n_microbatches: int, loss_fn, order_csv: str | os.PathLike):
    """torch's action runtime, loaded with our compute-only order (torch adds SEND/RECV itself)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    schedule = _PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    schedule._load_csv(str(order_csv), format="compute_only")
    return schedule


@record
def main(argv=None) -> int:
    a = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        rows, stage_rank, m = read_order(a.order, world)
    except (OSError, ValueError) as e:
        print(f"[labkit] bad order: {e}", file=sys.stderr)
        return 2
    out_dir = Path(a.out or os.environ.get("LABKIT_RUN_DIR") or ".")
    d = worker.init_distributed("cpu", 60.0)  # sleeping stages need no GPU
    from torch.distributed.pipelining import PipelineStage

    n_stages = max(stage_rank) + 1
    fwd_s, half_s = a.fwd_ms / 1000, a.bwd_ms / 2000
    full = nn.Sequential(*[TimedBlock(a.dim, fwd_s, half_s, half_s, a.mode) for _ in range(n_stages)])
    local = sorted(s for s, r in stage_rank.items() if r == d.rank)
    stages = [PipelineStage(full[s], s, n_stages, d.device, input_args=torch.zeros(a.mb_size, a.dim)) for s in local]
    try:
        schedule = make_runtime(stages, m, mse, a.order)
    except (AssertionError, RuntimeError, ValueError) as e:  # torch's own validation of the order
        print(f"[labkit] torch refused the order: {e}", file=sys.stderr)
        worker.teardown()
        return 2

    g = torch.Generator().manual_seed(a.seed)
    x = torch.randn(a.mb_size * m, a.dim, generator=g)
    y = torch.randn(a.mb_size * m, a.dim, generator=g)
    has_first, has_last = 0 in local, n_stages - 1 in local
    step_losses: list = []
    if a.profile:
        worker.annotate_stages(stages)
    with worker.maybe_profile(a.profile, d, out_dir):
        with worker.timed(d.device) as elapsed:
            schedule.step(*((x,) if has_first else ()), **({"target": y, "losses": step_losses} if has_last else {}))
    grads = stage_grads(stages)
    losses_here = [float(l.detach()) for l in step_losses]
    check = check_step(full, stages, grads, losses_here, x, y, m, has_last, d.device, extra=[elapsed()])
    last_rank = stage_rank[n_stages - 1]
    losses = worker.broadcast_floats(losses_here if has_last else None, m, last_rank, d.device)
    ok, diff, compared, expected, ref_losses = (check.ok, check.max_abs_diff, check.compared, check.expected,
                                                check.reference_losses)
    if d.rank == 0:
        schedule._dump_csv(str(out_dir / "order_with_comms.csv"), format="compute_comms")
        worker.write_json(out_dir / "result.json", {
            "status": "ok" if ok else "failed", "workload": "controlled", "schedule": "custom",
            "pp_size": world, "n_stages": n_stages, "n_microbatches": m,
            "stage_placement": [sorted(s for s, r in stage_rank.items() if r == rank) for rank in range(world)],
            "order": {str(r): acts for r, acts in rows.items()}, "losses": losses, "reference_losses": ref_losses,
            "reference_match": ok, "max_abs_diff": diff, "compared_param_elements": compared,
            "model_param_elements": expected, "step_time_s": [max(r[0] for r in check.extras)],
            "costs_ms": {"F": a.fwd_ms, "B": a.bwd_ms, "I": a.bwd_ms / 2, "W": a.bwd_ms / 2},
            "torch": torch.__version__, "runtime": "torch.distributed.pipelining.schedules._PipelineScheduleRuntime",
            "profiled": bool(a.profile),
        })
        print(f"[labkit] custom order x{world} ranks, {n_stages} stages, {m} microbatches: "
              f"{'matches' if ok else 'DOES NOT match'} the unsplit model (max abs diff {diff:.2e})", flush=True)
    worker.teardown()
    return 0 if ok else 3


if __name__ == "__main__":
    worker.exit_now(main())
