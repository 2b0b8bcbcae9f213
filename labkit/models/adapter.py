"""One interface over every model the reference job can pipeline (`RunConfig.model_name`).

The job asks an adapter for: the unsplit model (seeded, identical on every rank), the batch (token
ids, targets, and the kwargs every stage needs), the loss, this rank's `PipelineStage`s, the kwargs
this rank passes to `schedule.step`, the schedule (with the kwargs' chunk specs), and what to do
after the backward (tied weights). `tutorial` keeps `labkit.models.tutorial` / `labkit.worker.stages` as they are.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config.run import RunConfig


class TutorialAdapter:
    """The tutorial Transformer (labkit.models.tutorial, labkit.worker.stages): no kwargs, no tied weights."""

    tied_aliases: dict = {}
    tied_copies: frozenset = frozenset()
    renamed: dict = {}

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def build_full(self) -> nn.Module:
        from .tutorial import build_model
        return build_model(self.cfg)

    def batch(self, device):
        from .tutorial import make_batch
        x, y = make_batch(self.cfg, device)
        return x, y, {}

    @property
    def loss_fn(self):
        from .tutorial import tokenwise_loss_fn
        return tokenwise_loss_fn

    def build_stages(self, full, rank, device, bounds=None, group=None):
        from ..worker.stages import build_stages
        return build_stages(self.cfg, full, rank, device, group)

    def step_inputs(self, stages, x, kwargs):
        """(args, kwargs) this rank passes to `schedule.step`: the tokens on the first stage."""
        return ((x,) if any(s.is_first for s in stages) else ()), {}

    def schedule(self, stages, loss_fn, **kwargs):
        from ..worker.stages import build_schedule
        return build_schedule(self.cfg, stages, loss_fn, **kwargs)

    def after_backward(self, stages) -> None:
        pass


class HFAdapter:
    """A transformers model (labkit.models.hf): attention_mask and position_ids as kwargs cut along the
    batch like the tokens; tied weights summed across the stages that hold a copy."""

    KWARGS = ("attention_mask", "position_ids")

    def __init__(self, cfg: RunConfig):
        from . import hf, tied

        hf.require_transformers()
        self.cfg = cfg
        self.tied = tied.TiedWeights()

    @property
    def tied_aliases(self) -> dict:
        return self.tied.aliases

    @property
    def tied_copies(self) -> frozenset:
        """Every copy but the first of each tied parameter, (stage, name): skipped by a gradient norm."""
        return self.tied.extra_copies

    @property
    def renamed(self) -> dict:
        return self.tied.renamed

    def build_full(self) -> nn.Module:
        from . import hf
        return hf.build_hf(self.cfg.model_name, self.cfg.model, seed=self.cfg.seed)

    def batch(self, device):
        from . import hf
        return hf.make_batch(self.cfg.model_name, self.cfg.model, self.cfg.batch_size, self.cfg.seed, device)

    @property
    def loss_fn(self):
        from . import hf
        return hf.loss_fn

    def build_stages(self, full, rank, device, bounds=None, group=None, par=None):
        """This rank's PipelineStages and how they were built. `rank`: its pipeline position; `group`:
        its pipeline's process group and `par` (labkit.parallel.compose.Parallel) when the job holds
        several pipelines (--dp-size / --tp-size): each pipeline gets its own tied-weight groups.
        Collective: every rank calls it (the tied weights' process groups are made with
        `dist.new_group`, which every rank must enter, for every pipeline, in the same order)."""
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage

        from ..versions import apply_workarounds
        from . import hf, tied

        apply_workarounds()  # a rank's warm-up send to itself (torch < 2.15, labkit.versions)
        cfg = self.cfg
        bounds = bounds or cfg.layer_bounds()
        n = cfg.n_stages
        local = cfg.stages_of_rank(rank)
        rank_of = {s: r for r in range(cfg.pp_size) for s in cfg.stages_of_rank(r)}
        new_group = dist.new_group if dist.is_initialized() else (lambda ranks: None)
        if cfg.split == "manual":
            meta = hf.build_hf(cfg.model_name, cfg.model, device="meta")
            tied_names = {n for g in tied.tied_groups(meta) for n in g}

            def names(s):  # a stage holding a tied weight twice holds ONE tensor, under its first name
                paths = hf.stage_paths(meta, s, bounds)
                return [nm for nm, _ in meta.named_parameters(remove_duplicate=False)
                        if hf._owned(nm, paths) and (nm not in tied_names or _first_owned(meta, nm, paths))]

            if par is None:
                self.tied = tied.find_tied(meta, bounds, names, rank_of.get, new_group)
            else:  # one set of tied groups per pipeline (every rank creates them all); keep our pipeline's
                for dp in range(par.dp_size):
                    for tp in range(par.tp_size):
                        tw = tied.find_tied(meta, bounds, names, lambda s: par.global_rank(rank_of[s], dp, tp),
                                            new_group)
                        if (dp, tp) == (par.dp_rank, par.tp_rank):
                            self.tied = tw
            stages = [PipelineStage(hf.manual_stage(cfg.model_name, cfg.model, full, s, bounds, device), s, n, device,
                                    group=group) for s in local]
            how = "manual: built on meta, own modules kept and filled, PipelineStage"
        else:
            x, _, kw = self.batch("cpu")
            mb = cfg.batch_size // cfg.n_microbatches
            pipe = hf.trace_pipe(full, bounds, x[:mb].to(device), {k: v[:mb].to(device) for k, v in kw.items()})
            dropped = {s: hf.drop_unused_parameters(pipe.get_stage_module(s)) for s in range(n)}
            self.tied = tied.find_tied(full, bounds,
                                     lambda s: [nm for nm, _ in pipe.get_stage_module(s).named_parameters()],
                                     rank_of.get, new_group)
            stages = [pipe.build_stage(s, device) for s in local]
            how = "tracer: pipeline(), pipe.build_stage"
            self.first_inputs = hf.first_stage_inputs(pipe)
            if any(dropped.values()):
                how += f"; unused tied copies dropped: {sorted({d for v in dropped.values() for d in v})}"
        if self.tied.groups:
            how += (f"; tied weights {self.tied.canonical} summed over ranks {self.tied.ranks}")
        return stages, how

    def step_inputs(self, stages, x, kwargs):
        """(args, kwargs) this rank passes to `schedule.step`. Manual split: the tokens on the first
        stage, and on EVERY stage the masks and position ids as kwargs (each rank passes them, the
        schedule cuts them per microbatch with the chunk specs). Tracer: only the first stage takes
        inputs, all of them positionally in the split graph's order (hf.first_stage_inputs); what
        later stages need (the 4-D mask, rotary cos/sin) travels down the pipeline as activations, stage by
        stage (labkit.models.skips)."""
        first = any(s.is_first for s in stages)
        if self.cfg.split == "manual":
            return ((x,) if first else ()), dict(kwargs)
        if not first:
            return (), {}
        named = {"input_ids": x, **kwargs}
        return tuple(named[n] for n in self.first_inputs), {}

    def schedule(self, stages, loss_fn, **kwargs):  # kwargs: unused (accumulation: tutorial model only)
        from torch.distributed.pipelining.microbatch import TensorChunkSpec

        from ..versions import accepts_kwargs_chunk_spec, schedule_class

        info = self.cfg.info
        cls = schedule_class(info.cls)
        spec = {k: TensorChunkSpec(0) for k in self.KWARGS}  # (batch, seq): cut along the batch, as the tokens
        if self.cfg.split == "tracer":
            spec = None  # positional inputs only; the default cuts every one along dim 0
        if self.cfg.schedule_csv:  # a searched / hand-written order on torch's runtime
            from ..worker.stages import runtime_from_csv

            return runtime_from_csv(stages, self.cfg.n_microbatches, loss_fn, self.cfg.schedule_csv,
                                    kwargs_chunk_spec=spec)
        target = stages if info.multi else stages[0]
        if not accepts_kwargs_chunk_spec(cls):
            # ScheduleLoopedBFS takes no chunk specs; its default cuts every tensor kwarg along dim 0,
            # which is the same cut
            return cls(target, n_microbatches=self.cfg.n_microbatches, loss_fn=loss_fn)
        return cls(target, n_microbatches=self.cfg.n_microbatches, loss_fn=loss_fn, kwargs_chunk_spec=spec)

    def after_backward(self, stages) -> None:
        self.tied.sync(stages)


def _first_owned(model: nn.Module, name: str, paths: list[str]) -> bool:
    from . import hf, tied
    for g in tied.tied_groups(model):
        if name in g:
            return name == next(n for n in g if hf._owned(n, paths))
    return True


def adapter(cfg: RunConfig):
    """The adapter for `cfg.model_name`."""
    return TutorialAdapter(cfg) if cfg.model_name == "tutorial" else HFAdapter(cfg)
