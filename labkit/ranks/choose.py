"""Choosing a schedule and a number of microbatches under an activation cap, measured on live ranks.

    table = measure_choices(pool, "build", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"], [8, 16, 32],
                            cap_bytes=96 * 1024, batch=("xb", "yb"), loss_fn="mse")
    print(table.text())                  # schedule, m, step time, peak activation bytes, fits, check
    table.choice                         # the fastest candidate that fits the cap and passed its check
    plot_choice(ax, table)               # step time against peak memory, the cap, the choice marked

Owns one question of notebook 05 (section 6, "Choosing schedule and m under a memory cap"): which
schedule and m to train with, answered by running each candidate on the learner's own model. For
each (schedule, m) the pool's ranks call the learner's `build(schedule, m)` (a function in the ranks'
namespace returning `(full, stages, schedule_object)`: the unsplit model, this rank's PipelineStages
cut from it, the schedule built on them), run one warm-up step (imports, buffers, first-call costs),
then one measured step in a cell of its own, with a FRESH `labkit.worker.memory.SavedTensorTracker`
on the stages, and check that step against the unsplit model (`labkit.check.reference.check_step`,
its noise verdict). The step time is that cell's makespan from its spans (`pool.timeline(cell)`:
both ends of every action, measured in the ranks; it includes the tracker's hooks, a few
microseconds per saved tensor). The peak is the most activation bytes one rank's stages held at
once (a rank with two stages holds both), the largest over the ranks: the rank that must fit.

Pure logic first: `Candidate`, `ChoiceTable` (`choose`, `text`) and `plot_choice` need no ranks and
are tested without them; `measure_choices` is the part that runs on the pool, and `rank_prepare`,
`rank_measured_step`, `rank_check` are what its cells call on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import ConfigError
from ..worker.memory import rank_peak  # imports no torch

CHOICE_NS = "__labkit_choice__"  # the ranks' namespace entry that holds the candidate being measured


@dataclass(frozen=True)
class Candidate:
    """One measured (schedule, m): a row of the table."""

    schedule: str
    """The schedule's name, as in `labkit.schedules.table.SCHEDULES`."""
    n_microbatches: int
    """m, the microbatches the batch was cut into."""
    step_s: float
    """The measured step's makespan, seconds (from its spans)."""
    peak_bytes: int
    """The most activation bytes one rank held at once in the measured step, the largest over ranks."""
    check_ok: bool
    """The measured step matched the unsplit model (check_step's noise verdict)."""
    fits: bool = True
    """peak_bytes <= the table's cap."""
    peak_per_rank: tuple[int, ...] = ()
    """The same peak, rank by rank."""
    failure: str = ""
    """The check's failure, first line, when check_ok is False."""

    def __post_init__(self):
        if self.step_s < 0 or self.peak_bytes < 0:
            raise ConfigError(f"A candidate's step time and peak are measured quantities, >= 0; got "
                              f"step_s={self.step_s!r}, peak_bytes={self.peak_bytes!r} for {self.schedule} "
                              f"m={self.n_microbatches}.")


@dataclass
class ChoiceTable:
    """Candidates measured against one activation cap; `choice` is the fastest that fits and passed."""

    rows: list[Candidate]
    cap_bytes: int
    """The activation cap, bytes per rank."""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.cap_bytes, bool) or not isinstance(self.cap_bytes, int) or self.cap_bytes <= 0:
            raise ConfigError(f"cap_bytes is the activation memory one rank may hold, a whole number of bytes > 0; "
                              f"got {self.cap_bytes!r} (e.g. 96 * 1024 for 96 KiB).")
        self.rows = [Candidate(**{**r.__dict__, "fits": r.peak_bytes <= self.cap_bytes}) for r in self.rows]

    @property
    def choice(self) -> Candidate | None:
        return choose(self.rows, self.cap_bytes)

    def text(self) -> str:
        """The table in words, one row per candidate, the choice marked with `<-`."""
        best = self.choice
        lines = [f"cap {self.cap_bytes / 1024:.0f} KiB of activations per rank",
                 f"{'schedule':22s} {'m':>3s} {'step ms':>9s} {'peak KiB':>9s}  fits  check"]
        for r in self.rows:
            lines.append(f"{r.schedule:22s} {r.n_microbatches:3d} {1000 * r.step_s:9.1f} {r.peak_bytes / 1024:9.1f}  "
                         f"{'yes ' if r.fits else 'no  '}  {'ok' if r.check_ok else 'FAILED'}"
                         + ("   <- choice" if r is best else ""))
        if best is None:
            lines.append("no candidate fits the cap and passes its check: raise the cap, or try more microbatches "
                         "(the 1F1B family holds fewer samples per microbatch in flight as m grows).")
        return "\n".join(lines + self.notes)

    def __len__(self) -> int:
        return len(self.rows)


def choose(rows, cap_bytes: int) -> Candidate | None:
    """The fastest candidate whose peak fits `cap_bytes` and whose step matched the unsplit model; None
    when none does. Ties go to the one listed first."""
    ok = [r for r in rows if r.check_ok and r.peak_bytes <= cap_bytes]
    return min(ok, key=lambda r: r.step_s) if ok else None


def plot_choice(ax, table: ChoiceTable, cap_bytes: int | None = None):
    """Step time (ms) against peak activation memory (KiB) of every candidate on `ax`: one marker per
    schedule, each point labelled with its m, a failed check drawn as an x, the cap as a vertical
    line (the region past it shaded), the choice circled. Returns the artists drawn."""
    cap = table.cap_bytes if cap_bytes is None else cap_bytes
    markers = "osD^v<>P*"
    names = list(dict.fromkeys(r.schedule for r in table.rows))
    artists = []
    for i, name in enumerate(names):
        rows = [r for r in table.rows if r.schedule == name]
        good = [r for r in rows if r.check_ok]
        artists.append(ax.scatter([r.peak_bytes / 1024 for r in good], [1000 * r.step_s for r in good],
                                  marker=markers[i % len(markers)], label=name, zorder=3))
        bad = [r for r in rows if not r.check_ok]
        if bad:
            artists.append(ax.scatter([r.peak_bytes / 1024 for r in bad], [1000 * r.step_s for r in bad], marker="x",
                                      color="red", zorder=4, label=f"{name}: check failed"))
        for r in rows:
            artists.append(ax.annotate(f"m={r.n_microbatches}", (r.peak_bytes / 1024, 1000 * r.step_s),
                                       textcoords="offset points", xytext=(4, 3), fontsize="x-small"))
    artists.append(ax.axvline(cap / 1024, color="black", linestyle="--", label=f"cap {cap / 1024:.0f} KiB"))
    right = max([cap / 1024] + [r.peak_bytes / 1024 for r in table.rows]) * 1.08
    artists.append(ax.axvspan(cap / 1024, right, color="grey", alpha=0.12, zorder=0))
    best = choose(table.rows, cap)
    if best is not None:
        artists.append(ax.scatter([best.peak_bytes / 1024], [1000 * best.step_s], s=260, facecolors="none",
                                  edgecolors="black", linewidths=1.5, zorder=5,
                                  label=f"choice: {best.schedule}, m={best.n_microbatches}"))
    ax.set_xlim(0, right)
    ax.set_ylim(bottom=0)
    ax.set(xlabel="peak activation memory of a rank (KiB, measured)", ylabel="step time (ms, measured)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")
    return artists


# ---- on the pool


def measure_choices(pool, build: str, schedules, microbatches, cap_bytes: int, *, batch=("x", "y"),
                    loss_fn: str = "mse", prefix_stage_index: bool = False, timeout: float | None = None,
                    stages_per_rank: dict | None = None) -> ChoiceTable:
    """Run every (schedule, m) on `pool` and return the measured `ChoiceTable`.

    build: the name of a function in the ranks' namespace, `build(schedule_name, m) -> (full, stages,
    schedule)`: a fresh unsplit model, this rank's PipelineStages cut from it, and the schedule object
    built on them with `n_microbatches=m` (fresh weights each call: a step's gradients must not carry
    over). batch: the names of the whole batch and its targets in the ranks' namespace, the same on
    every rank; loss_fn: the name of the loss the schedule uses; prefix_stage_index: as for check_step
    (True when each stage module is `full[stage_index]`, False when it keeps the unsplit names).
    stages_per_rank: {schedule: stages per rank} when `build` does not use the default (1 for GPipe and
    1F1B, 2 for the multi-stage schedules); it only serves to refuse an m the schedule cannot run
    before anything runs. Every candidate runs three cells: build and warm up, the measured step, the
    check. A candidate whose check fails stays in the table (check_ok False) and is never chosen.
    """
    from ..schedules.table import schedule_info, validate_microbatches, validate_schedule

    names = [schedule_info(s).name for s in schedules]
    ms = list(microbatches)
    if not names or not ms:
        raise ConfigError("measure_choices needs at least one schedule and one microbatch count, e.g. "
                          "schedules=['1F1B', 'ZBVZeroBubble'], microbatches=[8, 16].")
    for name in names:
        info = schedule_info(name)
        spr = validate_schedule(info, pool.nproc, (stages_per_rank or {}).get(name))
        for m in ms:
            validate_microbatches(info, pool.nproc, pool.nproc * spr, m)
    ChoiceTable([], cap_bytes)  # the cap's own validation, before anything runs
    x, y = batch
    mod = "__import__('labkit.ranks.choose', fromlist=['choose'])"
    rows = []
    for name in names:
        for m in ms:
            pool.exec(f"{mod}.rank_prepare(globals(), {build}, {x}, {y}, {name!r}, {m})", timeout=timeout)
            pool.exec(f"{mod}.rank_measured_step(globals())", timeout=timeout)
            measured = pool.last_cell
            result = pool.exec(f"{mod}.rank_check(globals(), {loss_fn}, {prefix_stage_index!r})", timeout=timeout)
            step_s = pool.timeline(measured).metrics()["makespan"]
            peaks = tuple(result[r]["peak"] for r in sorted(result))
            ok = all(result[r]["ok"] for r in result)
            failure = next((result[r]["failure"] for r in sorted(result) if result[r]["failure"]), "")
            rows.append(Candidate(name, m, step_s, max(peaks), ok, True, peaks, failure))
    pool.exec(f"globals().pop({CHOICE_NS!r}, None) and None")
    return ChoiceTable(rows, cap_bytes)


def rank_prepare(ns: dict, build, x, y, name: str, m: int) -> None:
    """On each rank: build the candidate and run its warm-up step (not measured)."""
    full, stages, schedule = build(name, m)
    stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    ns[CHOICE_NS] = {"full": full, "stages": stages, "schedule": schedule, "x": x, "y": y, "m": m}
    _step(ns[CHOICE_NS])


def rank_measured_step(ns: dict) -> None:
    """On each rank: the measured step, with a fresh activation tracker on the stages."""
    from ..worker.memory import SavedTensorTracker

    c = ns[CHOICE_NS]
    c["tracker"] = SavedTensorTracker(c["stages"])
    c["losses"] = _step(c)


def rank_check(ns: dict, loss_fn, prefix_stage_index: bool) -> dict:
    """On each rank (a collective): the measured step against the unsplit model, and this rank's peak."""
    from ..check.reference import check_step

    c = ns[CHOICE_NS]
    check = check_step(c["full"], c["stages"], c["x"], c["y"], c["losses"], c["m"], loss_fn,
                       prefix_stage_index=prefix_stage_index)
    return {"ok": bool(check.ok), "failure": (check.failure or "").splitlines()[0] if not check.ok else "",
            "peak": rank_peak(c["tracker"].events)}


def _step(c: dict) -> list:
    for st in c["stages"]:
        st.submod.zero_grad(set_to_none=True)  # the check compares this step's gradients alone
    losses: list = []
    args = (c["x"],) if any(st.is_first for st in c["stages"]) else ()
    kwargs = {"target": c["y"], "losses": losses} if any(st.is_last for st in c["stages"]) else {}
    c["schedule"].step(*args, **kwargs)
    return losses
