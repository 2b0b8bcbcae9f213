"""Orders of pipeline actions: how to write one, read one, check one, and what it implies.

An order is `{rank: [(kind, stage, microbatch), ...]}`: each rank's compute actions in the order it
runs them, kinds F, B, I, W. This module owns the rules of a well-formed order (`check_order`),
torch's short form of an action (`"0F1"`: stage 0, forward, microbatch 1, the grammar of torch's
`_Action` strings, read by the log parser's `decode_action`), and what an order implies without
simulating it (`peak_in_flight`). `labkit.theory` simulates orders; `rank_orders` reads one back
from a timeline, so a measured run can be compared with the plan. Taught in notebooks 04
(microbatches in flight), 05 and 08 (write your own schedule); the torchrun script
`notebooks/scripts/custom_schedule.py` reads its CSV with `parse_action`.
"""

from __future__ import annotations

from typing import Mapping

from ..logs import decode_action
from ..core.actions import COMM_KINDS, COMPUTE_KINDS

__all__ = [
    "PlannedAction", "ScheduleError", "parse_action", "describe", "normalize_order", "check_order",
    "rank_orders", "peak_in_flight", "torch_actions", "format_order", "order_csv",
]

PlannedAction = tuple  # (kind, stage, microbatch), e.g. ("F", 0, 3)


class ScheduleError(ValueError):
    """An order of actions that cannot be simulated; the message says what to change."""


def describe(a: PlannedAction) -> str:
    """`("F", 0, 1)` -> `"F(stage 0, mb 1)"`, how messages name an action."""
    return f"{a[0]}(stage {a[1]}, mb {a[2]})"


def parse_action(text: str, where: str = "") -> PlannedAction:
    """torch's short form `"0F1"` (stage, kind, microbatch; case and outer spaces ignored) -> `("F", 0, 1)`.

    Compute actions only: an order lists F, B, I and W, and torch adds the communication itself.
    Raises `ScheduleError` (a ValueError) saying how to write the action; `where` names its place.
    """
    at = f" ({where})" if where else ""
    decoded = decode_action(text.strip().upper()) if isinstance(text, str) else None
    if decoded is not None and decoded[0] in COMPUTE_KINDS:
        return (decoded[0], decoded[1], decoded[2])
    if decoded is not None and (decoded[0] in COMM_KINDS or decoded[4]):  # e.g. copied from order_with_comms.csv
        raise ScheduleError(f"Action {text!r}{at} is not a compute action: an order lists F, B, I and W only "
                            f"(torch adds SEND/RECV itself; the simulator models them with Cost.p2p).")
    raise ScheduleError(f"Cannot read action {text!r}{at}: write torch's short form <stage><kind><microbatch> "
                        f"like '0F1' (stage 0, forward, microbatch 1) with kind F, B, I or W, or a tuple "
                        f"(kind, stage, microbatch) like ('F', 0, 1).")


def _plain(item) -> bool:
    """Already a (kind, stage, microbatch) tuple as `_normalize_action` returns one: the search builds
    hundreds of thousands of these, and checking them this way costs a quarter of normalising them."""
    return (type(item) is tuple and len(item) == 3 and item[0] in COMPUTE_KINDS
            and type(item[1]) is int and type(item[2]) is int and item[1] >= 0 and item[2] >= 0)


def _normalize_action(item, where: str) -> PlannedAction:
    """Accept ("F", 0, 1), torch-style "0F1", or a torch `_Action`."""
    if isinstance(item, str):
        return parse_action(item, where)
    if hasattr(item, "computation_type") and hasattr(item, "stage_index"):
        kind = getattr(item.computation_type, "value", str(item.computation_type))
        item = (kind, item.stage_index, item.microbatch_index)
    if not isinstance(item, (tuple, list)) or len(item) != 3:
        raise ScheduleError(f"Action {item!r} ({where}) must be a (kind, stage, microbatch) tuple like ('F', 0, 1).")
    kind, stage, mb = item
    kind = str(kind).upper()
    if kind not in COMPUTE_KINDS:
        raise ScheduleError(f"Action {item!r} ({where}) has kind {kind!r}; "
                            f"the simulator knows {', '.join(COMPUTE_KINDS)} "
                            f"(communication is modelled by Cost.p2p, not written in the order).")
    for name, value in (("stage", stage), ("microbatch", mb)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ScheduleError(f"Action {item!r} ({where}): {name} must be a whole number >= 0, got {value!r}.")
    return (kind, stage, mb)


def normalize_order(order) -> dict[int, list[PlannedAction]]:
    """`{rank: [(kind, stage, microbatch), ...]}` from a Timeline (its compute actions, as they ran), or
    from `{rank: [...]}` / a list of rows whose actions are tuples, torch's `"0F1"` strings or torch `_Action`s."""
    if hasattr(order, "compute"):
        return rank_orders(order)
    if isinstance(order, Mapping):
        items = order.items()
    elif isinstance(order, (list, tuple)):
        items = enumerate(order)
    else:
        raise ScheduleError("An order is a dict {rank: [(kind, stage, microbatch), ...]}, "
                            f"got {type(order).__name__}.")
    out = {}
    for rank, acts in items:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ScheduleError(f"Ranks are whole numbers >= 0, got {rank!r}.")
        out[rank] = [a if _plain(a) else _normalize_action(a, f"rank {rank}, position {i}") for i, a in enumerate(acts)]
    return dict(sorted(out.items()))


def check_order(order, n_stages: int, n_microbatches: int | None = None) -> list[str]:
    """Problems with an order, as sentences (empty list: it can be simulated). Notebook 08.

    Always checked: stages in range, each stage on one rank only, no action twice, no stage/microbatch
    with both B and I, no W without its I. With `n_microbatches`: every stage runs F for every
    microbatch and, unless the order is forward-only, B (or I and W) for every microbatch.
    """
    order = normalize_order(order)
    problems: list[str] = []
    owner: dict[int, int] = {}
    seen: dict[PlannedAction, int] = {}
    for rank, acts in order.items():
        for pos, a in enumerate(acts):
            kind, stage, mb = a
            if stage >= n_stages:
                problems.append(f"rank {rank} position {pos}: {describe(a)} names stage {stage}, but there are only "
                                f"{n_stages} stages (0..{n_stages - 1}).")
            if stage in owner and owner[stage] != rank:
                problems.append(f"stage {stage} appears on rank {owner[stage]} and rank {rank}: a stage lives on "
                                f"one rank (its weights are there).")
            owner.setdefault(stage, rank)
            if a in seen:
                problems.append(f"{describe(a)} is planned twice (rank {seen[a]} and rank {rank}): "
                                "run each action once.")
            seen.setdefault(a, rank)
            if n_microbatches is not None and mb >= n_microbatches:
                problems.append(f"rank {rank} position {pos}: {describe(a)} names microbatch {mb}, but there are only "
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


# --------------------------------------------------------------------------------------------------
# What an order holds (notebooks 04, 05 and 08)


def rank_orders(timeline) -> dict[int, list[PlannedAction]]:
    """Each rank's compute actions `(kind, stage, microbatch)` in the order they ran (by start, then end).

    Comparable with `labkit.theory.planned_actions` and with an order written by hand (notebook 08):
    a measured run holds exactly the planned actions when both are equal.
    """
    out: dict[int, list[PlannedAction]] = {}
    for a in sorted(timeline.compute(), key=lambda a: (a.rank, a.start, a.end)):
        out.setdefault(a.rank, []).append((a.kind, a.stage, a.microbatch))
    return out


def peak_in_flight(order) -> dict[int, int]:
    """Per stage, the most microbatches whose activations it holds at once (notebook 04: why 1F1B exists).

    A microbatch's activations stay on a stage from its forward (F) until its last backward action
    frees them: B, or W when the backward is split (I computes the input gradient, W still needs the
    saved inputs). `order` is a Timeline or `{rank: [(kind, stage, microbatch), ...]}`; a stage's
    actions run one after another on its rank, so the order alone decides the count.
    """
    return _peak_held(order, lambda rank, stage: stage)


def rank_peak_in_flight(order) -> dict[int, int]:
    """Per rank, the most (stage, microbatch) activations held at once over all of the rank's stages
    (the per-stage counts of `peak_in_flight` may peak at different times). What torch 2.15's
    `analyze_pipeline_activation_liveness` computes, as `labkit.worker.memory.torch_liveness` asks it."""
    return _peak_held(order, lambda rank, stage: rank)


def rank_peak_bytes(order, bytes_per_microbatch: dict[int, int]) -> dict[int, int]:
    """Per rank, the most activation bytes held at once: each (stage, microbatch) in flight weighs
    `bytes_per_microbatch[stage]` (what one microbatch leaves on that stage, `memory.saved_activation_bytes`).
    The plan a measured per-rank curve (`plot.plot_memory(..., by="rank")`) is held to (notebook 04)."""
    return _peak_held(order, lambda rank, stage: rank, weight=lambda stage: bytes_per_microbatch[stage])


_HOLDS = {"F": 1, "B": -1, "W": -1}  # a forward keeps a microbatch's activations; B, or W when split, frees them


def _peak_held(order, group, weight=lambda stage: 1) -> dict[int, int]:
    """The most held at once per `group(rank, stage)`, walking each rank's order: microbatches, or
    what `weight(stage)` says one microbatch of that stage weighs."""
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for rank, acts in normalize_order(order).items():
        for kind, stage, _mb in acts:
            key = group(rank, stage)
            held[key] = held.get(key, 0) + _HOLDS.get(kind, 0) * weight(stage)
            peak[key] = max(peak.get(key, 0), held[key])
    return dict(sorted(peak.items()))


def torch_actions(order) -> dict[int, list[str]]:
    """`{rank: ["0F0", "1I2", ...]}`: an order (or a Timeline) in torch's short form, stage kind microbatch."""
    return {r: [f"{s}{k}{mb}" for k, s, mb in acts] for r, acts in normalize_order(order).items()}


def format_order(order) -> str:
    """One line per rank, as torch writes actions: `rank 0: 0F0 0F1 0B0 ...` (order or Timeline)."""
    return "\n".join(f"rank {r}: " + " ".join(acts) for r, acts in torch_actions(order).items())


def order_csv(order) -> str:
    """The CSV torch's `_PipelineScheduleRuntime._load_csv` reads: one row per rank (notebook 08)."""
    return "".join(",".join(acts) + "\n" for acts in torch_actions(order).values())
