"""Step time against the number of microbatches, for a fixed batch: a cost per action fitted from the
spans of real steps, and the ideal step it gives.

With the batch fixed, a microbatch holds B/m samples, so each action's span is (about) a share of the
whole batch's work plus a fixed part: `duration(m) = a / m + c` (a: one stage's work on the whole
batch; c: what an action costs whatever its size, the Python around the kernels, a kernel too small
to fill the machine). Between two actions a rank also spends time that no wait explains (the
runtime's Python, posting sends, the instrument, a core taken by another process): `gap` per action.
`fit_microbatch_costs` fits a and c per kind by least squares on the per-m medians, `MicrobatchFit.cost`
turns them into the `Cost` of each m, and `ideal_step_times` simulates the schedule with them.
Taught in notebook 05 (choosing microbatches).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..core.errors import ConfigError
from ..core.actions import COMPUTE_KINDS
from .cost import Cost
from .simulate import simulate

__all__ = ["MicrobatchFit", "action_durations", "fit_microbatch_costs", "ideal_step_times"]


@dataclass(frozen=True)
class MicrobatchFit:
    """Per kind: `batch` (a, seconds of one stage's work on the whole batch) and `fixed` (c, seconds
    each action costs whatever its size); `gap`: seconds per action between actions that no wait
    explains; `residual`: per kind, the largest relative miss of a/m + c on the medians it was fitted to."""

    batch: dict
    fixed: dict
    gap: float
    residual: dict
    ms: tuple

    def per_action(self, kind: str | None = None) -> float:
        """The fitted cost of one action beyond its share of the batch: c + gap (mean over kinds without `kind`)."""
        kinds = [kind] if kind else list(self.fixed)
        return sum(self.fixed[k] for k in kinds) / len(kinds) + self.gap

    def cost(self, m: int, per_action: bool = True) -> Cost:
        """The `Cost` of a step with m microbatches: a/m (+ c + gap with `per_action`) per kind."""
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"m must be a whole number of microbatches >= 1, got {m!r}.")
        d = {k: self.batch[k] / m + (self.fixed[k] + self.gap if per_action else 0.0) for k in self.batch}
        if "I" in d and "W" in d:  # a split backward: B is I + W (a B measured beside them is not used)
            return Cost(F=d.get("F", 0.0), I=d["I"], W=d["W"], unit="s")
        return Cost(**{k: v for k, v in d.items() if k in ("F", "B", "I", "W")}, unit="s")

    def text(self) -> str:
        """One line of the fit. A kind whose batch share is 0 did not get faster with more microbatches
        (the least-squares slope was negative and a >= 0 holds it at 0): said in words, not as 0.00 ms."""
        ms = lambda v: f"{1000 * v:.2f} ms"  # noqa: E731
        parts = [f"{k}: {ms(self.batch[k])} for the whole batch, + {ms(self.fixed[k])} per action" if self.batch[k] > 0
                 else (f"{k}: no share of the batch found (its actions did not get shorter as m grew: on a busy "
                       f"machine their waits for a core can outweigh their work), {ms(self.fixed[k])} per action")
                 for k in self.batch]
        return (f"fitted on m = {', '.join(map(str, self.ms))}: " + "; ".join(parts)
                + f"; between actions {ms(self.gap)} per action (no wait); per-action cost "
                + ", ".join(f"{k} {ms(self.per_action(k))}" for k in self.batch))


def action_durations(timelines) -> dict[str, list[float]]:
    """{kind: every compute action's duration} over one or several timelines (steps of one m)."""
    out: dict[str, list[float]] = {}
    for tl in (timelines if isinstance(timelines, (list, tuple)) else [timelines]):
        for a in tl.compute():
            out.setdefault(a.kind, []).append(a.duration)
    return {k: out[k] for k in COMPUTE_KINDS if k in out}


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a x + c with a, c >= 0 (a duration has no negative part). The constrained
    optimum lies on a bound when the free one is outside: a negative slope gives a = 0, c = mean(y);
    a negative intercept gives the line through the origin."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    a = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    a = max(a, 0.0)
    c = my - a * mx
    if c < 0:  # through the origin instead
        a, c = max(sum(x * y for x, y in points) / sum(x * x for x, _ in points), 0.0), 0.0
    return a, c


def fit_microbatch_costs(durations: dict, gaps: dict | None = None) -> MicrobatchFit:
    """durations: {m: {kind: [seconds, ...]}} (`action_durations` of that m's steps); gaps: {m: [seconds
    per action between actions, one per step]}. Fits duration = a/m + c per kind on each m's median
    (medians: a step on a busy machine has outliers), and the gap as the median over every step."""
    ms = tuple(sorted(durations))
    if len(ms) < 2:
        raise ConfigError(f"fit_microbatch_costs needs steps at two or more microbatch counts to tell a "
                          f"batch's share from a fixed cost per action, got m = {list(ms)}: step more m's.")
    kinds = [k for k in COMPUTE_KINDS if all(durations[m].get(k) for m in ms)]
    if not kinds:
        raise ConfigError("no kind of action (F, B, I, W) ran at every m: pass each m's action_durations.")
    batch, fixed, residual = {}, {}, {}
    for k in kinds:
        medians = [(1.0 / m, statistics.median(durations[m][k])) for m in ms]
        a, c = _line(medians)
        batch[k], fixed[k] = a, c
        residual[k] = max(abs((a * x + c) / y - 1) for x, y in medians if y > 0)
    all_gaps = [g for m in ms for g in (gaps or {}).get(m, [])]
    gap = statistics.median(all_gaps) if all_gaps else 0.0
    return MicrobatchFit(batch, fixed, max(gap, 0.0), residual, ms)


def ideal_step_times(schedule: str, pp_size: int, ms, fit: MicrobatchFit, stages_per_rank: int | None = None,
                     per_action: bool = True) -> dict[int, dict]:
    """{m: metrics of the ideal step} with the fitted costs (only the batch's shares without `per_action`)."""
    return {m: simulate(schedule, pp_size, m, stages_per_rank, fit.cost(m, per_action)).metrics() for m in ms}
