"""Controlled-workload torchrun script: stages whose compute time is set (labkit.workload).

    labkit launch --nproc 2 scripts/controlled_pipeline.py --schedule 1F1B --fwd-ms 40 --bwd-ms 80
    python -c "import labkit.workload as w; w.run_controlled(schedule='GPipe', pp_size=4, mode='sleep')"

Used to hold a measured timeline against the ideal one: with `--mode sleep` the ranks do not
compete for cores, so the schedule's shape survives on a 2-core laptop. The first step is
checked against the unsplit model on the whole batch (timing off), like the reference script.
Rank 0 writes result.json (same keys as scripts/train_pipeline.py where they apply).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from labkit import worker
from labkit.config import ConfigError, stage_placement
from labkit.stages import make_schedule
from labkit.workload import WorkloadConfig, check_step, full_model, make_batch, mse, stage_grads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="GPipe")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--stages-per-rank", type=int, default=None)
    p.add_argument("--fwd-ms", type=float, default=40.0)
    p.add_argument("--bwd-ms", type=float, default=80.0)
    p.add_argument("--mode", default="sleep", choices=["sleep", "spin"])
    p.add_argument("--slow-stage", type=int, default=None)
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


@record
def main(argv=None) -> int:
    a = parse_args(argv)
    worker.quiet_warnings()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = WorkloadConfig(schedule=a.schedule, pp_size=world, n_microbatches=a.microbatches,
                             stages_per_rank=a.stages_per_rank, fwd_ms=a.fwd_ms, bwd_ms=a.bwd_ms, mode=a.mode,
                             slow_stage=a.slow_stage, slow_factor=a.slow_factor, dim=a.dim,
                             batch_size=a.batch_size, steps=a.steps, seed=a.seed)
    except ConfigError as e:
        print(f"[labkit] configuration error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(a.out or os.environ.get("LABKIT_RUN_DIR") or ".")
    d = worker.init_distributed("cpu", 60.0)  # sleeping stages need no GPU
    from torch.distributed.pipelining import PipelineStage

    full = full_model(cfg)
    placement = stage_placement(cfg.pp_size, cfg.stages_per_rank, cfg.info.v_shaped)
    local = placement[d.rank]
    mb = cfg.batch_size // cfg.n_microbatches
    stages = [PipelineStage(full[s], s, cfg.n_stages, d.device, input_args=torch.zeros(mb, cfg.dim)) for s in local]
    schedule = make_schedule(cfg.info, stages, cfg.n_microbatches, mse)
    x, y = make_batch(cfg)
    has_first, has_last = 0 in local, cfg.n_stages - 1 in local
    step_times, losses = [], []
    if a.profile:
        worker.annotate_stages(stages)
    with worker.maybe_profile(a.profile, d, out_dir):
        for step in range(cfg.steps):
            step_l: list = []
            args = (x,) if has_first else ()
            kw = {"target": y, "losses": step_l} if has_last else {}
            with worker.timed(d.device) as elapsed:
                schedule.step(*args, **kw)
            step_times.append(elapsed())
            if step == 0:
                losses = [float(l.detach()) for l in step_l]
                grads = stage_grads(stages)
            for s in stages:
                s.submod.zero_grad(set_to_none=True)
            if d.rank == 0:
                worker.progress(step + 1, cfg.steps)

    last_rank = next(r for r, st in enumerate(placement) if cfg.n_stages - 1 in st)
    check = check_step(full, stages, grads, losses, x, y, cfg.n_microbatches, has_last, d.device, extra=step_times)
    losses = worker.broadcast_floats(losses if has_last else None, cfg.n_microbatches, last_rank, d.device)
    ok, diff, compared, expected = check.ok, check.max_abs_diff, check.compared, check.expected
    if d.rank == 0:
        worker.write_json(out_dir / "result.json", {
            "status": "ok" if ok else "failed", "workload": "controlled", "schedule": cfg.schedule,
            "pp_size": cfg.pp_size, "n_stages": cfg.n_stages, "stages_per_rank": cfg.stages_per_rank,
            "n_microbatches": cfg.n_microbatches, "stage_placement": placement, "losses": losses,
            "reference_match": ok, "max_abs_diff": diff, "compared_param_elements": compared,
            "model_param_elements": expected, "torch": torch.__version__, "device": "cpu", "backend": d.backend,
            "step_time_s": [max(r[i] for r in check.extras) for i in range(cfg.steps)],
            "costs_ms": {str(s): cfg.stage_costs_ms(s) for s in range(cfg.n_stages)},
            "profiled": bool(a.profile), "config": cfg.to_dict(),
        })
        print(f"[labkit] controlled {cfg.schedule} ({cfg.mode}) x{cfg.pp_size} ranks: "
              f"{'matches' if ok else 'DOES NOT match'} the unsplit model (max abs diff {diff:.2e})", flush=True)
    worker.teardown()
    return 0 if ok else 3


if __name__ == "__main__":
    worker.exit_now(main())
