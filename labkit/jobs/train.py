"""The reference job: train the tutorial's Transformer with torch.distributed.pipelining.

    labkit run --schedule 1F1B --nproc 2 --microbatches 4 --split manual --out runs/demo
    torchrun --nproc-per-node 2 -m labkit.jobs.train --config runs/demo/config.json

Reads its `RunConfig` from the run directory's config.json (`labkit run` writes it; `--config`
names another). Every rank builds the same full model (same seed), keeps its stages (manual or
tracer split), runs `steps` steps of the schedule, and checks the FIRST step against one
forward/backward of the unsplit model on the whole batch (`labkit.check.reference.check_step`). Rank 0
writes result.json into the run directory. Exit codes: 0 ok, 2 bad configuration, 3 the
reference check failed. Taught in notebooks 00 and 04.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..worker import distributed as worker
from ..core.errors import ConfigError
from ..config.run import RunConfig
from ..models.adapter import adapter as model_adapter
from ..check.noise import autocast_ctx
from ..check.reference import check_step
from ..worker.shared import shared_work
from .steps import BenchOptions, StepPlan, compile_counts, run_steps


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
    with shared_work():  # what configs of the same model, batch and cut compute alike: once (traces, references)
        for it in items:
            cfg = RunConfig.from_dict(it["config"])
            (out := Path(it["out"])).mkdir(parents=True, exist_ok=True)
            cfg.to_json(out / "config.json")
            if (rec := recorder()) is not None:
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


@dataclass
class Job:
    """One run's state on this rank: built by `build_job`, read by the steps after it."""

    cfg: RunConfig
    d: Any
    """This rank's place in the job (worker.distributed.DistInfo)."""
    model: Any
    """The model's adapter (labkit.models.adapter): the tutorial Transformer, or a transformers model."""
    full: torch.nn.Module
    """The unsplit model, same weights on every rank (seeded), kept on CPU as the reference."""
    stages: list  # this rank's PipelineStages
    stage_builder: str
    bounds: list[int] | None
    """Layer index where each stage starts, plus n_layers."""
    balance: dict | None = None
    """--split-points auto: the measured per-block costs and the bounds chosen from them."""
    par: Any = None
    """Composed runs: the (pp, dp, tp) mesh and this rank's coordinates (labkit.parallel.compose)."""
    started: float = 0.0
    """time.perf_counter() when the build began (result.json's wall_time_s)."""
    norms: list[float] = field(default_factory=list)
    """--clip-grad-norm: the global gradient norm before clipping, per update."""

    @property
    def autocast(self):
        return getattr(torch, self.cfg.autocast) if self.cfg.autocast else None

    @property
    def loss_fn(self):
        return None if self.cfg.inference else self.model.loss_fn

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)


@dataclass
class Batch:
    """The whole (global) batch, the same on every rank: G updates' worth with --accumulate G."""

    x: torch.Tensor
    y: torch.Tensor
    kwargs: dict  # the model's other inputs (attention_mask, position_ids for a transformers model)


@dataclass
class Outcome:
    """What the steps and the check found, for result.json."""

    check: Any
    """The reference check (labkit.check.reference.Check), every rank's step times and peaks in its extras."""
    step_losses: list[float]
    """Each step's mean loss, from the rank that holds the last stage."""
    checked_microbatches: int
    memory: list | None = None
    """Composed runs: every rank's bytes of parameters, gradients, optimizer state and activations."""
    compile: dict = field(default_factory=dict)  # every rank's torch.compile counts (steps.compile_counts)


def run_config(cfg: RunConfig, d, out_dir, a: argparse.Namespace) -> int:
    """One run on the job's ranks (the process group is up): build, step, check, result.json (rank 0).
    Returns the job's exit code for it: 0 ok, 3 the check failed, 2 a split this model cannot take."""
    job = build_job(cfg, d)
    plan, batch = plan_steps(job, a.accumulate_pitfall)
    if cfg.profile:
        worker.annotate_stages(job.stages)
    with compile_counts(d.device) as dynamo, worker.maybe_profile(cfg.profile, d, out_dir):
        step_times, step_losses, first = run_steps(cfg, d, job.stages, plan, BenchOptions.from_args(a))
    peak = worker.peak_memory_bytes(d.device)
    check, n_mb = check_job(job, batch, first, [float(peak), *step_times])
    memory = None
    if job.par is not None:  # every rank's bytes: parameters, gradients, optimizer state, activations
        memory = worker.all_gather_floats(first.get("memory") or [0.0] * 4, d.device)
    if cfg.checkpoint:  # the weights after the run's updates, every parameter once
        from ..parallel import checkpoint as ckpt
        ckpt.save(job.stages, cfg.checkpoint)
    outcome = Outcome(check, _losses_of_last_stage(job, step_losses), n_mb, memory, dynamo)
    if d.rank == 0:
        report(job, outcome, out_dir, a)
    return 0 if check.ok else 3


def build_job(cfg: RunConfig, d) -> Job:
    """Build: the model, where it is cut, the mesh (composed runs), this rank's stages, and a
    checkpoint's weights in them and in the reference (--resume)."""
    started = time.perf_counter()
    model = model_adapter(cfg)  # the tutorial Transformer, or a transformers model (labkit.models)
    full = model.build_full()  # same weights on every rank (seeded), kept on CPU as the reference
    if cfg.dtype != "float32":  # --dtype: the stages are cut from it, so they hold this dtype too
        full = full.to(getattr(torch, cfg.dtype))
    bounds, balance = _split(cfg, model, full, d.device)
    par = None
    if cfg.composed:  # a (pp, dp, tp) mesh: this rank's stage index is its pp coordinate (labkit.parallel)
        from ..parallel import compose
        par = compose.build_mesh(cfg, d.device)
    stages, stage_builder = _build_stages(cfg, d, model, full, bounds, par)
    if cfg.resume:  # into this shape's stages (resharded on load), and the reference from the same files
        from ..parallel import checkpoint as ckpt
        ckpt.load_stages(stages, cfg.resume)
        ckpt.load_full(full, cfg.resume)
    return Job(cfg, d, model, full, stages, stage_builder, bounds, balance, par, started)


def _split(cfg: RunConfig, model, full, device) -> tuple[list[int], dict | None]:
    """(layer bounds, balance): cfg's split points, or with --split-points auto the points balanced from
    each block measured here, on every rank (same answer), written back into cfg.split_points."""
    if not cfg.auto_split:
        return cfg.layer_bounds(), None
    from ..models.balance import balance_config
    balance = balance_config(cfg, model, full, device)
    bounds = balance["bounds"]
    cfg.split_points = [f"layers.{i}" for i in bounds[1:-1]]  # every split reads cfg.layer_bounds()
    return bounds, balance


def _build_stages(cfg: RunConfig, d, model, full, bounds, par):
    """This rank's stages and how they were built; composed runs: its pp coordinate's, with TP inside
    each stage and FSDP2 over the replicas."""
    autocast = getattr(torch, cfg.autocast) if cfg.autocast else None
    with autocast_ctx(d.device, autocast):  # --autocast: the tracer records the casts the steps will run
        if par is None:
            return model.build_stages(full, d.rank, d.device, bounds)
        stages, stage_builder = model.build_stages(full, par.pp_rank, d.device, bounds, group=par.pp_group,
                                                   **({"par": par} if cfg.model_name != "tutorial" else {}))
    from ..parallel import compose
    compose.parallelize(stages, par)  # TP inside each stage, then FSDP2 over the replicas
    return stages, stage_builder


def plan_steps(job: Job, pitfall: bool = False) -> tuple[StepPlan, Batch]:
    """Step: the schedule, the whole batch and what this rank feeds each step, and what the update does
    to the gradients (accumulation's scale, the replicas' average, clipping). pitfall: --accumulate-pitfall."""
    cfg, model, G = job.cfg, job.model, job.cfg.accumulate
    clip = _clipper(job)
    # --accumulate G: torch's scale_grads divides ALL gradients held at the end of each step, those
    # accumulated by earlier steps too; so the steps run unscaled and the sum is scaled once, 1/(m G)
    schedule = model.schedule(job.stages, job.loss_fn, **({"scale_grads": False} if G > 1 and not pitfall else {}))
    grad_scale = (1 / G if pitfall else 1 / (cfg.n_microbatches * G)) if G > 1 else None
    # the whole (global) batch, the same on every rank: G updates' worth with --accumulate G
    batch = Batch(*(model if G == 1 else model_adapter(cfg.accumulated())).batch(job.d.device))
    after_backward = model.after_backward
    if job.par is not None:  # replicated data parallelism averages the gradients
        from ..parallel import compose
        after_backward = compose.replicated_average(job.par, model.after_backward)
    plan = StepPlan(schedule, _chunks(job, batch), after_backward=after_backward, grad_scale=grad_scale,
                    clip=clip, memory=job.par is not None)
    return plan, batch


def _chunks(job: Job, batch: Batch) -> list:
    """[(args, kwargs, target)] this rank passes to the schedule steps of one update: the whole batch,
    or with --accumulate G chunk g = samples [gB, (g+1)B); composed runs: this replica's share of it."""
    G = job.cfg.accumulate
    if G == 1:
        x, y = _share(job, batch.x, batch.y)
        kwargs = dict(zip(batch.kwargs, _share(job, *batch.kwargs.values())))
        args, kwargs = job.model.step_inputs(job.stages, x, kwargs)
        return [(args, kwargs, y)]
    chunks = []
    for xc, yc in zip(batch.x.chunk(G), batch.y.chunk(G)):
        xc, yc = _share(job, xc, yc)
        args, kwargs = job.model.step_inputs(job.stages, xc, {})
        chunks.append((args, kwargs, yc))
    return chunks


def _share(job: Job, *tensors) -> list:
    """This replica's share of whole-batch tensors (composed runs), else the tensors."""
    if job.par is None:
        return list(tensors)
    from ..parallel import compose
    return compose.replica_share(job.par, *tensors)


def _clipper(job: Job):
    """--clip-grad-norm: clip(stages) clips to the global norm (over every stage and shard) and keeps
    the norm before clipping in job.norms; None without it."""
    if not job.cfg.clip_grad_norm:
        return None
    from ..parallel.checkpoint import clip_grad_norm

    pg = job.par.pp_group if job.par is not None else None

    def clip(stages):
        job.norms.append(clip_grad_norm(stages, job.cfg.clip_grad_norm, pg, job.d.device, job.model.tied_copies))
    return clip


def check_job(job: Job, batch: Batch, first: dict, extra: list[float]):
    """Check: ONE forward (and backward) of the unsplit model on the WHOLE (global) batch against the
    first step (collective). extra: this rank's numbers every rank's check gathers (peak, step times).
    Returns (the check, the microbatches it covered)."""
    cfg, d, par = job.cfg, job.d, job.par
    losses, grads, n_mb, group = first["losses"], first["grads"], cfg.n_microbatches * cfg.accumulate, None
    if par is not None:  # every replica's losses, whole gradients from the shards; one check per pipeline
        from ..parallel import compose
        losses = compose.all_replicas_losses(par, losses, n_mb, job.has_last, d.device, chunks=cfg.accumulate)
        grads, n_mb, group = compose.full_grads(grads), n_mb * par.dp_size, par.pp_group
    check = check_step(job.full, job.stages, batch.x, batch.y, losses, n_mb, job.loss_fn, grads=grads,
                       output=first["output"], extra=extra, tolerance=cfg.tolerance, device=d.device,
                       kwargs=batch.kwargs, tied=job.model.tied_aliases, renamed=job.model.renamed, group=group,
                       clip_grad_norm=cfg.clip_grad_norm, autocast=job.autocast, values=first.get("values"))
    if par is not None:  # every pipeline's verdict must hold
        check.ok = min(v[0] for v in worker.all_gather_floats([float(check.ok)], d.device)) > 0.5
    return check, n_mb


def _losses_of_last_stage(job: Job, step_losses: list[float]) -> list[float]:
    """Every step's mean loss as the rank holding the last stage saw it, on every rank (collective)."""
    cfg, d, par = job.cfg, job.d, job.par
    last_rank = (par.global_rank(cfg.pp_size - 1) if par is not None else
                 next(r for r in range(d.world_size) if cfg.n_stages - 1 in cfg.stages_of_rank(r)))
    return worker.broadcast_floats(step_losses if job.has_last else None, cfg.steps, last_rank, d.device)


def report(job: Job, outcome: Outcome, out_dir, a: argparse.Namespace) -> None:
    """Report (rank 0): result.json in the run directory and the one-line verdict."""
    cfg, d, check = job.cfg, job.d, outcome.check
    result = _result_fields(job, outcome)
    if cfg.checkpoint or cfg.resume or cfg.clip_grad_norm:
        result.update(checkpoint=cfg.checkpoint, resume=cfg.resume, clip_grad_norm=cfg.clip_grad_norm,
                      grad_norm_before_clip=job.norms if cfg.clip_grad_norm else None)
    if cfg.accumulate > 1:
        result.update(accumulate=cfg.accumulate, scale_grads="torch's default (True), then / G: the pitfall" if
                      a.accumulate_pitfall else "False; the accumulated sum scaled by 1/(m G) once")
    if job.par is not None:
        result.update(_mesh_fields(job, outcome))
    if cfg.schedule_csv:  # the order that ran, as written (the ideal beside it is simulated from it)
        from ..config.run import read_order_csv

        result["schedule_csv"] = cfg.schedule_csv
        result["order"] = {str(r): acts for r, acts in read_order_csv(cfg.schedule_csv).items()}
        from ..versions import RUNTIME

        result["runtime"] = RUNTIME
    result.update(BenchOptions.from_args(a).result_fields(cfg.steps))  # the capture / span-overhead benchmarks
    result["compile"] = outcome.compile  # what torch.compile did in the steps, per rank (labkit.spans.compiled)
    worker.write_result(out_dir, d, check, **result)
    mesh = f" x dp {cfg.dp_size} x tp {cfg.tp_size}{' (FSDP2)' if cfg.fsdp else ''}" if job.par is not None else ""
    how = "" if cfg.dtype == "float32" and not cfg.autocast else \
        f" ({cfg.dtype}{', autocast ' + cfg.autocast if cfg.autocast else ''})"
    print(f"[labkit] {cfg.schedule} x{cfg.pp_size} ranks{mesh}, {cfg.n_stages} stages, {cfg.n_microbatches} "
          f"microbatches{how}: pipelined step {check.verdict()}", flush=True)


def _result_fields(job: Job, outcome: Outcome) -> dict:
    """result.json's fields every run has: the shape that ran, its split, losses, memory and times."""
    cfg, d, extras = job.cfg, job.d, outcome.check.extras
    return dict(
        schedule=cfg.schedule, pp_size=cfg.pp_size, n_stages=cfg.n_stages,
        stages_per_rank=cfg.stages_per_rank, n_microbatches=cfg.n_microbatches,
        stage_placement=[cfg.stages_of_rank(r) for r in range(cfg.pp_size)],
        split=cfg.split, stage_builder=job.stage_builder, inference=cfg.inference,
        layout=cfg.layout, preset=cfg.preset, batch_size=cfg.batch_size, model=cfg.model_name,
        dtype=cfg.dtype, autocast=cfg.autocast,
        layer_bounds=job.bounds, balance=job.balance,
        step_losses=[] if cfg.inference else outcome.step_losses,
        peak_memory_bytes=[int(r[0]) for r in extras],
        peak_memory_kind="cuda max_memory_allocated" if d.device.type == "cuda" else "process peak RSS",
        step_time_s=[max(r[1 + i] for r in extras) for i in range(cfg.steps)],
        profiled=cfg.profile, wall_time_s=time.perf_counter() - job.started, config=cfg.to_dict(),
    )


def _mesh_fields(job: Job, outcome: Outcome) -> dict:
    """result.json's fields of a composed run: the mesh, its pipelines and every rank's memory."""
    cfg, par = job.cfg, job.par
    return dict(dp_size=cfg.dp_size, tp_size=cfg.tp_size, fsdp=cfg.fsdp, world_size=cfg.world_size,
                mesh="(pp, dp, tp) = " + str((cfg.pp_size, cfg.dp_size, cfg.tp_size)),
                global_batch=cfg.batch_size, checked_microbatches=outcome.checked_microbatches,
                # the pipelines, read from the mesh the ranks built: ranks sharing (dp, tp), in pp order
                pipelines=[par.mesh.mesh[:, i, j].tolist() for i in range(cfg.dp_size) for j in range(cfg.tp_size)],
                memory_per_rank=[dict(zip(("parameters", "gradients", "optimizer_state", "activations"),
                                          map(int, row))) for row in outcome.memory])


if __name__ == "__main__":
    worker.exit_now(main())
