"""Reference torchrun script: train the tutorial's Transformer with torch.distributed.pipelining.

    torchrun --nproc-per-node 2 scripts/train_pipeline.py --schedule 1F1B --microbatches 4
    labkit run --schedule 1F1B --nproc 2 --microbatches 4 --split manual --out runs/demo

Every rank builds the same full model (same seed), keeps its stages (manual or tracer split),
runs `--steps` steps of the schedule, and checks the FIRST step against one forward/backward of
the unsplit model on the whole batch (labkit.reference). Rank 0 writes `result.json` into the
run directory (`--out`, else $LABKIT_RUN_DIR, else the current directory).
Exit codes: 0 ok, 2 bad configuration, 3 the reference check failed.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from labkit import worker
from labkit.config import PRESETS, SCHEDULES, ConfigError, RunConfig
from labkit.model import build_model, make_batch, tokenwise_loss_fn
from labkit.reference import grad_diff, whole_batch_reference
from labkit.stages import build_schedule, build_stages


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="GPipe", help=f"one of {', '.join(SCHEDULES)}")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--split", default="manual", choices=["manual", "tracer"])
    p.add_argument("--stages-per-rank", type=int, default=None)
    p.add_argument("--preset", default="small", choices=list(PRESETS))
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--inference", action="store_true", help="forward only (loss_fn=None)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--layout", default="batch", choices=["batch", "tutorial"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--split-points", default=None, help="comma-separated modules where stages begin, e.g. layers.3,layers.6")
    p.add_argument("--profile", action="store_true",
                   help="also record a torch.profiler trace per rank (profile/rank<N>.json in the run directory)")
    p.add_argument("--log-ab", action="store_true",
                   help="benchmark: PP debug logs on for half the steps and off for the other half, in "
                        "alternating pairs (result.json: step_pp_logs)")
    p.add_argument("--out", default=None, help="run directory for result.json")
    return p.parse_args(argv)


def config_from_args(a: argparse.Namespace, world_size: int) -> RunConfig:
    return RunConfig(
        schedule=a.schedule, pp_size=world_size, n_microbatches=a.microbatches, split=a.split,
        stages_per_rank=a.stages_per_rank, preset=a.preset, batch_size=a.batch_size, steps=a.steps,
        inference=a.inference, device=a.device, layout=a.layout, seed=a.seed, pg_timeout=a.pg_timeout,
        tolerance=a.tolerance, split_points=a.split_points.split(",") if a.split_points else None,
    )


def run_steps(cfg, d, stages, schedule, x, y, log_ab: bool = False):
    """Run the schedule; return per-step times, mean loss per step, and the first step's losses/grads/output.

    log_ab: switch the pipelining logger on and off step by step (worker.pp_logs_on_step)."""
    local = cfg.stages_of_rank(d.rank)
    has_first, has_last = 0 in local, cfg.n_stages - 1 in local
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=0.01) if not cfg.inference and params else None
    first = {"losses": [], "grads": {}, "output": None}
    step_times, step_losses = [], []
    worker.reset_peak_memory(d.device)
    switch = worker.PPLogSwitch() if log_ab else None
    for step in range(cfg.steps):
        if switch:
            switch.set(worker.pp_logs_on_step(step))
        losses: list = []
        args = (x,) if has_first else ()
        kwargs = {"target": y, "losses": losses} if (has_last and not cfg.inference) else {}
        with worker.timed(d.device) as elapsed:
            out = schedule.step(*args, **kwargs)
        step_times.append(elapsed())
        if step == 0:
            first["losses"] = [float(l.detach()) for l in losses]
            first["grads"] = {n: p.grad.detach().clone() for s in stages for n, p in s.submod.named_parameters()
                              if p.grad is not None}
            first["output"] = out.detach() if (has_last and out is not None) else None
        step_losses.append(sum(float(l.detach()) for l in losses) / len(losses) if losses else float("nan"))
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if d.rank == 0:
            worker.progress(step + 1, cfg.steps)
    if switch:
        switch.set(True)  # the logger as TORCH_LOGS set it for everything after the steps
    return step_times, step_losses, first


@record
def main(argv=None) -> int:
    a = parse_args(argv)
    worker.quiet_warnings()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = config_from_args(a, world)
    except ConfigError as e:
        print(f"[labkit] configuration error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(a.out or os.environ.get("LABKIT_RUN_DIR") or ".")
    d = worker.init_distributed(cfg.device, cfg.pg_timeout)
    t0 = time.perf_counter()

    full = build_model(cfg)  # same weights on every rank (seeded), kept on CPU as the reference
    stages, stage_builder = build_stages(cfg, full, d.rank, d.device)
    loss_fn = None if cfg.inference else tokenwise_loss_fn
    schedule = build_schedule(cfg, stages, loss_fn)
    x, y = make_batch(cfg, d.device)

    if a.profile:
        worker.annotate_stages(stages)
    with worker.maybe_profile(a.profile, d, out_dir):
        step_times, step_losses, first = run_steps(cfg, d, stages, schedule, x, y, a.log_ab)
    peak = worker.peak_memory_bytes(d.device)

    # The check: ONE forward (and backward) of the unsplit model on the WHOLE batch.
    ref = whole_batch_reference(full, x, y, cfg.n_microbatches, loss_fn, d.device)
    local = cfg.stages_of_rank(d.rank)
    has_last = cfg.n_stages - 1 in local
    loss_diff = out_diff = grad_max = 0.0
    numel = 0
    if cfg.inference:
        if has_last:
            out_diff = float((first["output"] - ref.output).abs().max())
    else:
        grad_max, numel = grad_diff([s.submod for s in stages], first["grads"], ref)
        if has_last:
            loss_diff = max(abs(p - r) for p, r in zip(first["losses"], ref.losses))
    last_rank = next(r for r in range(d.world_size) if cfg.n_stages - 1 in cfg.stages_of_rank(r))
    per_rank = worker.all_gather_floats([grad_max, float(numel), float(peak), loss_diff, out_diff] + step_times, d.device)
    losses = [] if cfg.inference else worker.broadcast_floats(first["losses"] if has_last else None,
                                                             cfg.n_microbatches, last_rank, d.device)
    step_losses = worker.broadcast_floats(step_losses if has_last else None, cfg.steps, last_rank, d.device)

    if d.rank == 0:
        grad_max = max(r[0] for r in per_rank)
        compared = int(sum(r[1] for r in per_rank))
        expected = sum(p.numel() for p in full.parameters())
        loss_diff = max(r[3] for r in per_rank)
        out_diff = max(r[4] for r in per_rank)
        max_abs_diff = out_diff if cfg.inference else max(grad_max, loss_diff)
        complete = cfg.inference or compared == expected
        match = bool(max_abs_diff <= cfg.tolerance and complete)
        per_step = [max(r[5 + i] for r in per_rank) for i in range(cfg.steps)]
        result = {
            "status": "ok" if match else "failed",
            "failure": None if match else (
                f"reference mismatch: max abs diff {max_abs_diff:.3g} > tolerance {cfg.tolerance:g}"
                if complete else f"gradients compared for {compared} of {expected} parameters"),
            "schedule": cfg.schedule, "pp_size": cfg.pp_size, "n_stages": cfg.n_stages,
            "stages_per_rank": cfg.stages_per_rank, "n_microbatches": cfg.n_microbatches,
            "stage_placement": [cfg.stages_of_rank(r) for r in range(cfg.pp_size)],
            "split": cfg.split, "stage_builder": stage_builder, "inference": cfg.inference,
            "layout": cfg.layout, "preset": cfg.preset, "batch_size": cfg.batch_size,
            "device": str(d.device), "backend": d.backend,
            "torch": torch.__version__, "python": platform.python_version(),
            "losses": [] if cfg.inference else losses,
            "reference_losses": ref.losses,
            "step_losses": [] if cfg.inference else step_losses,
            "reference_match": match, "max_abs_diff": max_abs_diff, "tolerance": cfg.tolerance,
            "max_abs_diff_losses": loss_diff, "max_abs_diff_grads": grad_max,
            "max_abs_diff_outputs": out_diff,
            "compared_param_elements": compared, "model_param_elements": expected,
            "peak_memory_bytes": [int(r[2]) for r in per_rank],
            "peak_memory_kind": "cuda max_memory_allocated" if d.device.type == "cuda" else "process peak RSS",
            "step_time_s": per_step,
            "profiled": bool(a.profile),
            "wall_time_s": time.perf_counter() - t0,
            "config": cfg.to_dict(),
        }
        if a.log_ab:  # which steps logged (the capture-overhead benchmark)
            result["step_pp_logs"] = [worker.pp_logs_on_step(i) for i in range(cfg.steps)]
        worker.write_json(out_dir / "result.json", result)
        verdict = "matches" if match else "DOES NOT match"
        print(f"[labkit] {cfg.schedule} x{cfg.pp_size} ranks, {cfg.n_stages} stages, {cfg.n_microbatches} "
              f"microbatches: pipelined step {verdict} the unsplit model (max abs diff {max_abs_diff:.2e}, "
              f"tolerance {cfg.tolerance:g})", flush=True)
        ok = match
    else:
        ok = True
    worker.teardown()
    return 0 if ok else 3


if __name__ == "__main__":
    worker.exit_now(main())
