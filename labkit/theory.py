"""Ideal pipeline schedules: the order each torch schedule plans, and a cost-model simulator.

This module owns *theory*: what a schedule would do on perfect hardware where every forward takes
`Cost.F`, every backward `Cost.B` (or `Cost.I` + `Cost.W` when it is split) and a hop between ranks
`Cost.p2p`. It produces the same `Timeline` as a measured run (source "theory"), so both can be
drawn and compared with `labkit.plot`. Taught in notebooks 03 (bubbles), 06 (measured vs ideal) and
08 (write your own schedule, `simulate_order`).

- `planned_actions` reads the per-rank order of compute actions from torch itself: the multi-stage
  schedules compute `pipeline_order` in their constructor, which we call with mock stages (no
  process group needed). GPipe and 1F1B run a hand-written loop in torch, mirrored here.
- `simulate` / `simulate_order` replay an order: a rank runs its actions one after another, each as
  soon as the rank is free and its inputs have arrived. An order that can never finish raises
  `ScheduleDeadlock`, naming the stuck ranks and what they wait for.

torch is imported only when a multi-stage schedule is planned, so the rest stays fast.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping

from .config import ConfigError, schedule_info, stage_placement
from .timeline import COMPUTE_KINDS, Action, Timeline

__all__ = [
    "Cost",
    "ScheduleError",
    "ScheduleDeadlock",
    "planned_actions",
    "check_order",
    "simulate",
    "simulate_order",
    "closed_form_bubble",
    "fit_cost",
    "theory_json",
]

PlannedAction = tuple  # (kind, stage, microbatch), e.g. ("F", 0, 3)


class ScheduleError(ValueError):
    """An order of actions that cannot be simulated; the message says what to change."""


class ScheduleDeadlock(ScheduleError):
    """No rank can make progress: every unfinished rank waits for something that never comes.

    `stuck` maps each stuck rank to `(position, action, missing)`: the index of its next action in
    its list, that action as `(kind, stage, microbatch)`, and the actions it still waits for.
    """

    def __init__(self, message: str, stuck: dict[int, tuple[int, PlannedAction, list[PlannedAction]]]):
        super().__init__(message)
        self.stuck = stuck


# --------------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------------

_COST_KEYS = {"f": "F", "b": "B", "i": "I", "w": "W", "p2p": "p2p"}
_COST_EXAMPLE = "e.g. --cost F=1,B=2 or --cost F=1,I=1,W=1,p2p=0.1"


@dataclass(frozen=True)
class Cost:
    """Durations of one action of each kind (any unit, the same for all)."""

    F: float = 1.0
    """Forward of one stage on one microbatch."""
    B: float = 2.0
    """Full backward (input and weight gradients together)."""
    I: float | None = None  # noqa: E741 (the glossary's name for backward-input)
    """Backward for the inputs only (split-backward schedules); default B/2."""
    W: float | None = None
    """Backward for the weights only (split-backward schedules); default B/2."""
    p2p: float = 0.0
    """Latency between a stage's output and the dependent action on ANOTHER rank (0 on the same rank)."""
    unit: str = "units"
    """Name of the time unit, for axis labels: "units" for made-up costs, "s" for fitted ones."""

    def __post_init__(self) -> None:
        for name in ("F", "B", "I", "W", "p2p"):
            value = getattr(self, name)
            if value is None and name in ("I", "W"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"Cost {name} must be a finite number (a duration), got {value!r}. "
                                  f"Use {_COST_EXAMPLE}.")
            if value < 0:
                raise ConfigError(f"Cost {name} must be >= 0 (a duration), got {value}. Use {_COST_EXAMPLE}.")

    @property
    def input_grad(self) -> float:
        """Resolved I: the given value, else B/2."""
        return self.B / 2 if self.I is None else float(self.I)

    @property
    def weight_grad(self) -> float:
        """Resolved W: the given value, else B/2."""
        return self.B / 2 if self.W is None else float(self.W)

    def duration(self, kind: str) -> float:
        """Duration of one action of `kind` (F, B, I or W)."""
        if kind == "F":
            return float(self.F)
        if kind == "B":
            return float(self.B)
        if kind == "I":
            return self.input_grad
        if kind == "W":
            return self.weight_grad
        raise ScheduleError(f"No cost for action kind {kind!r}: the simulator knows {', '.join(COMPUTE_KINDS)}.")

    def to_dict(self) -> dict:
        """Plain dict with I and W resolved (what `Timeline.meta['cost']` holds)."""
        return {"F": float(self.F), "B": float(self.B), "I": self.input_grad, "W": self.weight_grad,
                "p2p": float(self.p2p), "unit": self.unit}

    @classmethod
    def parse(cls, text: str) -> "Cost":
        """Parse the CLI's `--cost` value, e.g. "F=1,B=2" or "F=1,I=1,W=0.5,p2p=0.1" (missing keys keep defaults)."""
        if not isinstance(text, str):
            raise ConfigError(f"--cost must be a string like 'F=1,B=2', got {text!r}.")
        values: dict[str, float] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise ConfigError(f"Cannot read {part!r} in --cost {text!r}: expected KEY=VALUE pairs separated by "
                                  f"commas ({_COST_EXAMPLE}).")
            key, raw = (s.strip() for s in part.split("=", 1))
            name = _COST_KEYS.get(key.lower())
            if name is None:
                raise ConfigError(f"Unknown cost key {key!r} in --cost {text!r}. Known keys: F, B, I, W, p2p "
                                  f"({_COST_EXAMPLE}).")
            if name in values:
                raise ConfigError(f"Cost key {name} is given twice in --cost {text!r}: keep one.")
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(f"Cost {name}={raw!r} is not a number in --cost {text!r} ({_COST_EXAMPLE}).") from None
            values[name] = value
        return cls(**values)


# --------------------------------------------------------------------------------------------------
# What each schedule plans
# --------------------------------------------------------------------------------------------------

def _check_sizes(pp_size, n_microbatches) -> None:
    for name, value, flag in (("pp_size", pp_size, "--nproc"), ("n_microbatches", n_microbatches, "--microbatches")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}. Pass {flag} N with N >= 1.")


def _resolve_stages_per_rank(info, stages_per_rank) -> int:
    if stages_per_rank is None:
        return 2 if info.multi else 1
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ConfigError(f"stages_per_rank must be a whole number >= 1, got {stages_per_rank!r}.")
    if not info.multi and stages_per_rank != 1:
        raise ConfigError(f"{info.name} runs exactly one stage per rank, got stages_per_rank={stages_per_rank}. "
                          f"Drop it, or pick a multi-stage schedule such as Interleaved1F1B.")
    if info.v_shaped and stages_per_rank != 2:
        raise ConfigError(f"{info.name} is V-shaped: each rank holds stages rank and 2*pp_size-1-rank, so it needs "
                          f"exactly stages_per_rank=2 (got {stages_per_rank}).")
    return stages_per_rank


def _gpipe_order(pp_size: int, m: int) -> dict[int, list[PlannedAction]]:
    # ScheduleGPipe._step_microbatches: every forward, then every backward, in microbatch order.
    return {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(pp_size)}


def _1f1b_order(pp_size: int, m: int) -> dict[int, list[PlannedAction]]:
    # Mirrors Schedule1F1B._step_microbatches (torch 2.13), NOT Schedule1F1B.pipeline_order: the
    # latter is only a drawing aid and is off by one on the last rank (it plans F1 first and an F<m>).
    order = {}
    for r in range(pp_size):
        acts: list[PlannedAction] = []
        warmup = min(m, pp_size - r)  # stage 0 runs pp_size forwards before its first backward
        f = b = 0
        for _ in range(warmup):
            acts.append(("F", r, f))
            f += 1
        while True:  # 1B1F: one backward, then one forward, until every forward is done
            acts.append(("B", r, b))
            b += 1
            if f == m:
                break
            acts.append(("F", r, f))
            f += 1
        while b < m:  # cooldown
            acts.append(("B", r, b))
            b += 1
        order[r] = acts
    return order


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        return "(not installed)"


def _torch_order(info, pp_size: int, m: int, stages_per_rank: int) -> dict[int, list[PlannedAction]]:
    """`pipeline_order` of a multi-stage torch schedule, built with mock stages (no process group)."""
    cached = _torch_order_cached(info, pp_size, m, stages_per_rank)
    return {r: list(acts) for r, acts in cached.items()}  # callers may edit their copy


@lru_cache(maxsize=256)  # sweeps (notebook 03, the explorer) ask for the same plans again and again
def _torch_order_cached(info, pp_size: int, m: int, stages_per_rank: int) -> dict[int, tuple[PlannedAction, ...]]:
    try:
        from unittest import mock

        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        schedule_cls = getattr(pipelining, info.cls)
    except (ImportError, AttributeError) as e:
        raise ScheduleError(f"torch {_torch_version()} has no torch.distributed.pipelining.{info.cls} ({e}). "
                            f"The kit needs torch >= 2.8; check `labkit doctor`.") from e

    n_stages = pp_size * stages_per_rank
    stages = []
    # The schedules only read sizes from the stages when planning (torch's own
    # _schedule_visualizer.get_schedule_ops does the same with autospec mocks).
    for s in stage_placement(pp_size, stages_per_rank, info.v_shaped)[0]:
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank = 0
        stage.group_size = pp_size
        stage.num_stages = n_stages
        stage.stage_index = s
        stage.is_first = s == 0
        stage.is_last = s == n_stages - 1
        stage.submod = None
        stages.append(stage)
    try:
        schedule = schedule_cls(stages, m)
    except ValueError as e:  # torch's own rule for this combination: pass it on, it is the lesson
        raise ConfigError(f"torch refuses {info.name} with pp_size={pp_size}, stages_per_rank={stages_per_rank}, "
                          f"n_microbatches={m}: {e}") from e
    except Exception as e:  # a torch version whose constructor needs more than sizes
        raise ScheduleError(
            f"Could not read the planned order of {info.cls} from torch {_torch_version()} with mock stages "
            f"({type(e).__name__}: {e}). This is a kit bug for this torch version: please report it, and use "
            f"`simulate_order` with an order written by hand meanwhile."
        ) from e
    raw = getattr(schedule, "pipeline_order", None)
    if not isinstance(raw, dict) or sorted(raw) != list(range(pp_size)):
        raise ScheduleError(f"{info.cls} in torch {_torch_version()} has no pipeline_order for ranks 0..{pp_size - 1} "
                            f"(got {type(raw).__name__}); please report this kit bug.")
    return {r: tuple(_expand_torch_actions(raw[r])) for r in range(pp_size)}


def _expand_torch_actions(actions: Iterable) -> Iterable[PlannedAction]:
    """torch `_Action`s -> (kind, stage, mb), read by attribute (no private import); None = idle step."""
    for a in actions:
        if a is None:
            continue
        subs = getattr(a, "sub_actions", None)
        if subs:  # OVERLAP_F_B (DualPipeV): the runtime runs its parts one after the other
            yield from _expand_torch_actions(subs)
            continue
        kind = getattr(a.computation_type, "value", str(a.computation_type))
        if kind in COMPUTE_KINDS:
            yield (kind, int(a.stage_index), int(a.microbatch_index))
        # UNSHARD / RESHARD / REDUCE_GRAD / SEND / RECV are not compute: the simulator models p2p as latency


def planned_actions(schedule: str, pp_size: int, n_microbatches: int,
                    stages_per_rank: int | None = None) -> dict[int, list[PlannedAction]]:
    """The per-rank ORDER of compute actions `(kind, stage, microbatch)` that `schedule` plans.

    Multi-stage schedules: read from torch (`Schedule*.pipeline_order`, built with mock stages);
    torch's own errors for invalid sizes come back as `ConfigError`. GPipe and 1F1B: the loop of
    their `_step_microbatches`. 1F1B with fewer microbatches than ranks is refused by torch; the
    order is still defined (as slow as GPipe) and is returned here for the bubble formula.
    """
    info = schedule_info(schedule)
    _check_sizes(pp_size, n_microbatches)
    spr = _resolve_stages_per_rank(info, stages_per_rank)
    if info.name == "GPipe":
        return _gpipe_order(pp_size, n_microbatches)
    if info.name == "1F1B":
        return _1f1b_order(pp_size, n_microbatches)
    order = _torch_order(info, pp_size, n_microbatches, spr)
    expected = stage_placement(pp_size, spr, info.v_shaped)
    for r in range(pp_size):
        seen = sorted({s for _, s, _ in order[r]})
        if seen != sorted(expected[r]):
            raise ScheduleError(f"torch {_torch_version()} places stages {seen} on rank {r} for {info.name}, but "
                                f"labkit.config.stage_placement says {expected[r]}: please report this kit bug.")
    return order


# --------------------------------------------------------------------------------------------------
# Checking and simulating an order
# --------------------------------------------------------------------------------------------------

_ACTION_STR = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


def _fmt(a: PlannedAction) -> str:
    return f"{a[0]}(stage {a[1]}, mb {a[2]})"


def _normalize_action(item, rank: int, pos: int) -> PlannedAction:
    """Accept ("F", 0, 1), torch-style "0F1", or a torch `_Action`."""
    where = f"rank {rank}, position {pos}"
    if isinstance(item, str):
        match = _ACTION_STR.match(item.upper())
        if not match:
            raise ScheduleError(f"Cannot read action {item!r} ({where}): write (kind, stage, microbatch) like "
                                f"('F', 0, 1), or torch's short form '0F1' (stage, kind, microbatch).")
        return (match.group(2), int(match.group(1)), int(match.group(3)))
    if hasattr(item, "computation_type") and hasattr(item, "stage_index"):
        kind = getattr(item.computation_type, "value", str(item.computation_type))
        item = (kind, item.stage_index, item.microbatch_index)
    if not isinstance(item, (tuple, list)) or len(item) != 3:
        raise ScheduleError(f"Action {item!r} ({where}) must be a (kind, stage, microbatch) tuple like ('F', 0, 1).")
    kind, stage, mb = item
    kind = str(kind).upper()
    if kind not in COMPUTE_KINDS:
        raise ScheduleError(f"Action {item!r} ({where}) has kind {kind!r}; the simulator knows {', '.join(COMPUTE_KINDS)} "
                            f"(communication is modelled by Cost.p2p, not written in the order).")
    for name, value in (("stage", stage), ("microbatch", mb)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ScheduleError(f"Action {item!r} ({where}): {name} must be a whole number >= 0, got {value!r}.")
    return (kind, stage, mb)


def _normalize_order(order) -> dict[int, list[PlannedAction]]:
    if isinstance(order, Mapping):
        items = order.items()
    elif isinstance(order, (list, tuple)):
        items = enumerate(order)
    else:
        raise ScheduleError(f"An order is a dict {{rank: [(kind, stage, microbatch), ...]}}, got {type(order).__name__}.")
    out = {}
    for rank, acts in items:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ScheduleError(f"Ranks are whole numbers >= 0, got {rank!r}.")
        out[rank] = [_normalize_action(a, rank, i) for i, a in enumerate(acts)]
    return dict(sorted(out.items()))


def check_order(order, n_stages: int, n_microbatches: int | None = None) -> list[str]:
    """Problems with an order, as sentences (empty list: it can be simulated).

    Always checked: stages in range, each stage on one rank only, no action twice, no stage/microbatch
    with both B and I, no W without its I. With `n_microbatches`: every stage runs F for every
    microbatch and, unless the order is forward-only, B (or I and W) for every microbatch.
    """
    order = _normalize_order(order)
    problems: list[str] = []
    owner: dict[int, int] = {}
    seen: dict[PlannedAction, int] = {}
    for rank, acts in order.items():
        for pos, a in enumerate(acts):
            kind, stage, mb = a
            if stage >= n_stages:
                problems.append(f"rank {rank} position {pos}: {_fmt(a)} names stage {stage}, but there are only "
                                f"{n_stages} stages (0..{n_stages - 1}).")
            if stage in owner and owner[stage] != rank:
                problems.append(f"stage {stage} appears on rank {owner[stage]} and rank {rank}: a stage lives on "
                                f"one rank (its weights are there).")
            owner.setdefault(stage, rank)
            if a in seen:
                problems.append(f"{_fmt(a)} is planned twice (rank {seen[a]} and rank {rank}): run each action once.")
            seen.setdefault(a, rank)
            if n_microbatches is not None and mb >= n_microbatches:
                problems.append(f"rank {rank} position {pos}: {_fmt(a)} names microbatch {mb}, but there are only "
                                f"{n_microbatches} (0..{n_microbatches - 1}).")
    for (kind, stage, mb) in seen:
        if kind == "B" and ("I", stage, mb) in seen:
            problems.append(f"stage {stage} mb {mb} has both B and I: use B (full backward) or I then W, not both.")
        if kind == "W" and ("I", stage, mb) not in seen:
            problems.append(f"W(stage {stage}, mb {mb}) has no I(stage {stage}, mb {mb}): the weight gradient "
                            f"needs the input-gradient step first.")
    if n_microbatches is not None:
        has_backward = any(k != "F" for (k, _, _) in seen)
        for stage in range(n_stages):
            for mb in range(n_microbatches):
                if ("F", stage, mb) not in seen:
                    problems.append(f"F(stage {stage}, mb {mb}) is missing: every stage runs every microbatch forward.")
                if has_backward and ("B", stage, mb) not in seen and ("I", stage, mb) not in seen:
                    problems.append(f"the backward of stage {stage} mb {mb} is missing: plan B, or I and W.")
                if ("I", stage, mb) in seen and ("W", stage, mb) not in seen:
                    problems.append(f"I(stage {stage}, mb {mb}) has no W: the weight gradient would never be computed.")
    return problems


def _dependencies(a: PlannedAction, n_stages: int) -> list[tuple[PlannedAction, ...]]:
    """Groups of alternatives: every group must be done, any member of a group satisfies it."""
    kind, stage, mb = a
    if kind == "F":
        return [(("F", stage - 1, mb),)] if stage > 0 else []
    if kind in ("B", "I"):
        deps = [(("F", stage, mb),)]  # the stage's own saved activations
        if stage < n_stages - 1:  # the gradient of the stage's output, from the next stage
            deps.append((("B", stage + 1, mb), ("I", stage + 1, mb)))
        return deps
    return [(("I", stage, mb),)]  # W


def simulate_order(order, n_stages: int | None = None, n_microbatches: int | None = None,
                   cost: Cost | str = Cost(), *, meta: dict | None = None) -> Timeline:
    """Simulate a hand-written (or planned) order: `{rank: [(kind, stage, microbatch), ...]}`.

    Each rank runs its list in order; an action starts when the rank is free and its inputs are
    there (+ `cost.p2p` when they come from another rank). Raises `ScheduleError` for a malformed
    order (see `check_order`) and `ScheduleDeadlock` when no rank can progress. Notebook 08.
    """
    if isinstance(cost, str):
        cost = Cost.parse(cost)
    norm = _normalize_order(order)
    if n_stages is None:
        n_stages = 1 + max((s for acts in norm.values() for _, s, _ in acts), default=-1)
    problems = check_order(norm, n_stages, n_microbatches)
    if problems:
        raise ScheduleError("This order cannot be simulated:\n- " + "\n- ".join(problems))

    stage_rank = {s: r for r, acts in norm.items() for _, s, _ in acts}
    position = {a: (r, i) for r, acts in norm.items() for i, a in enumerate(acts)}
    pos = {r: 0 for r in norm}
    free = {r: 0.0 for r in norm}
    done: dict[PlannedAction, float] = {}
    actions: list[Action] = []

    def ready_time(a: PlannedAction, rank: int) -> float | None:
        t = 0.0
        for group in _dependencies(a, n_stages):
            ends = [done[d] + (cost.p2p if stage_rank[d[1]] != rank else 0.0) for d in group if d in done]
            if not ends:
                return None
            t = max(t, min(ends))
        return t

    # A rank's order is fixed, so an action's start only depends on its rank's previous action and
    # on its inputs: sweeping until nothing moves gives the event-driven result.
    progress = True
    while progress:
        progress = False
        for r, acts in norm.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                ready = ready_time(a, r)
                if ready is None:
                    break
                start = max(free[r], ready)
                end = start + cost.duration(a[0])
                done[a] = end
                free[r] = end
                actions.append(Action(r, a[1], a[2], a[0], start, end))
                pos[r] += 1
                progress = True

    stuck = {r: pos[r] for r, acts in norm.items() if pos[r] < len(acts)}
    if stuck:
        details: dict[int, tuple[int, PlannedAction, list[PlannedAction]]] = {}
        lines = []
        for r, i in stuck.items():
            a = norm[r][i]
            missing = [g for g in _dependencies(a, n_stages) if not any(d in done for d in g)]
            details[r] = (i, a, [d for g in missing for d in g])
            waits = []
            for group in missing:
                name = " or ".join(_fmt(d) for d in group)
                planned = [d for d in group if d in position]
                if not planned:
                    waits.append(f"{name}, which no rank plans")
                    continue
                pr, pi = position[planned[0]]  # not done, so rank pr is stuck at or before it
                if pi == stuck[pr]:
                    waits.append(f"{name}, rank {pr}'s next action, itself stuck")
                else:
                    who = "this rank" if pr == r else f"rank {pr}"
                    waits.append(f"{name}, which {who} plans later (position {pi}, behind "
                                 f"{_fmt(norm[pr][stuck[pr]])})")
            lines.append(f"rank {r} is stuck at position {i}, {_fmt(a)}: waits for " + "; ".join(waits))
        raise ScheduleDeadlock(
            "Schedule deadlock: no rank can make progress.\n" + "\n".join(lines)
            + "\nReorder the actions so that every input is produced before a rank blocks on it.",
            details,
        )

    info = {"schedule": "custom", "pp_size": len(norm), "n_microbatches": n_microbatches,
            "stages_per_rank": None, "n_stages": n_stages, "cost": cost.to_dict(), "unit": cost.unit}
    info.update(meta or {})
    actions.sort(key=lambda x: (x.start, x.rank))
    return Timeline(actions, source="theory", meta=info)


def simulate(schedule: str, pp_size: int, n_microbatches: int, stages_per_rank: int | None = None,
             cost: Cost | str = Cost()) -> Timeline:
    """The ideal timeline of a torch schedule under `cost` (source "theory"). Notebooks 03 and 06.

    Costs are per action of ONE stage. Cutting the same model into more stages makes each stage
    cheaper: to compare schedules at equal model size, divide F and B by `stages_per_rank`
    (e.g. Interleaved1F1B with 2 stages per rank: `Cost(F=0.5, B=1)` against GPipe's `Cost(F=1, B=2)`).
    """
    info = schedule_info(schedule)
    spr = _resolve_stages_per_rank(info, stages_per_rank)
    order = planned_actions(info.name, pp_size, n_microbatches, spr)
    if isinstance(cost, str):
        cost = Cost.parse(cost)
    meta = {"schedule": info.name, "pp_size": pp_size, "n_microbatches": n_microbatches, "stages_per_rank": spr,
            "planned_by": (f"torch {_torch_version()} {info.cls}.pipeline_order" if info.multi
                           else f"labkit (mirrors {info.cls}._step_microbatches)")}
    if info.name == "1F1B" and n_microbatches < pp_size:
        meta["note"] = (f"torch's Schedule1F1B refuses fewer microbatches ({n_microbatches}) than stages "
                        f"({pp_size}); this ideal is what its loop would do (as slow as GPipe).")
    return simulate_order(order, pp_size * spr, n_microbatches, cost, meta=meta)


# --------------------------------------------------------------------------------------------------
# Formulas, fitting, JSON
# --------------------------------------------------------------------------------------------------

def closed_form_bubble(pp_size: int, n_microbatches: int, definition: str = "fraction") -> float:
    """GPipe / 1F1B bubble with equal stages and no p2p latency.

    definition "fraction" (default): idle share of wall time, (p-1)/(m+p-1).
    definition "ratio": idle over busy (ideal compute), (p-1)/m.
    """
    _check_sizes(pp_size, n_microbatches)
    if definition == "fraction":
        return (pp_size - 1) / (n_microbatches + pp_size - 1)
    if definition == "ratio":
        return (pp_size - 1) / n_microbatches
    raise ConfigError(f"definition must be 'fraction' (idle/(ranks x makespan)) or 'ratio' (idle/busy), got {definition!r}.")


def fit_cost(timeline: Timeline, p2p: float = 0.0) -> Cost:
    """Mean F, B, I, W durations of a (measured) timeline, to draw its ideal with `simulate`.

    Kinds that never ran keep their defaults (I, W: B/2); a split-backward run without any B gets
    B = I + W. p2p is not measured here: pass it if you know it. Notebook 06.
    """
    comp = timeline.compute()
    if not comp:
        raise ScheduleError("This timeline has no compute actions (F, B, I, W) to fit costs from: "
                            "did the run log with TORCH_LOGS=+pp?")
    by_kind: dict[str, list[float]] = {}
    for a in comp:
        by_kind.setdefault(a.kind, []).append(a.duration)
    mean = {k: sum(v) / len(v) for k, v in by_kind.items()}
    values: dict = {"p2p": p2p}
    for k in ("F", "I", "W"):
        if k in mean:
            values[k] = mean[k]
    if "B" in mean:
        values["B"] = mean["B"]
    elif "I" in mean and "W" in mean:
        values["B"] = mean["I"] + mean["W"]
    if timeline.source == "theory":
        values["unit"] = timeline.meta.get("unit", "units")
    else:
        values["unit"] = "s"
    return Cost(**values)


def theory_json(timeline: Timeline) -> dict:
    """What `labkit theory --json` prints: actions, makespan, both bubble definitions, meta."""
    t = timeline.shifted()
    m = t.metrics()
    return {
        "actions": [{"rank": a.rank, "stage": a.stage, "microbatch": a.microbatch, "kind": a.kind,
                     "start": a.start, "end": a.end} for a in t.actions],
        "makespan": m["makespan"],
        "bubble_fraction": m["bubble_fraction"],
        "bubble_ratio": m["bubble_ratio"],
        "meta": dict(t.meta),
    }
