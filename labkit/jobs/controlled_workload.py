"""The controlled-workload job: stages whose compute time is set (labkit.models.workload).

    python -c "import labkit.models.workload as w; w.run_controlled(schedule='GPipe', pp_size=4, mode='sleep')"
    torchrun --nproc-per-node 2 -m labkit.jobs.controlled_workload --config runs/x/config.json

Used to hold a measured timeline against the ideal one: with `mode="sleep"` the ranks do not
compete for cores, so the schedule's shape survives on a 2-core laptop. Reads its
`WorkloadConfig` from the run directory's config.json. The first step is checked against the
unsplit model on the whole batch (timing off), like the reference job; rank 0 writes result.json
(the same keys where they apply). Taught in notebooks 06 and 06b (notebooks 04-05 step the same workload on live ranks).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from ..worker import distributed as worker
from ..core.errors import ConfigError
from ..schedules.table import stage_placement
from ..check.reference import check_step, stage_grads
from ..worker.stages import make_schedule
from ..models.workload import TimedBlock, WorkloadConfig, full_model, make_batch, mse


@record
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="config.json to read (default: the run directory's)")
    p.add_argument("--out", default=None, help="where result.json goes (default: $LABKIT_RUN_DIR, else .)")
    a = p.parse_args(argv)
    worker.quiet_warnings()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = WorkloadConfig.from_json(a.config or worker.run_dir())
        if cfg.pp_size != world:
            raise ConfigError(f"config.json says pp_size {cfg.pp_size} but torchrun started {world} ranks.")
    except (ConfigError, OSError, TypeError) as e:
        print(f"[labkit] configuration error: {e}", file=sys.stderr)
        return 2
    out_dir = worker.run_dir(a.out)
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
    step_times, losses, grads = [], [], {}
    if cfg.profile:
        worker.annotate_stages(stages)
    with worker.maybe_profile(cfg.profile, d, out_dir):
        for step in range(cfg.steps):
            step_l: list = []
            args = (x,) if has_first else ()
            kw = {"target": y, "losses": step_l} if has_last else {}
            with worker.timed(d.device) as elapsed:
                schedule.step(*args, **kw)
            step_times.append(elapsed())
            if step == 0:
                losses, grads = step_l, stage_grads(stages, prefix_stage_index=True)
            for s in stages:
                s.submod.zero_grad(set_to_none=True)
            if d.rank == 0:
                worker.progress(step + 1, cfg.steps)

    TimedBlock.timing = False  # the reference runs the same maths without spending the time
    check = check_step(full, stages, x, y, losses, cfg.n_microbatches, mse, grads=grads, prefix_stage_index=True,
                       extra=step_times, tolerance=1e-5)
    if d.rank == 0:
        worker.write_result(out_dir, d, check, workload="controlled", schedule=cfg.schedule, pp_size=cfg.pp_size,
                            n_stages=cfg.n_stages, stages_per_rank=cfg.stages_per_rank,
                            n_microbatches=cfg.n_microbatches, stage_placement=placement,
                            step_time_s=[max(r[i] for r in check.extras) for i in range(cfg.steps)],
                            costs_ms={str(s): cfg.stage_costs_ms(s) for s in range(cfg.n_stages)},
                            profiled=cfg.profile, config=cfg.to_dict())
        print(f"[labkit] controlled {cfg.schedule} ({cfg.mode}) x{cfg.pp_size} ranks: {check.verdict()}", flush=True)
    worker.teardown()
    return 0 if check.ok else 3


if __name__ == "__main__":
    worker.exit_now(main())
