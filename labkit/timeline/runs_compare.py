"""Two runs' numbers held against each other bit for bit: each step's losses and each stage's gradient norm,
as every rank the kit starts records them on its steps' `end_step` lines (`labkit.spans.numbers.step_numbers`).
`compare_numbers(a, b)` says how many steps were compared, the first step in which the runs differ and in
what, and the largest difference, absolute and relative, with its step: `labkit timeline --compare A B
--numbers`. Steps count from 0, as the spans files number them, and are paired in order.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import ConfigError
from ..spans.paths import span_files

Key = tuple[str, int, int]
"""One recorded number of a step: ("loss", microbatch, rank) or ("grad_norm", stage, rank)."""


@dataclass
class Recorded:
    """One run's numbers: `steps` {step: {Key: value}}, every step a rank ended (numbers or none);
    `local`: some gradient norm is of a rank's local shard (FSDP / DTensor)."""
    steps: dict[int, dict[Key, float]] = field(default_factory=dict)
    local: bool = False


def recorded_numbers(path: str | Path) -> Recorded:
    """The losses and gradient norms a run or live-ranks cell directory (or a spans folder) recorded."""
    files = span_files(path)
    if not files:
        raise ConfigError(f"No spans in {path}: the numbers are recorded on each rank's spans/rank<N>.jsonl, by "
                          f"every rank the kit starts (labkit run, labkit launch, live ranks) with spans on.")
    out = Recorded()
    for rank, f in files.items():
        for line in f.read_text().splitlines():
            if '"end_step"' not in line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a rank that died mid-write
            step = out.steps.setdefault(int(row["end_step"]), {})
            for mb, v in enumerate(row.get("losses", ())):
                step[("loss", mb, rank)] = float(v)
            for stage, v in row.get("grad_norms", {}).items():
                step[("grad_norm", int(stage), rank)] = float(v)
            out.local = out.local or bool(row.get("grad_norms_local"))
    return out


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _order(key: Key) -> tuple:
    return key[0] != "loss", key[1], key[2]  # the losses first: what a reader looks at first


def name(key: Key) -> str:
    kind, i, rank = key
    return f"microbatch {i}'s loss (rank {rank})" if kind == "loss" else f"stage {i}'s gradient norm (rank {rank})"


def describe(keys) -> str:
    """Keys in words, grouped: "the losses of microbatches 0, 1 (rank 1) and the gradient norm of stage 0 (rank 0)"."""
    groups: dict[tuple[str, int], list[int]] = {}
    for kind, i, rank in sorted(keys, key=_order):
        groups.setdefault((kind, rank), []).append(i)
    parts = []
    for (kind, rank), ids in sorted(groups.items(), key=lambda g: (g[0][0] != "loss", g[0][1])):
        one = len(ids) == 1
        what, of = (("loss", "microbatch") if one else ("losses", "microbatches")) if kind == "loss" else \
            (("gradient norm", "stage") if one else ("gradient norms", "stages"))
        parts.append(f"the {what} of {of} {', '.join(map(str, ids))} (rank {rank})")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


@dataclass
class Largest:
    """The largest difference of one measure: its size, step, number and the two values."""
    size: float
    step: int
    key: Key
    a: float
    b: float

    @property
    def relative(self) -> float:
        top = max(abs(self.a), abs(self.b))
        return self.size / top if top else 0.0  # 0.0 against -0.0: bits apart, no size

    def text(self, label: str) -> str:
        return (f"{label}: {self.size:.3g} at step {self.step}, {name(self.key)}: {self.a!r} against {self.b!r}"
                f" ({self.relative:.3g} relative).")


@dataclass
class NumbersDiff:
    """Two runs' numbers compared (`compare_numbers`). `steps`: how many were compared (paired in order);
    `extra`: (steps only A recorded, only B); `first`: the first step that differs (None: bitwise equal), with
    `first_keys`, what differs there (a number recorded in one run only differs too); `largest` / `largest_rel`:
    the largest absolute and relative differences over every compared step."""
    a: str
    b: str
    steps: int
    per_step: int
    extra: tuple[int, int] = (0, 0)
    first: int | None = None
    first_keys: tuple[Key, ...] = ()
    first_values: tuple = ()
    largest: Largest | None = None
    largest_rel: Largest | None = None
    differing_steps: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return self.first is None

    def text(self) -> str:
        if self.equal:
            lines = [f"Bitwise equal over {self.steps} steps (0 to {self.steps - 1}): "
                     f"{self.per_step} numbers a step (losses and stages' gradient norms)."]
        else:
            key, a, b = self.first_values
            lines = [f"Compared {self.steps} steps: the runs first differ at step {self.first} "
                     f"({self.first} steps before it bitwise equal; {self.differing_steps} of {self.steps} steps "
                     f"differ), in {describe(self.first_keys)}.",
                     f"At step {self.first}, {name(key)}: {_value(a)} in {self.a}, {_value(b)} in {self.b}."]
            if self.largest is not None:
                lines.append(self.largest.text("Largest difference"))
            r = self.largest_rel
            if r is not None and (self.largest is None or (r.step, r.key) != (self.largest.step, self.largest.key)):
                lines.append(r.text("Largest relative difference"))
        return "\n".join(lines + self.notes)


def _value(x) -> str:
    return "not recorded" if x is None else repr(x)


def compare_numbers(a: str | Path, b: str | Path) -> NumbersDiff:
    """Run (or cell) directories `a` and `b`'s recorded losses and gradient norms, step by step, bit for bit."""
    ra, rb = recorded_numbers(a), recorded_numbers(b)
    for path, r in ((a, ra), (b, rb)):
        if not any(r.steps.values()):
            raise ConfigError(f"{path} recorded no losses and no gradient norms: they are on each step's end_step "
                              f"line of a run the kit started (pass losses=[] to schedule.step for the losses; a "
                              f"stage's gradient norm is recorded where its parameters have gradients).")
    sa, sb = sorted(ra.steps), sorted(rb.steps)
    n = min(len(sa), len(sb))
    diff = NumbersDiff(str(a), str(b), n, max(len(ra.steps[s]) for s in sa[:n]) if n else 0,
                       (len(sa) - n, len(sb) - n))
    for i in range(n):
        xa, xb = ra.steps[sa[i]], rb.steps[sb[i]]
        wrong = sorted((k for k in xa.keys() | xb.keys() if k not in xa or k not in xb or _bits(xa[k]) != _bits(xb[k])),
                       key=_order)
        if not wrong:
            continue
        diff.differing_steps += 1
        if diff.first is None:
            diff.first, diff.first_keys = i, tuple(wrong)
            diff.first_values = (wrong[0], xa.get(wrong[0]), xb.get(wrong[0]))
        for k in wrong:
            if k not in xa or k not in xb:
                continue
            size = abs(xa[k] - xb[k])
            if math.isnan(size):
                continue
            here = Largest(size, i, k, xa[k], xb[k])
            if diff.largest is None or size > diff.largest.size:
                diff.largest = here
            if diff.largest_rel is None or here.relative > diff.largest_rel.relative:
                diff.largest_rel = here
    for path, extra in zip((a, b), diff.extra):
        if extra:
            diff.notes.append(f"{path} recorded {extra} more step{'s' if extra > 1 else ''}, not compared.")
    if not any(k[0] == "loss" for r in (ra, rb) for s in r.steps.values() for k in s):
        diff.notes.append("No losses were recorded: pass losses=[] to schedule.step on the last stage's rank to "
                          "compare them too.")
    if ra.local or rb.local:
        diff.notes.append("Gradient norms under FSDP / DTensor are each rank's local shard's.")
    return diff
