"""Run a pipeline schedule YOU wrote: one row of actions per rank, in a CSV file (notebook 08).

    labkit launch --nproc 2 notebooks/scripts/custom_schedule.py --order my_order.csv --fwd-ms 50 --bwd-ms 100

The CSV is torch's own schedule format (what `_PipelineScheduleRuntime._dump_csv` writes): row r
lists rank r's compute actions in order, one per cell, as `<stage><kind><microbatch>`: `0F1`
(stage 0, forward, microbatch 1), `1B0` (full backward), `1I0` / `1W0` (backward for the inputs /
for the weights). Stages live where the CSV puts them; the microbatch count is read from it.

The stages are the controlled workload's (`labkit.models.workload.TimedBlock`): a forward takes
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
import sys

import torch
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

from labkit import check_step
from labkit.worker import distributed as worker
from labkit.theory import ScheduleDeadlock, check_order, parse_action, simulate_order
from labkit.models import TimedBlock, mse


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
    """(rows, stage -> rank, n_microbatches) of a compute-only CSV; ValueError says what is wrong.

    Actions are read, and the order checked, by the kit's own rules (`labkit.schedules.orders`): the same
    `parse_action` and `check_order` as the notebook's `simulate_order`; an order that deadlocks is refused
    with its wait cycle (`ScheduleDeadlock.deadlock`, `labkit.schedules.deadlock`) before any rank blocks on it.
    """
    with open(path, newline="") as f:
        rows = {r: [c.strip() for c in row if c.strip()] for r, row in enumerate(csv.reader(f))}
    if len(rows) != world:
        raise ValueError(f"{path} has {len(rows)} rows but the job has {world} ranks: write one row per rank.")
    order = {r: [parse_action(a, f"rank {r}, position {i}") for i, a in enumerate(acts)] for r, acts in rows.items()}
    actions = [a for acts in order.values() for a in acts]
    if not actions:
        raise ValueError(f"{path} lists no actions: write each rank's actions in its row, e.g. 0F0,0F1,0B0,0B1.")
    n_stages = 1 + max(s for _, s, _ in actions)
    missing = sorted(set(range(n_stages)) - {s for _, s, _ in actions})
    if missing:
        raise ValueError(f"stages {missing} appear in no row: every stage 0..{n_stages - 1} needs actions.")
    n_microbatches = 1 + max(mb for _, _, mb in actions)
    problems = check_order(order, n_stages, n_microbatches)
    if problems:
        raise ValueError("this order cannot run (communication is added by torch):\n- " + "\n- ".join(problems))
    try:  # torch's checks pass a deadlocking order: every rank would wait at its first step until the timeout
        simulate_order(order, n_stages, n_microbatches)
    except ScheduleDeadlock as e:
        raise ValueError(e.deadlock.text()) from None
    stage_rank = {s: r for r, acts in order.items() for _, s, _ in acts}
    return rows, stage_rank, n_microbatches


def make_runtime(stages: list, n_microbatches: int, loss_fn, order_csv: str | os.PathLike):
    """torch's action runtime, loaded with our compute-only order (torch adds SEND/RECV itself):
    `labkit.worker.stages.runtime_from_csv`, the kit's one place that names torch's private runtime."""
    from labkit.worker import runtime_from_csv

    return runtime_from_csv(stages, n_microbatches, loss_fn, order_csv)


@record
def main(argv=None) -> int:
    a = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        rows, stage_rank, m = read_order(a.order, world)
    except (OSError, ValueError) as e:
        print(f"[labkit] bad order: {e}", file=sys.stderr)
        return 2
    out_dir = worker.run_dir(a.out)
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
    TimedBlock.timing = False  # the reference runs the same maths without spending the time
    # the stage modules are the children of `full` (an nn.Sequential): names are "<stage>.<name>"
    check = check_step(full, stages, x, y, step_losses, m, mse, prefix_stage_index=True, extra=[elapsed()],
                       tolerance=1e-5)
    if d.rank == 0:
        schedule._dump_csv(str(out_dir / "order_with_comms.csv"), format="compute_comms")
        worker.write_result(out_dir, d, check, workload="controlled", schedule="custom", pp_size=world,
                            n_stages=n_stages, n_microbatches=m,
                            stage_placement=[sorted(s for s, r in stage_rank.items() if r == rank)
                                             for rank in range(world)],
                            order={str(r): acts for r, acts in rows.items()},
                            step_time_s=[max(r[0] for r in check.extras)],
                            costs_ms={"F": a.fwd_ms, "B": a.bwd_ms, "I": a.bwd_ms / 2, "W": a.bwd_ms / 2},
                            runtime="torch.distributed.pipelining.schedules._PipelineScheduleRuntime",
                            profiled=bool(a.profile))
        print(f"[labkit] custom order x{world} ranks, {n_stages} stages, {m} microbatches: {check.verdict()}",
              flush=True)
    worker.teardown()
    return 0 if check.ok else 3


if __name__ == "__main__":
    worker.exit_now(main())
