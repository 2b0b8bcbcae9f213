"""The cost model: how long each kind of action takes, the closed-form bubble, and costs fitted to a run.

Perfect hardware where every forward takes `Cost.F`, every backward `Cost.B` (or `Cost.I` +
`Cost.W` when it is split) and a hop between ranks `Cost.p2p`. Taught in notebooks 03 (bubbles),
04 (the closed form) and 06 (measured vs ideal: `fit_cost`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.errors import ConfigError
from ..schedules.orders import ScheduleError
from ..core.actions import COMPUTE_KINDS, Timeline
from ..schedules.table import validate_sizes

_COST_KEYS = {"f": "F", "b": "B", "i": "I", "w": "W", "p2p": "p2p"}
_COST_EXAMPLE = "e.g. --cost F=1,B=2 or --cost F=1,I=1,W=1,p2p=0.1"


@dataclass(frozen=True)
class Cost:
    """Durations of one action of each kind (any unit, the same for all)."""

    F: float = 1.0
    """Forward of one stage on one microbatch."""
    B: float | None = None
    """Full backward (input and weight gradients together): I + W when both are given, else 2.0. A B
    that is not I + W is refused: a full backward is the two halves run one after the other."""
    I: float | None = None  # noqa: E741 (the glossary's name for backward-input)
    """Backward for the inputs only (split-backward schedules); default B - W, or B/2 without W."""
    W: float | None = None
    """Backward for the weights only (split-backward schedules); default B - I, or B/2 without I."""
    p2p: float = 0.0
    """Latency between a stage's output and the dependent action on ANOTHER rank (0 on the same rank)."""
    unit: str = "units"
    """Name of the time unit, for axis labels: "units" for made-up costs, "s" for fitted ones."""

    def __post_init__(self) -> None:
        for name in ("F", "B", "I", "W", "p2p"):
            value = getattr(self, name)
            if value is None and name in ("B", "I", "W"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"Cost {name} must be a finite number (a duration), got {value!r}. "
                                  f"Use {_COST_EXAMPLE}.")
            if value < 0:
                raise ConfigError(f"Cost {name} must be >= 0 (a duration), got {value}. Use {_COST_EXAMPLE}.")
        i, w = self.I, self.W
        if self.B is None:  # frozen: resolve B once, here (I and W stay as given: None means "the rest of B")
            object.__setattr__(self, "B", float(i) + float(w) if i is not None and w is not None else 2.0)
        elif i is not None and w is not None and not math.isclose(self.B, i + w, rel_tol=1e-9, abs_tol=1e-12):
            raise ConfigError(f"Cost B={self.B:g} contradicts I + W = {i:g} + {w:g} = {i + w:g}: a full backward "
                              f"(B) is its input half (I) and its weight half (W). Give B={i + w:g}, or leave B "
                              f"out (I and W imply it), or give B with only one of I and W.")
        for name, half in (("I", i), ("W", w)):
            if half is not None and half > self.B * (1 + 1e-9) + 1e-12:
                other = "W" if name == "I" else "I"
                raise ConfigError(f"Cost {name}={half:g} is longer than the whole backward B={self.B:g}: "
                                  f"{name} is a part of B (B = I + W). Give B >= {half:g}, or give {other} too "
                                  f"(then B = I + W).")

    @property
    def input_grad(self) -> float:
        """Resolved I: the given value, else B - W (W given), else B/2."""
        if self.I is not None:
            return float(self.I)
        return max(float(self.B) - float(self.W), 0.0) if self.W is not None else self.B / 2

    @property
    def weight_grad(self) -> float:
        """Resolved W: the given value, else B - I (I given), else B/2."""
        if self.W is not None:
            return float(self.W)
        return max(float(self.B) - float(self.I), 0.0) if self.I is not None else self.B / 2

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
                raise ConfigError(f"Cost {name}={raw!r} is not a number in --cost {text!r} "
                                  f"({_COST_EXAMPLE}).") from None
            values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class StageCosts:
    """One `Cost` per stage: the ideal of a step whose stages differ, e.g. a measured step fitted stage
    by stage (`fit_stage_costs`: a learner's backwards of 8 ms on stage 0 and 28 ms on stage 3 stay
    so). `simulate` and `simulate_order` take it wherever they take a `Cost`; a stage it lacks costs
    `default`."""

    stages: tuple
    """((stage, Cost), ...), by stage."""
    default: Cost
    """The cost of a stage not in `stages` (the fit over all stages, one cost per kind)."""
    p2p: float = 0.0
    """Latency between a stage's output and the dependent action on ANOTHER rank."""
    unit: str = "s"

    def cost(self, stage: int) -> Cost:
        return dict(self.stages).get(stage, self.default)

    def duration(self, kind: str, stage: int | None = None) -> float:
        """Duration of one action of `kind` on `stage` (the default cost without a stage)."""
        return (self.default if stage is None else self.cost(stage)).duration(kind)

    def spread(self) -> dict[str, tuple[float, float]]:
        """{kind: (shortest, longest) over the stages} for F, B, I, W."""
        out = {}
        for k in COMPUTE_KINDS:
            values = [c.duration(k) for _, c in self.stages]
            if values:
                out[k] = (min(values), max(values))
        return out

    def spread_text(self, kinds=("F", "B", "I", "W")) -> str:
        """e.g. 'per stage: F 9-10 ms, B 8-28 ms' (ms for seconds, else the unit)."""
        scale, unit = (1e3, " ms") if self.unit == "s" else (1.0, f" {self.unit}")
        parts = [f"{k} {lo * scale:.3g}-{hi * scale:.3g}{unit}" if not math.isclose(lo, hi, rel_tol=5e-3)
                 else f"{k} {lo * scale:.3g}{unit}" for k, (lo, hi) in self.spread().items() if k in kinds]
        return "per stage: " + ", ".join(parts)

    def to_dict(self) -> dict:
        """The default (one cost per kind) with each stage's own under "per_stage"."""
        return {**self.default.to_dict(), "p2p": float(self.p2p), "unit": self.unit,
                "per_stage": {str(s): c.to_dict() for s, c in self.stages}}


def closed_form_bubble(pp_size: int, n_microbatches: int, definition: str = "fraction") -> float:
    """GPipe / 1F1B bubble with equal stages and no p2p latency.

    definition "fraction" (default): idle share of wall time, (p-1)/(m+p-1).
    definition "ratio": idle over busy (ideal compute), (p-1)/m.
    """
    validate_sizes(pp_size, n_microbatches)
    if definition == "fraction":
        return (pp_size - 1) / (n_microbatches + pp_size - 1)
    if definition == "ratio":
        return (pp_size - 1) / n_microbatches
    raise ConfigError("definition must be 'fraction' (idle/(ranks x makespan)) or 'ratio' (idle/busy), "
                      f"got {definition!r}.")


def fit_cost(timeline: Timeline, p2p: float = 0.0) -> Cost:
    """Mean F, B, I, W durations of a (measured) timeline, to draw its ideal with `simulate`.

    Kinds that never ran keep their defaults (I, W: B/2); a split-backward run without any B gets
    B = I + W. A run with both (DualPipeV runs some backwards whole, splits others) measures a B
    that is not exactly I + W, which `Cost` refuses: I and W are scaled by one factor so that
    B = I + W and the backward time of the run's own actions (B, I and W together) is kept.
    p2p is not measured here: pass it if you know it. Notebook 06.
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
    if "B" in mean and "I" in mean and "W" in mean:
        n = {k: len(by_kind[k]) for k in ("B", "I", "W")}
        split = n["B"] * (mean["I"] + mean["W"]) + n["I"] * mean["I"] + n["W"] * mean["W"]
        total = n["B"] * mean["B"] + n["I"] * mean["I"] + n["W"] * mean["W"]
        scale = total / split if split > 0 else 1.0
        values["I"], values["W"] = mean["I"] * scale, mean["W"] * scale
        values["B"] = values["I"] + values["W"]
    elif "B" in mean:
        values["B"] = mean["B"]
        if "I" in mean and "W" not in mean:  # a W that never ran: the rest of B
            values["I"] = min(mean["I"], mean["B"])
        elif "W" in mean and "I" not in mean:
            values["W"] = min(mean["W"], mean["B"])
    if timeline.source == "theory":
        values["unit"] = timeline.meta.get("unit", "units")
    else:
        values["unit"] = "s"
    return Cost(**values)


def fit_stage_costs(timeline: Timeline, p2p: float = 0.0) -> StageCosts:
    """`fit_cost` stage by stage: each stage's mean F, B, I, W, so the ideal drawn from them is the
    ideal of THIS step (uneven stages stay uneven), with the fit over all stages as the default.
    `StageCosts.spread()` says how far the stages differ. `%%ranks --timeline`, notebooks 04-06."""
    default = fit_cost(timeline, p2p)
    comp = timeline.compute()
    stages = tuple((s, fit_cost(Timeline([a for a in comp if a.stage == s], timeline.source, timeline.meta), p2p))
                   for s in sorted({a.stage for a in comp}))
    return StageCosts(stages, default, p2p, default.unit)
