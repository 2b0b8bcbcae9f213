"""The reference job: train the tutorial's Transformer with torch.distributed.pipelining.

    labkit run --schedule 1F1B --nproc 2 --microbatches 4 --split manual --out runs/demo
    torchrun --nproc-per-node 2 -m labkit.jobs.train --config runs/demo/config.json

Reads its `RunConfig` from the run directory's config.json (`labkit run` writes it; `--config`
names another). Every rank builds the same full model (same seed), keeps its stages (manual or
tracer split), runs `steps` steps of the schedule, and checks the FIRST step against one
forward/backward of the unsplit model on the whole batch (`labkit.worker.reference.check_step`). Rank 0
writes result.json into the run directory. Exit codes: 0 ok, 2 bad configuration, 3 the
reference check failed. Taught in notebooks 00 and 04.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..worker import distributed as worker
from ..core.errors import ConfigError
from ..config.run import RunConfig
from ..models.adapter import adapter as model_adapter
from ..worker.noise import autocast_ctx
from ..worker.reference import check_step, stage_grads


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="config.json to read (default: the run directory's)")
    p.add_argument("--out", default=None, help="where result.json goes (default: $LABKIT_RUN_DIR, else .)")
    p.add_argument("--log-ab", action="store_true",
                   help="benchmark: PP debug logs on for half the steps and off for the other half, in "
                        "alternating pairs (result.json: step_pp_logs)")
    p.add_argument("--suite", default=None,
                   help="JSON list of {config, out}: run each config in turn on the same ranks (the test suite)")
    p.add_argument("--accumulate-pitfall", action="store_true",
                   help="teaching: accumulate with torch's default scale_grads=True and divide by G afterwards "
                        "(each step's scaling also divides the gradients accumulated before it: the check fails)")
    p.add_argument("--spans-ab", action="store_true",
                   help="benchmark: span recording (labkit.spans) on for half the steps and off for the other "
                        "half, in the same alternating pairs (result.json: step_spans)")
    return p.parse_args(argv)


def load_config(a: argparse.Namespace, world_size: int) -> RunConfig:
    cfg = RunConfig.from_json(a.config or worker.run_dir())
    if cfg.world_size != world_size:
        raise ConfigError(f"config.json says {cfg.world_size} ranks (pp {cfg.pp_size} x dp {cfg.dp_size} x tp "
                          f"{cfg.tp_size}) but torchrun started {world_size}: launch with --nproc-per-node "
                          f"{cfg.world_size} (labkit run does this for you).")
    return cfg


def _spans_recorder():
    from ..spans.record import recorder

    rec = recorder()
    if rec is None:
        raise RuntimeError("--spans-ab: no span recorder in this rank (launch the job with labkit.run, which "
                           "records spans in every rank)")
    return rec


def run_steps(cfg: RunConfig, d, stages, schedule, x, y, log_ab: bool = False, inputs=None, after_backward=None,
              spans_ab: bool = False, chunks=None, grad_scale: float | None = None, clip=None, memory: bool = False):
    """Run the schedule; per-step times, mean loss per step, and the first step's losses/grads/output.

    log_ab: switch the pipelining logger on and off step by step (worker.pp_logs_on_step);
    spans_ab: the same for span recording (labkit.spans.record);
    inputs: (args, kwargs) this rank passes to step (default: the tokens on the first stage; a
    transformers model adds masks and position ids, labkit.models.adapter);
    after_backward(stages): before the gradients are read or applied (tied weights' all-reduce);
    chunks: [(args, kwargs, target)] of the schedule steps whose gradients one update accumulates
    (--accumulate G: G of them; default: one, `inputs` and `y`); grad_scale: multiply the accumulated
    gradients by it before they are read or applied; clip(stages): last, before they are read
    (--clip-grad-norm, labkit.parallel.checkpoint.clip_grad_norm); memory: measure this rank's bytes
    of parameters, gradients, optimizer state and activations in the first step (first["memory"])."""
    has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    params = [p for s in stages for p in s.submod.parameters()]
    # Composed runs (memory measured) keep a momentum buffer per parameter, an optimizer state for FSDP2 to
    # shard like the gradients; its first update equals plain SGD's, the step the reference check reads.
    momentum = 0.9 if memory else 0.0
    opt = torch.optim.SGD(params, lr=0.01, momentum=momentum) if not cfg.inference and params else None
    first = {"losses": [], "grads": None, "output": None}
    step_times, step_losses = [], []
    worker.reset_peak_memory(d.device)
    switch = worker.PPLogSwitch() if log_ab else None
    spans = _spans_recorder() if spans_ab else None
    tracker = None
    if memory and not cfg.inference:
        from ..worker.memory import SavedTensorTracker
        tracker = SavedTensorTracker(stages)
    for step in range(cfg.steps):
        if switch:
            switch.set(worker.pp_logs_on_step(step))
        if spans_ab and spans is not None:
            spans.enabled = worker.pp_logs_on_step(step)
        losses: list = []
        if chunks is None:
            args, model_kwargs = inputs if inputs is not None else (((x,) if has_first else ()), {})
            todo = [(args, model_kwargs, y)]
        else:
            todo = chunks
        with worker.timed(d.device) as elapsed:
            for args, model_kwargs, target in todo:  # one schedule step per accumulated chunk
                mine: list = []  # step() clears the list it is given: one per chunk
                kwargs = {"target": target, "losses": mine} if (has_last and not cfg.inference) else {}
                with autocast_ctx(d.device, getattr(torch, cfg.autocast) if cfg.autocast else None):
                    out = schedule.step(*args, **model_kwargs, **kwargs)
                losses += mine
            if after_backward is not None and not cfg.inference:
                after_backward(stages)
            if grad_scale is not None and not cfg.inference:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(grad_scale)
            if clip is not None and not cfg.inference:
                clip(stages)
        step_times.append(elapsed())
        if step == 0:
            first = {"losses": list(losses), "grads": stage_grads(stages),
                     "output": out.detach() if (has_last and out is not None) else None}
            if tracker is not None:
                from ..parallel.compose import memory_row
                # the rank's stages together, at every change; optimizer state: after its first step, below
                first["memory"] = memory_row(stages, None, tracker.rank_peak())
        step_losses.append(sum(float(l.detach()) for l in losses) / len(losses) if losses else float("nan"))
        if opt is not None:
            opt.step()
            if step == 0 and "memory" in first:  # the optimizer's state, created by its first step
                from ..parallel.compose import local_bytes
                first["memory"][2] = float(local_bytes(v for st in opt.state.values() for v in st.values()
                                                       if torch.is_tensor(v)))
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
    if a.suite:
        return run_suite(a)
    try:
        cfg = load_config(a, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        print(f"[labkit] configuration error: {e}", file=sys.stderr)
        return 2
    out_dir = worker.run_dir(a.out)
    d = worker.init_distributed(cfg.device, cfg.pg_timeout)
    rc = run_config(cfg, d, out_dir, a)
    worker.teardown()
    return rc


def run_suite(a: argparse.Namespace) -> int:
    """Several runs in one job (`--suite FILE`: a JSON list of {"config": RunConfig dict, "out": run
    directory}), one after the other on the same ranks: the test suite's and `sweep`'s way to check
    many configs without paying a launch each (~6 s of torchrun and imports on 2 cores). Every config
    needs the job's world size; each writes its own result.json and spans; the PP logs are the job's."""
    import json

    items = json.loads(open(a.suite).read())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfgs = [RunConfig.from_dict(it["config"]) for it in items]
        bad = [c for c in cfgs if c.world_size != world]
        if bad:
            raise ConfigError(f"--suite: every config needs {world} ranks; {bad[0].schedule} needs {bad[0].world_size}")
    except ConfigError as e:
        print(f"[labkit] configuration error: {e}", file=sys.stderr)
        return 2
    d = worker.init_distributed(cfgs[0].device, max(c.pg_timeout for c in cfgs))
    worst = max(run_items(items, d, a))
    worker.teardown()
    return worst


def run_items(items: list[dict], d, a: argparse.Namespace | None = None) -> list[int]:
    """Each item ({"config": RunConfig dict, "out": run directory, optional "job_args": the job's
    flags for it, e.g. ["--accumulate-pitfall"]}) in turn on this process's ranks, whose process group
    is up: a `--suite` job, or live ranks (`labkit.Ranks`; `labkit.ranks.suite` sends them these).
    Each run writes its config.json, result.json (rank 0) and spans into its own directory.
    Returns each item's exit code (0 ok, 3 the check failed, 2 a split this model cannot take)."""
    from ..spans.record import recorder

    # the spans recorder is installed when torch's pipelining is first imported (labkit/spans/boot):
    # import it now, so that the FIRST config's spans go to its own directory too, not the job's
    import torch.distributed.pipelining  # noqa: F401
    codes = []
    for it in items:
        cfg = RunConfig.from_dict(it["config"])
        out = Path(it["out"])
        out.mkdir(parents=True, exist_ok=True)
        cfg.to_json(out / "config.json")
        rec = recorder()
        if rec is not None:
            rec.use_file(out / "spans" / f"rank{d.rank}.jsonl")
        args = parse_args(list(it.get("job_args", []))) if "job_args" in it or a is None else a
        codes.append(run_config(cfg, d, out, args))
        dist.barrier()
    return codes


def run_here(items: list[dict]) -> list[int]:
    """`run_items` on live ranks (`labkit.Ranks`: their process group is up; `labkit.ranks.suite`)."""
    from ..worker.distributed import DistInfo, choose_device

    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = choose_device(RunConfig.from_dict(items[0]["config"]).device, local_rank, local_world)
    d = DistInfo(rank, world, local_rank, local_world, device, dist.get_backend())
    return run_items(items, d)


def run_config(cfg: RunConfig, d, out_dir, a: argparse.Namespace) -> int:
    """One run on the job's ranks (the process group is up): build, step, check, result.json (rank 0).
    Returns the job's exit code for it: 0 ok, 3 the check failed, 2 a split this model cannot take."""
    t0 = time.perf_counter()

    model = model_adapter(cfg)  # the tutorial Transformer, or a transformers model (labkit.models)
    full = model.build_full()  # same weights on every rank (seeded), kept on CPU as the reference
    if cfg.dtype != "float32":  # --dtype: the stages are cut from it, so they hold this dtype too
        full = full.to(getattr(torch, cfg.dtype))
    autocast = getattr(torch, cfg.autocast) if cfg.autocast else None
    bounds, balance = cfg.layer_bounds() if not cfg.auto_split else None, None
    if cfg.auto_split:  # --split-points auto: measure each block here, on every rank (same answer)
        from ..models.balance import balance_config
        balance = balance_config(cfg, model, full, d.device)
        bounds = balance["bounds"]
        cfg.split_points = [f"layers.{i}" for i in bounds[1:-1]]  # every split reads cfg.layer_bounds()
    par = None
    if cfg.composed:  # a (pp, dp, tp) mesh: this rank's stage index is its pp coordinate (labkit.parallel)
        from ..parallel import compose
        par = compose.build_mesh(cfg, d.device)
    with autocast_ctx(d.device, autocast):  # --autocast: the tracer records the casts the steps will run
        stages, stage_builder = (model.build_stages(full, d.rank, d.device, bounds) if par is None else
                                 model.build_stages(full, par.pp_rank, d.device, bounds, group=par.pp_group,
                                                    **({"par": par} if cfg.model_name != "tutorial" else {})))
    if par is not None:
        compose.parallelize(stages, par)  # TP inside each stage, then FSDP2 over the replicas
    if cfg.resume:  # into this shape's stages (resharded on load), and the reference from the same files
        from ..parallel import checkpoint as ckpt
        ckpt.load_stages(stages, cfg.resume)
        ckpt.load_full(full, cfg.resume)
    clip = None
    if cfg.clip_grad_norm:
        from ..parallel.checkpoint import clip_grad_norm

        norms: list[float] = []  # the global norm before clipping, per update

        def clip(stages_, _pg=(par.pp_group if par is not None else None)):
            norms.append(clip_grad_norm(stages_, cfg.clip_grad_norm, _pg, d.device, model.tied_copies))
    loss_fn = None if cfg.inference else model.loss_fn
    G = cfg.accumulate
    # --accumulate G: torch's scale_grads divides ALL gradients held at the end of each step, those
    # accumulated by earlier steps too; so the steps run unscaled and the sum is scaled once, 1/(m G)
    schedule = model.schedule(stages, loss_fn, **({"scale_grads": False} if G > 1 and not a.accumulate_pitfall else {}))
    grad_scale = (1 / G if a.accumulate_pitfall else 1 / (cfg.n_microbatches * G)) if G > 1 else None
    # the whole (global) batch, the same on every rank: G updates' worth with --accumulate G
    x, y, model_kwargs = (model if G == 1 else model_adapter(cfg.accumulated())).batch(d.device)
    x_mine, y_mine, after_backward, model_kwargs_mine = x, y, model.after_backward, model_kwargs
    if par is not None:  # this replica's share; replicated data parallelism averages the gradients
        x_mine, y_mine = compose.replica_share(par, x, y)
        model_kwargs_mine = dict(zip(model_kwargs, compose.replica_share(par, *model_kwargs.values())))
        after_backward = compose.replicated_average(par, model.after_backward)
    chunks = None
    if G > 1:  # chunk g: samples [gB, (g+1)B) of the global batch, this replica's share of it
        chunks = []
        for xc, yc in zip(x.chunk(G), y.chunk(G)):
            if par is not None:
                xc, yc = compose.replica_share(par, xc, yc)
            args, kw = model.step_inputs(stages, xc, {})
            chunks.append((args, kw, yc))

    if cfg.profile:
        worker.annotate_stages(stages)
    with worker.maybe_profile(cfg.profile, d, out_dir):
        step_times, step_losses, first = run_steps(cfg, d, stages, schedule, x_mine, y_mine, a.log_ab,
                                                   model.step_inputs(stages, x_mine, model_kwargs_mine), after_backward,
                                                   a.spans_ab, chunks, grad_scale, clip, memory=par is not None)
    peak = worker.peak_memory_bytes(d.device)
    has_last = any(s.is_last for s in stages)

    # The check: ONE forward (and backward) of the unsplit model on the WHOLE (global) batch.
    losses, grads, n_mb, group = first["losses"], first["grads"], cfg.n_microbatches * G, None
    if par is not None:  # every replica's losses, whole gradients from the shards; one check per pipeline
        losses = compose.all_replicas_losses(par, losses, n_mb, has_last, d.device, chunks=G)
        grads, n_mb, group = compose.full_grads(grads), n_mb * par.dp_size, par.pp_group
    check = check_step(full, stages, x, y, losses, n_mb, loss_fn, grads=grads,
                       output=first["output"], extra=[float(peak), *step_times], tolerance=cfg.tolerance,
                       device=d.device, kwargs=model_kwargs, tied=model.tied_aliases,
                       renamed=model.renamed, group=group, clip_grad_norm=cfg.clip_grad_norm, autocast=autocast)
    if par is not None:  # every pipeline's verdict must hold
        check.ok = min(v[0] for v in worker.all_gather_floats([float(check.ok)], d.device)) > 0.5
    memory = None
    if par is not None:  # every rank's bytes: parameters, gradients, optimizer state, activations
        memory = worker.all_gather_floats(first.get("memory") or [0.0] * 4, d.device)
    if cfg.checkpoint:  # the weights after the run's updates, every parameter once
        from ..parallel import checkpoint as ckpt
        ckpt.save(stages, cfg.checkpoint)
    last_rank = (par.global_rank(cfg.pp_size - 1) if par is not None else
                 next(r for r in range(d.world_size) if cfg.n_stages - 1 in cfg.stages_of_rank(r)))
    step_losses = worker.broadcast_floats(step_losses if has_last else None, cfg.steps, last_rank, d.device)

    if d.rank == 0:
        result = dict(
            schedule=cfg.schedule, pp_size=cfg.pp_size, n_stages=cfg.n_stages,
            stages_per_rank=cfg.stages_per_rank, n_microbatches=cfg.n_microbatches,
            stage_placement=[cfg.stages_of_rank(r) for r in range(cfg.pp_size)],
            split=cfg.split, stage_builder=stage_builder, inference=cfg.inference,
            layout=cfg.layout, preset=cfg.preset, batch_size=cfg.batch_size, model=cfg.model_name,
            dtype=cfg.dtype, autocast=cfg.autocast,
            layer_bounds=bounds, balance=balance,
            step_losses=[] if cfg.inference else step_losses,
            peak_memory_bytes=[int(r[0]) for r in check.extras],
            peak_memory_kind="cuda max_memory_allocated" if d.device.type == "cuda" else "process peak RSS",
            step_time_s=[max(r[1 + i] for r in check.extras) for i in range(cfg.steps)],
            profiled=cfg.profile, wall_time_s=time.perf_counter() - t0, config=cfg.to_dict(),
        )
        if cfg.checkpoint or cfg.resume or cfg.clip_grad_norm:
            result.update(checkpoint=cfg.checkpoint, resume=cfg.resume, clip_grad_norm=cfg.clip_grad_norm,
                          grad_norm_before_clip=norms if cfg.clip_grad_norm else None)
        if G > 1:
            result.update(accumulate=G, scale_grads="torch's default (True), then / G: the pitfall" if
                          a.accumulate_pitfall else "False; the accumulated sum scaled by 1/(m G) once")
        if par is not None:
            result.update(dp_size=cfg.dp_size, tp_size=cfg.tp_size, fsdp=cfg.fsdp, world_size=cfg.world_size,
                          mesh="(pp, dp, tp) = " + str((cfg.pp_size, cfg.dp_size, cfg.tp_size)),
                          global_batch=cfg.batch_size, checked_microbatches=n_mb,
                          # the pipelines, read from the mesh the ranks built: ranks sharing (dp, tp), in pp order
                          pipelines=[par.mesh.mesh[:, i, j].tolist() for i in range(cfg.dp_size) for j in range(cfg.tp_size)],
                          memory_per_rank=[dict(zip(("parameters", "gradients", "optimizer_state", "activations"),
                                                    map(int, row))) for row in memory])
        if cfg.schedule_csv:  # the order that ran, as written (the ideal beside it is simulated from it)
            from ..config.run import read_order_csv

            result["schedule_csv"] = cfg.schedule_csv
            result["order"] = {str(r): acts for r, acts in read_order_csv(cfg.schedule_csv).items()}
            result["runtime"] = "torch.distributed.pipelining.schedules._PipelineScheduleRuntime"
        if a.log_ab:  # which steps logged (the capture-overhead benchmark)
            result["step_pp_logs"] = [worker.pp_logs_on_step(i) for i in range(cfg.steps)]
        if a.spans_ab:  # which steps recorded spans (the span-overhead benchmark)
            result["step_spans"] = [worker.pp_logs_on_step(i) for i in range(cfg.steps)]
        worker.write_result(out_dir, d, check, **result)
        mesh = f" x dp {cfg.dp_size} x tp {cfg.tp_size}{' (FSDP2)' if cfg.fsdp else ''}" if par is not None else ""
        how = "" if cfg.dtype == "float32" and not cfg.autocast else \
            f" ({cfg.dtype}{', autocast ' + cfg.autocast if cfg.autocast else ''})"
        print(f"[labkit] {cfg.schedule} x{cfg.pp_size} ranks{mesh}, {cfg.n_stages} stages, {cfg.n_microbatches} "
              f"microbatches{how}: pipelined step {check.verdict()}", flush=True)
    return 0 if check.ok else 3


if __name__ == "__main__":
    worker.exit_now(main())
