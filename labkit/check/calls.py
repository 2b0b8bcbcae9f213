"""Whether a `check_step` call can compare the step at all, before any of its collectives: each rank
reports what it holds (`_local_report`), every rank reads the same reports (`_verdict`, gathered by
`_agree_comparable` with one `all_gather_object`) and raises the same `CheckStepError` with the fix (a
wrong microbatch count, losses on the wrong rank, a stage held twice or by no rank, parameter names
that are not the unsplit model's or collide across stages).

May import: torch, labkit.check (noise; fits and compiled_floor when a check is refused or compiled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .noise import canonical


class CheckStepError(ValueError):
    """`check_step` was called in a way that cannot compare the step (a wrong microbatch count, losses on
    the wrong rank, stage names that are not the unsplit model's...). Raised on EVERY rank of the
    pipeline with the same message, before the check's collectives: nothing is left waiting."""


def _local_report(full: nn.Module, stages, losses, loss_fn, output, prefix_stage_index, tied, renamed,
                  extra=(), batch=None) -> dict:
    """What this rank knows about the call, for the verdict every rank computes the same way."""
    params = {n: tuple(p.shape) for n, p in full.named_parameters()}
    by_tensor = {id(p): n for n, p in full.named_parameters()}
    claims: dict[int, list[str]] = {}
    misnamed, example, shapes = 0, "", []
    for s in stages:
        mine = claims.setdefault(int(s.stage_index), [])
        for n, p in s.submod.named_parameters():
            name = canonical(f"{s.stage_index}.{n}" if prefix_stage_index else n)
            if name in tied:  # a tied weight's copy stands for a name another stage holds too
                continue
            ref_name = renamed.get(name, name)
            if ref_name not in params:
                misnamed += 1
                if not example:
                    example = repr(name) + (f", which the unsplit model calls {by_tensor[id(p)]!r}"
                                            if id(p) in by_tensor else "")
                continue
            mine.append(ref_name)  # only names the unsplit model has can collide
            if params[ref_name] != tuple(p.shape) and len(shapes) < 3:
                shapes.append(f"stage {s.stage_index}'s {name!r} has shape {list(p.shape)}, the unsplit model's "
                              f"{ref_name!r} {list(params[ref_name])}")
    return {"stages": sorted(claims), "last": any(s.is_last for s in stages),
            "num_stages": max((int(getattr(s, "num_stages", 0) or 0) for s in stages), default=0),
            "chunks": sorted({int(c) for s in stages if (c := getattr(s, "chunks", None)) is not None}),
            "n_losses": len(losses or []), "has_output": output is not None, "n_extra": len(extra),
            "batch": batch, "claims": claims, "misnamed": misnamed, "example": example, "shapes": shapes}


def _verdict(reports: list[dict], ranks: list[int], n_microbatches, loss_fn, group, chunk_dim=0) -> list[str]:
    """Every mistake the reports show, in words that say the fix; the same list on every rank."""
    problems = []
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        problems.append(f"n_microbatches must be a whole number >= 1 (the schedule's n_microbatches), got "
                        f"{n_microbatches!r}.")
        n_microbatches = None
    problems += _batch_problems(reports, n_microbatches, loss_fn, chunk_dim)
    problems += _stage_problems(reports, ranks, group)
    problems += _loss_problems(reports, ranks, n_microbatches, loss_fn)
    problems += _name_problems(reports)
    problems += [f"rank {ranks[r]}: {rep['too_large']}" for r, rep in enumerate(reports) if rep.get("too_large")][:1]
    return list(dict.fromkeys(problems))


def _batch_problems(reports: list[dict], n_microbatches: int | None, loss_fn, chunk_dim: int) -> list[str]:
    """The microbatch count against the schedule's, the batch's shape, the extras."""
    problems = []
    # The microbatch count: the schedule's M (stage.chunks, set by its step) must divide it (several
    # pipelines with group= or steps accumulated give a whole multiple of it).
    stepped = sorted({c for rep in reports for c in rep["chunks"]})
    if n_microbatches is not None and stepped and any(n_microbatches % c for c in stepped):
        problems.append(
            f"wrong microbatch count: the schedule stepped the stages with {' and '.join(map(str, stepped))} "
            f"microbatches, check_step got n_microbatches={n_microbatches}. Pass the n_microbatches the schedule "
            f"was built with ({stepped[0]}; times the number of pipelines with group=, times the steps "
            f"accumulated).")
    batches = {rep["batch"] for rep in reports if rep["batch"] is not None}
    if len(batches) > 1:
        problems.append(f"the ranks passed batches of different shapes ({', '.join(map(str, sorted(batches)))}): "
                        f"pass the same whole batch x, y on every rank.")
    elif batches and n_microbatches is not None:
        shape = next(iter(batches))
        size = shape[chunk_dim] if len(shape) > chunk_dim else 0
        if size < n_microbatches or len(torch.empty(size).chunk(n_microbatches)) != n_microbatches:
            what = "targets y" if loss_fn is not None else "inputs x"
            problems.append(f"the {what} ({size} along dim {chunk_dim}) cannot be cut into {n_microbatches} "
                            f"microbatches: pass the WHOLE batch the step ran on, and the schedule's n_microbatches.")
    if len({rep["n_extra"] for rep in reports}) > 1:
        problems.append("extra= must hold the same number of floats on every rank.")
    return problems


def _stage_problems(reports: list[dict], ranks: list[int], group) -> list[str]:
    """Who holds which stage: every stage once, the last one somewhere."""
    problems = []
    holders: dict[int, list[int]] = {}
    for r, rep in enumerate(reports):
        for i in rep["stages"]:
            holders.setdefault(i, []).append(r)
    twice = {i: rs for i, rs in sorted(holders.items()) if len(rs) > 1}
    for i, rs in twice.items():
        fix = (" These ranks run several pipelines: pass group=the pipeline's process group (the check is a "
               "collective over it)." if group is None else " Check each rank's stage_index (PipelineStage(..., "
               "stage_index, num_stages, ...)) and the group passed to check_step.")
        who = " and ".join(f"rank {ranks[r]}" for r in rs)
        problems.append(f"stage {i} is held by {who}: a stage must be on one rank of the pipeline.{fix}")
    n_stages = max([rep["num_stages"] for rep in reports] + [0])
    missing = [i for i in range(n_stages) if i not in holders]
    if missing and not twice:
        problems.append(f"no rank of the pipeline holds stage{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing))} of {n_stages}: check each rank's stage_index, and pass "
                        f"group=the pipeline's process group when the ranks run several pipelines.")
    lasts = [r for r, rep in enumerate(reports) if rep["last"]]
    if not lasts and not missing:
        problems.append("no rank holds the last stage: check each rank's stage_index and num_stages.")
    return problems


def _loss_problems(reports: list[dict], ranks: list[int], n_microbatches: int | None, loss_fn) -> list[str]:
    """Losses (or the output, forward only): on the last stage, one per microbatch, and nowhere else."""
    problems = []
    where = lambda r: f"rank {ranks[r]}"  # noqa: E731
    for r, rep in enumerate(reports):
        if loss_fn is None:
            if rep["last"] and not rep["has_output"]:
                problems.append(f"{where(r)} holds the last stage but got no output: pass output=the value "
                                f"schedule.step returned there.")
            continue
        if rep["last"] and rep["n_losses"] == 0:
            problems.append(f"{where(r)} holds the last stage but got no losses: pass the `losses` list that "
                            f"schedule.step(target=y, losses=losses) filled on that rank.")
        elif rep["last"] and n_microbatches is not None and rep["n_losses"] != n_microbatches:
            problems.append(f"{where(r)} (the last stage) holds {rep['n_losses']} losses, check_step got "
                            f"n_microbatches={n_microbatches}: one loss per microbatch. Pass the n_microbatches "
                            f"the schedule was built with, and the `losses` list of one step.")
        elif not rep["last"] and rep["n_losses"]:
            problems.append(f"{where(r)} holds no last stage but passed {rep['n_losses']} losses: losses come "
                            f"from the last stage only (schedule.step(target=y, losses=losses) on the rank that "
                            f"holds it). Pass an empty list (or the list its step left empty) on the other ranks.")
    return problems


def _name_problems(reports: list[dict]) -> list[str]:
    """Names: each stage's parameters under the unsplit model's names of its own layers."""
    problems = []
    misnamed = sum(rep["misnamed"] for rep in reports)
    if misnamed:
        example = next((rep["example"] for rep in reports if rep["example"]), "")
        problems.append(
            f"{misnamed} stage parameters have names that the unsplit model does not have"
            f"{', e.g. ' + example if example else ''}. If each stage module is `full[stage_index]` (stages "
            "cut from an nn.Sequential, as in notebooks 04 and 05), pass prefix_stage_index=True; otherwise "
            "pass renamed={name on the stage: name in the unsplit model}.")
    owners: dict[str, list[int]] = {}
    for rep in reports:  # (a stage's own names, twice over, would be one stage: set() below)
        for i, names in rep["claims"].items():
            for name in names:
                owners.setdefault(name, []).append(int(i))
    clash = {name: sorted(set(st)) for name, st in owners.items() if len(set(st)) > 1}
    if clash:
        pairs = sorted({tuple(st) for st in clash.values()})
        names = sorted(clash, key=lambda n: (clash[n], n))
        problems.append(
            f"parameter names collide across stages: {len(clash)} name{' is' if len(clash) == 1 else 's are'} "
            f"claimed by more than one stage "
            f"({'; '.join('stages ' + ' and '.join(map(str, p)) for p in pairs)}), e.g. "
            f"{', '.join(map(repr, names[:3]))}. Each name would be compared with ONE gradient of the unsplit "
            "model, the wrong one for all but one stage. A stage whose children were renumbered 0..k (e.g. "
            "nn.Sequential(full[2], full[3])) takes stage 0's names: keep the unsplit model's names (a slice "
            "full[2:4] keeps '2.', '3.'; a copy with the other stages' layers deleted keeps them all, "
            "notebook 01), use prefix_stage_index=True for stages that are full[stage_index], or pass "
            "renamed={name on the stage: name in the unsplit model}.")
    for rep in reports:
        problems += [f"names that do not line up: {x} (renumbered children?)." for x in rep["shapes"]]
    return problems


@dataclass
class _Call:
    """One `check_step` call: each field is its argument of the same name (device, tied and renamed
    resolved)."""

    full: nn.Module
    stages: list
    x: Any
    y: Any
    losses: list
    n_microbatches: int
    loss_fn: Any
    grads: dict | None
    prefix_stage_index: bool
    output: Any
    extra: Any
    tolerance: float | None
    device: Any
    chunk_dim: int
    group: Any
    kwargs: dict | None
    tied: dict
    renamed: dict
    clip_grad_norm: float | None
    autocast: Any
    values: dict | None = None
    compiled: dict | None = None
    """None: no stage of the pipeline is compiled; else what compiling changed, measured
    (labkit.check.compiled_floor.probes_for_check_step)."""
    inferred: bool = False
    """prefix_stage_index was None and the names decided it (`_agree_comparable`)."""

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)


def _agree_comparable(c: _Call) -> None:
    """Raise `CheckStepError` on EVERY rank, with the same message, when the call cannot be compared:
    every rank's own report gathered with one `all_gather_object`, judged the same way everywhere."""
    batch = c.y if c.loss_fn is not None else c.x
    # prefix_stage_index=None: both ways of naming are reported, and the one under which every name is the
    # unsplit model's (no collision either) is used, the same on every rank; False first where both fit
    # (a rank that passed it keeps its own: ranks may name their stages differently)
    mine = [False, True] if c.prefix_stage_index is None else [bool(c.prefix_stage_index)]
    report = {o: _local_report(c.full, c.stages, c.losses, c.loss_fn, c.output, o, c.tied, c.renamed, c.extra,
                               tuple(batch.shape) if torch.is_tensor(batch) else None) for o in mine}
    from .fits import too_large

    big = too_large(c.full, c.device)  # the same on every naming: said once, on every rank
    from .compiled_floor import is_compiled

    for r in report.values():
        r["too_large"], r["compiled"] = big, any(is_compiled(s.submod) for s in c.stages)
    reports = [None] * dist.get_world_size(c.group)
    dist.all_gather_object(reports, report, group=c.group)
    ranks = [dist.get_global_rank(c.group, r) if c.group is not None else r for r in range(len(reports))]
    options = [False, True] if any(len(r) > 1 for r in reports) else [None]
    verdicts = {o: _verdict([r[o] if o in r else next(iter(r.values())) for r in reports], ranks, c.n_microbatches,
                            c.loss_fn, c.group, c.chunk_dim) for o in options}
    chosen = next((o for o in options if not verdicts[o]), options[0])
    if c.prefix_stage_index is None:
        c.prefix_stage_index, c.inferred = bool(chosen), True
    c.compiled = {} if any(next(iter(r.values()))["compiled"] for r in reports) else None
    problems = verdicts[chosen]
    if problems:
        raise CheckStepError("check_step cannot compare this step (the same on every rank of the pipeline):\n"
                             + "\n".join(f"  - {p}" for p in problems))
