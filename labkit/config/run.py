"""Run configuration: `RunConfig`, what one pipelining job is, checked before any rank starts.

This module owns *what a valid pipelining job is*; the schedules the kit knows live in
`labkit.schedules` (`table.py`), the model presets in `labkit/config/presets.py`, the dtype and
parallel options in `labkit/config/options.py`. It imports no torch, so the CLI, the
explorer and the launcher can reject bad input in milliseconds, before any rank starts.
Every error says how to fix the value (notebook 09 teaches the rules behind them).
"""

from __future__ import annotations
import dataclasses
import json
import os
from dataclasses import dataclass, field
from .options import AUTOCAST_DTYPES, DTYPES, derived_fields, validate_dtypes, validate_parallel
from .presets import BLOCK_PREFIXES, LAYOUTS, ModelPreset, PRESETS, validate_model
from ..core.errors import ConfigError, positive_int
from ..schedules.table import (SCHEDULES, ScheduleInfo, _divisors, layer_bounds, schedule_info, stage_placement,
                               validate_microbatches, validate_schedule, validate_sizes)


SPLIT_MODES = ("manual", "tracer")


DEVICES = ("auto", "cpu", "cuda")


def _flag(*flags: str, choices=None) -> dict:
    """Field metadata for the command line (`labkit.cli` builds `labkit run`'s flags from RunConfig)."""
    return {"flags": flags, **({"choices": tuple(choices)} if choices else {})}


@dataclass
class RunConfig:
    """One run of the reference job (`python -m labkit.jobs.train`), validated on creation.

    The one owner of what a run is: the job reads it back from its run directory's config.json,
    and `labkit run`'s flags are made from these fields and their docstrings. Taught in notebooks
    00, 01 and 04.
    """

    schedule: str = field(default="GPipe", metadata=_flag("--schedule", choices=SCHEDULES))
    """Schedule name, one of `SCHEDULES` (e.g. GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble)."""
    pp_size: int = field(default=2, metadata=_flag("--nproc", "--pp-size"))
    """Ranks in the pipeline (on the command line: ranks per node, times --nnodes)."""
    n_microbatches: int = field(default=4, metadata=_flag("--microbatches", "--n-microbatches"))
    """Microbatches the batch is cut into (along the batch dimension)."""
    split: str = field(default="manual", metadata=_flag("--split", choices=SPLIT_MODES))
    """How the model is cut: `manual` (delete layers) or `tracer` (`pipeline()` + split_spec)."""
    stages_per_rank: int | None = None
    """Stages on each rank: 1 for GPipe/1F1B, 2 by default for multi-stage schedules."""
    preset: str = field(default="small", metadata=_flag("--preset", choices=PRESETS))
    """Model and batch sizes, one of `PRESETS`: small (CPU laptops), tiny (test suites), tutorial (GPUs)."""
    batch_size: int | None = None
    """Whole-batch size; default: the preset's."""
    steps: int = 1
    """Training steps (the reference check is made on the first)."""
    inference: bool = False
    """Forward only (`loss_fn=None`): the check compares outputs instead of losses and grads."""
    device: str = field(default="auto", metadata=_flag("--device", choices=DEVICES))
    """`cuda` (nccl, one GPU per rank), `cpu` (gloo) or `auto` (cuda when there is a GPU per rank)."""
    layout: str = field(default="batch", metadata=_flag("--layout", choices=LAYOUTS))
    """`batch`: tokens are (batch, seq) and microbatches split the batch (matches the unsplit model).
    `tutorial`: the official tutorial's layout, where microbatches split the sequence (fails the check)."""
    seed: int = 0
    """Seed for weights and data (identical on every rank)."""
    pg_timeout: float = 60.0
    """Process-group timeout in seconds (gloo's default is 30 minutes: far too long for a lab)."""
    tolerance: float | None = None
    """Largest absolute difference from the unsplit reference that still counts as a match. Default: none;
    each compared tensor is judged against the float noise measured for this model and data
    (labkit.check.noise: within 2x its floor). With --tp-size > 1 the default is 1e-3: TP's split sums
    flip ReLUs the floor does not model."""
    dtype: str = field(default="float32", metadata=_flag("--dtype", choices=DTYPES))
    """The model's parameters, activations and gradients: float32, bfloat16 (the check's reference in bf16
    too, with its own floor) or float64 (rounding near 1e-16: the float noise vanishes)."""
    autocast: str | None = field(default=None, metadata=_flag("--autocast", choices=AUTOCAST_DTYPES))
    """Run the stages' forwards under torch.autocast with this dtype (bfloat16): float32 weights and
    optimizer, bf16 matmuls; the check's reference runs under the same autocast. Needs --dtype float32."""
    split_points: list[str] | None = None
    """Modules where stages 1..n_stages-1 begin, e.g. ["layers.3", "layers.6"] (SplitPoint.BEGINNING);
    default: layers spread evenly. Used by both split modes."""
    model_name: str = field(default="tutorial", metadata=_flag("--model"))
    """`tutorial` (the official tutorial's Transformer) or a transformers model type built small from the
    preset's sizes: llama, gpt2, bert, or any causal LM laid out like Llama (qwen2, mistral, ...). Needs the
    `models` extra (transformers)."""
    profile: bool = False
    """Also record a torch.profiler trace per rank (profile/rank<N>.json in the run directory)."""
    dp_size: int = 1
    """Data-parallel replicas of the pipeline (a (pp, dp, tp) DeviceMesh of pp_size x dp_size x tp_size
    ranks): each replica steps its share of the batch; gradients averaged over the replicas."""
    tp_size: int = 1
    """Tensor-parallel ranks inside each stage (DTensor plans: the tutorial model's MLP; a Llama-layout
    model's attention heads and MLP). Not for gpt2 / bert (fused attention projections)."""
    fsdp: bool = False
    """Shard each stage over its data-parallel replicas with FSDP2 (`fully_shard`, reshard_after_forward
    False: with pipelining a stage runs several microbatches' forwards before their backwards, and
    resharding would gather the parameters again for every one); default: replicated (all-reduce)."""
    accumulate: int = 1
    """Gradient accumulation: G schedule steps (G global batches) per optimizer update; the check is
    ONE step of the unsplit model on G times the batch. The schedules run with scale_grads=False and the
    sum is scaled once (torch's scale_grads would also divide what earlier steps accumulated)."""
    checkpoint: str | None = None
    """Save the stages' weights after the run with torch.distributed.checkpoint into this new folder
    (every parameter once, sharded by stage and replica)."""
    resume: str | None = None
    """Load the stages' weights from a checkpoint folder (saved by any pipeline shape, with or without
    FSDP/TP) before the steps; the check's unsplit model is loaded from the same checkpoint."""
    clip_grad_norm: float | None = None
    """Clip the gradients to this global norm (over every stage and shard) before the update; the
    unsplit reference is clipped the same way (torch.nn.utils.clip_grad_norm_)."""
    schedule_csv: str | None = None
    """A compute-only order to run instead of the schedule's own (torch's CSV format, e.g. from `labkit
    search --csv`): row r is rank r's actions (0F1, 0I0, 0W0, ...), stage r on rank r, run on torch's
    `_PipelineScheduleRuntime`, which adds the sends and receives. Use with --schedule 1F1B."""
    extra: dict = field(default_factory=dict, metadata={"flags": ()})
    """Free-form notes carried into result.json (never interpreted; no command-line flag)."""

    def __post_init__(self) -> None:
        info = schedule_info(self.schedule)
        self.schedule = info.name
        validate_sizes(self.pp_size, self.n_microbatches)
        positive_int("steps", self.steps, "Pass --steps N with N >= 1.")
        if self.split not in SPLIT_MODES:
            raise ConfigError(f"split must be one of {SPLIT_MODES}, got {self.split!r}. "
                              "Use --split manual or --split tracer.")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {DEVICES}, got {self.device!r}. "
                              "Use --device auto to let the kit choose.")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {LAYOUTS}, got {self.layout!r}.")
        if self.preset not in PRESETS:
            raise ConfigError(f"Unknown preset {self.preset!r}. Choose one of: {', '.join(PRESETS)}.")
        validate_dtypes(self)
        if not (isinstance(self.pg_timeout, (int, float)) and self.pg_timeout > 0):
            raise ConfigError(f"pg_timeout must be a positive number of seconds, got {self.pg_timeout!r}.")

        self.stages_per_rank = validate_schedule(info, self.pp_size, self.stages_per_rank, self.inference)
        preset = PRESETS[self.preset]
        if self.batch_size is None:
            self.batch_size = preset.batch_size
        positive_int("batch_size", self.batch_size, "Pass --batch-size B with B >= 1.")
        if self.n_stages > preset.n_layers:
            raise ConfigError(
                f"{self.n_stages} stages ({self.pp_size} ranks x {self.stages_per_rank} stages per rank) but the "
                f"{self.preset!r} preset has only {preset.n_layers} decoder layers: every stage needs at least "
                f"one. Use fewer ranks or stages per rank."
            )
        if self.batch_size % self.n_microbatches:
            raise ConfigError(
                f"Batch size {self.batch_size} is not divisible by {self.n_microbatches} microbatches: the "
                f"schedules cut the batch into equal microbatches. Use --microbatches that divides "
                f"{self.batch_size} (e.g. {_divisors(self.batch_size)}), or change --batch-size."
            )
        validate_model(self.model_name, self.layout)
        if self.split_points is not None:
            self.split_points = list(self.split_points)
            if not self.auto_split:
                self.layer_bounds()  # validates
                self.split_points = self._kit_names()  # a family's own module names as layers.<i>
        if self.layout == "tutorial" and preset.seq_len % self.n_microbatches:
            raise ConfigError(
                f"With the tutorial layout the microbatches cut the sequence ({preset.seq_len} tokens): use "
                f"--microbatches that divides {preset.seq_len}."
            )
        validate_microbatches(info, self.pp_size, self.n_stages, self.n_microbatches)
        validate_parallel(self)
        for name, value in derived_fields(self).items():  # validation changes nothing; the derivation is here
            setattr(self, name, value)
        if self.schedule_csv is not None:
            self.schedule_csv = os.path.abspath(self.schedule_csv)
            validate_order_csv(self.schedule_csv, self.pp_size, self.n_microbatches, self.stages_per_rank,
                               self.inference, v_shaped=self.info.v_shaped)

    @property
    def info(self) -> ScheduleInfo:
        return SCHEDULES[self.schedule]

    @property
    def world_size(self) -> int:
        """Ranks in the job: pp_size x dp_size x tp_size."""
        return self.pp_size * self.dp_size * self.tp_size

    @property
    def composed(self) -> bool:
        """Pipelining composed with data or tensor parallelism (labkit.parallel)."""
        return self.dp_size > 1 or self.tp_size > 1 or self.fsdp

    @property
    def n_stages(self) -> int:
        return self.pp_size * (self.stages_per_rank or 1)

    @property
    def model(self) -> ModelPreset:
        return PRESETS[self.preset]

    def stages_of_rank(self, rank: int) -> list[int]:
        """Stage indices that live on `rank` (loop placement, or V placement for V-shaped schedules)."""
        return stage_placement(self.pp_size, self.stages_per_rank or 1, self.info.v_shaped)[rank]

    @property
    def auto_split(self) -> bool:
        """`--split-points auto`: the job measures each block and balances the stages (labkit.models.balance)."""
        return self.split_points == ["auto"]

    def layer_bounds(self) -> list[int]:
        """Layer index where each stage starts, plus n_layers (from split_points, or even)."""
        n_layers = self.model.n_layers
        if self.split_points is None:
            return layer_bounds(n_layers, self.n_stages)
        if "auto" in self.split_points:
            raise ConfigError(f"split_points 'auto' stands alone (--split-points auto), got {self.split_points}; the "
                              f"job chooses the points from measured block costs.")
        valid = [f"layers.{i}" for i in range(1, n_layers)]
        points = self._kit_names()
        if len(points) != self.n_stages - 1:
            raise ConfigError(
                f"{self.n_stages} stages need {self.n_stages - 1} split points (where stages 1..{self.n_stages - 1} "
                f"begin), got {len(points)}: {points}. Pass one per stage boundary, "
                f"e.g. {valid[:self.n_stages - 1]}."
            )
        starts = []
        for sp in points:
            if sp not in valid:
                raise ConfigError(
                    f"Split point {sp!r} names no module where a stage can begin. The model's decoder layers are "
                    f"layers.0 .. layers.{n_layers - 1}; a stage can begin at one of {valid[0]} .. {valid[-1]}."
                )
            starts.append(int(sp.split(".")[1]))
        if starts != sorted(set(starts)):
            raise ConfigError(f"Split points must be distinct and in model order, got {points}.")
        return [0, *starts, n_layers]

    def _kit_names(self) -> list[str]:
        """split_points with a transformers model's own module names (transformer.h.3) as layers.3."""
        prefix = BLOCK_PREFIXES.get(self.model_name)
        return [f"layers.{sp.rsplit('.', 1)[1]}" if prefix and sp.startswith(prefix + ".") else sp
                for sp in self.split_points]

    def accumulated(self) -> "RunConfig":
        """This run with G (--accumulate) batches in one: the data of one whole update."""
        return RunConfig.from_dict({**self.to_dict(), "batch_size": self.batch_size * self.accumulate, "accumulate": 1})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"Unknown config keys {sorted(unknown)}; known keys: {sorted(names)}.")
        return cls(**d)

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "RunConfig":
        """The config a launch wrote into a run directory's config.json (or that file's path)."""
        return cls.from_dict(read_config_json(path))


def read_config_json(path: str | os.PathLike) -> dict:
    """A run directory's config.json (or that file), as the launcher wrote it for the job to read."""
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(p) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"No config at {p}: the kit's jobs read their config from the run directory's "
                          f"config.json, which `labkit run` writes. Launch through `labkit run`, or pass "
                          f"--config PATH.") from None


def read_order_csv(path: str | os.PathLike) -> dict[int, list[str]]:
    """{rank: actions} of a compute-only order CSV (torch's format: one row per rank)."""
    import csv

    with open(path, newline="") as f:
        return {r: [c.strip() for c in row if c.strip()] for r, row in enumerate(csv.reader(f))}


def validate_order_csv(path: str, pp_size: int, n_microbatches: int, stages_per_rank: int | None,
                       inference: bool = False, v_shaped: bool = False) -> None:
    """An order --schedule-csv can run: one row per rank, stage r on rank r (or, with a V-shaped
    --schedule and --stages-per-rank 2, stages r and 2P-1-r), every dependency kept
    (labkit.schedules.orders.check_order), the run's microbatch count, and an order that can finish: one
    that deadlocks is refused here, before the first step, with its wait cycle (labkit.schedules.deadlock)."""
    from ..schedules.deadlock import find_deadlock
    from ..schedules.orders import check_order, parse_action

    if not os.path.isfile(path):
        raise ConfigError(f"--schedule-csv {path}: no such file. Write one with `labkit search ... --csv {path}`.")
    spr = stages_per_rank or 1
    if (spr != 1 and not (spr == 2 and v_shaped)) or inference:
        raise ConfigError("--schedule-csv runs one stage per rank with a backward (--schedule 1F1B), or two in V "
                          "placement (--schedule ZBVZeroBubble --stages-per-rank 2, whose placement it borrows), "
                          "without --inference.")
    rows = read_order_csv(path)
    if len(rows) != pp_size:
        raise ConfigError(f"--schedule-csv {path} has {len(rows)} rows but the run has {pp_size} ranks: pass "
                          f"--nproc {len(rows)}, or search for {pp_size} ranks (labkit search --pp-size {pp_size}).")
    try:
        order = {r: [parse_action(a, f"rank {r}, position {i}") for i, a in enumerate(acts)]
                 for r, acts in rows.items()}
    except ValueError as e:
        raise ConfigError(f"--schedule-csv {path}: {e}") from None
    places = stage_placement(pp_size, spr, v_shaped)
    wrong = sorted({(r, st) for r, acts in order.items() for _, st, _ in acts if st not in places[r]})
    if wrong:
        where = ("rank r must run stage r (one stage per rank)" if spr == 1
                 else "rank r must run stages r and 2P-1-r (V)")
        raise ConfigError(f"--schedule-csv {path}: {where}, but "
                          f"{', '.join(f'rank {r} has stage {st}' for r, st in wrong[:3])}.")
    m = 1 + max((mb for acts in order.values() for _, _, mb in acts), default=-1)
    if m != n_microbatches:
        raise ConfigError(f"--schedule-csv {path} schedules {m} microbatches but the run cuts the batch into "
                          f"{n_microbatches}: pass --microbatches {m}.")
    problems = check_order(order, pp_size * spr, n_microbatches)
    if problems:
        raise ConfigError(f"--schedule-csv {path} cannot run:\n- " + "\n- ".join(problems))
    deadlock = find_deadlock(order, pp_size * spr)
    if deadlock is not None:  # torch's own checks pass such an order: its job would hang at its first step
        raise ConfigError(f"--schedule-csv {path} cannot run: {deadlock.text()}")


def validate_torch(torch_version: str) -> None:
    """A torch older than the kit supports is refused before anything starts (`versions.SUPPORTED`)."""
    from ..versions import SUPPORTED, parse, support_problem

    try:
        too_old = parse(torch_version) < SUPPORTED[0]
    except ValueError:
        return
    if too_old:
        raise ConfigError(support_problem(torch_version))


def field_docs(cls) -> dict[str, str]:
    """{field: its docstring} of a dataclass (the string right under each field), read from the source:
    the command line's help comes from here, so a field is documented once."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
