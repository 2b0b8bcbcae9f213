"""A run's options around the pipeline: dtypes and autocast, data and tensor parallelism, checkpoints
and clipping. The `validate_*` functions read a `RunConfig` and change nothing; `derived_fields` gives
the values a valid config implies, which `RunConfig.__post_init__` sets. Imports no torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..core.errors import ConfigError, positive_int

if TYPE_CHECKING:
    from .run import RunConfig

DTYPES = ("float32", "bfloat16", "float64")

AUTOCAST_DTYPES = ("bfloat16",)


def validate_checkpoints(cfg: "RunConfig") -> None:
    """--checkpoint, --resume and --clip-grad-norm: values the job can use (the config is not changed;
    `derived_fields` makes the folders absolute)."""
    if cfg.clip_grad_norm is not None and not (isinstance(cfg.clip_grad_norm, (int, float)) and cfg.clip_grad_norm > 0):
        raise ConfigError(f"--clip-grad-norm must be a positive number, got {cfg.clip_grad_norm!r}.")
    if (cfg.checkpoint or cfg.resume) and (cfg.model_name != "tutorial" or cfg.split != "manual" or cfg.inference):
        raise ConfigError("--checkpoint / --resume save and load the stages of the tutorial model cut by hand (its "
                          "stages keep the unsplit model's parameter names): use --model tutorial --split manual.")
    if cfg.checkpoint:
        checkpoint = os.path.abspath(cfg.checkpoint)
        if os.path.isdir(checkpoint) and os.listdir(checkpoint):
            raise ConfigError(f"--checkpoint {checkpoint} already holds files: choose a new folder (a checkpoint "
                              f"is never written over another).")
    if cfg.resume:
        resume = os.path.abspath(cfg.resume)
        if not os.path.isfile(os.path.join(resume, ".metadata")):
            raise ConfigError(f"--resume {resume}: no checkpoint there (no .metadata file). Save one first with "
                              f"labkit run ... --checkpoint {resume}.")


TP_TOLERANCE = 1e-3   # RunConfig.tolerance's default with tensor parallelism (float32 sums in another order)


def validate_dtypes(cfg: "RunConfig") -> None:
    """--dtype, --autocast and --tolerance: values the job can run and check."""
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {cfg.dtype!r}. Use --dtype float32 (the default), "
                          f"bfloat16 or float64.")
    if cfg.autocast is not None and cfg.autocast not in AUTOCAST_DTYPES:
        raise ConfigError(f"autocast must be one of {AUTOCAST_DTYPES}, got {cfg.autocast!r}. Use --autocast bfloat16, "
                          f"or leave it out for no autocast.")
    if cfg.autocast is not None and cfg.dtype != "float32":
        raise ConfigError(f"--autocast {cfg.autocast} keeps float32 weights and computes in {cfg.autocast}: it needs "
                          f"--dtype float32, got --dtype {cfg.dtype}. Drop one of the two.")
    if cfg.tolerance is not None and not (isinstance(cfg.tolerance, (int, float)) and cfg.tolerance > 0):
        raise ConfigError(f"--tolerance must be a positive number, got {cfg.tolerance!r}; leave it out to judge the "
                          f"step against its measured float noise.")


def validate_parallel(cfg: "RunConfig") -> None:
    """Data and tensor parallelism around the pipeline: sizes that divide, and what is supported (the
    config is not changed; `derived_fields` gives the defaults that follow from it)."""
    positive_int("accumulate", cfg.accumulate, "Pass --accumulate G with G >= 1 (1: no accumulation).")
    validate_checkpoints(cfg)
    if cfg.accumulate > 1 and (cfg.model_name != "tutorial" or cfg.inference or cfg.schedule_csv):
        raise ConfigError("--accumulate is wired for training steps of the tutorial model: drop --inference and "
                          "--schedule-csv, and use --model tutorial.")
    positive_int("dp_size", cfg.dp_size, "Pass --dp-size D with D >= 1 (1: no data parallelism).")
    positive_int("tp_size", cfg.tp_size, "Pass --tp-size T with T >= 1 (1: no tensor parallelism).")
    if not cfg.composed:
        return
    if cfg.fsdp and cfg.dp_size < 2:
        raise ConfigError("--fsdp shards each stage over its data-parallel replicas: pass --dp-size 2 or more.")
    if cfg.batch_size % (cfg.dp_size * cfg.n_microbatches):
        raise ConfigError(
            f"Batch size {cfg.batch_size} does not split into {cfg.dp_size} replicas x {cfg.n_microbatches} "
            f"microbatches: each replica steps batch/dp samples cut into equal microbatches. Use a --batch-size "
            f"that is a multiple of {cfg.dp_size * cfg.n_microbatches}.")
    if (cfg.dtype != "float32" or cfg.autocast) and cfg.composed:
        raise ConfigError(f"--dtype {cfg.dtype}{' --autocast ' + cfg.autocast if cfg.autocast else ''} is wired for "
                          f"pipelines alone: FSDP2's and TP's own mixed-precision policies are not. Use --dp-size 1 "
                          f"--tp-size 1 (no --fsdp), or --dtype float32 without --autocast.")
    if cfg.tp_size > 1 and cfg.model_name in ("gpt2", "bert"):
        raise ConfigError(f"--tp-size {cfg.tp_size} with --model {cfg.model_name}: the kit's tensor-parallel plans "
                          f"cover the tutorial model and Llama-layout models (q/k/v/o and gate/up/down projections); "
                          f"{cfg.model_name}'s attention is one fused projection. Use --dp-size (with or without "
                          f"--fsdp), or --model llama.")
    if cfg.inference or cfg.schedule_csv or cfg.split != "manual":
        raise ConfigError("Data or tensor parallelism runs training steps of manually split stages: drop "
                          "--inference, --schedule-csv and --split tracer, or use --dp-size 1 --tp-size 1.")


def derived_fields(cfg: "RunConfig") -> dict:
    """The values a valid config's own fields imply, for `RunConfig.__post_init__` to set once it is
    validated: the checkpoint folders made absolute (the job runs in another directory), and with
    tensor parallelism and no --tolerance the check's bound TP_TOLERANCE."""
    derived = {name: os.path.abspath(getattr(cfg, name)) for name in ("checkpoint", "resume") if getattr(cfg, name)}
    if cfg.tp_size > 1 and cfg.tolerance is None:
        # TP cuts every MLP matmul's sum in tp parts: in float32 the order of additions changes, a
        # pre-activation within rounding of 0 lands on the other side of a ReLU, and the tutorial model's
        # gradients move by up to ~1e-4 (99000x the floor the reference measures on itself: its own
        # reorderings flip no ReLU). The same run in float64 agrees to 1e-12 (tests/test_parallel.py),
        # so it is rounding, not a bug; the default check allows 1e-3 absolute.
        derived["tolerance"] = TP_TOLERANCE
    return derived
