"""What a watched run says (`labkit.watch_run`'s report): each step's loss, each stage's distance from the
re-anchored reference with its floor, the first wrong step, its stage and what went wrong; whether a drift
from a single-device run is float noise (`RunReport.drift`); the run drawn on an `ax` (`plot_run`).

May import: torch, labkit.check (noise)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .noise import NOISE_MULTIPLE


@dataclass
class StepRecord:
    """One step of a watched run, as every rank sees it."""

    step: int
    loss: float | None
    """The mean of the pipeline's microbatch losses."""
    lr: list[float]
    """Each param group's learning rate in effect (the first stage's)."""
    checked: bool = False
    ok: bool | None = None
    """None: not checked (between checks, and held since)."""
    stages: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Each stage's distance from the re-anchored reference: (error, floor) of its worst tensor (gradients
    and update), the ratio err/floor within NOISE_MULTIPLE when the step held."""
    reference_loss: float | None = None
    """The unsplit model's loss from the same weights (checked steps)."""
    loss_err: float | None = None
    """|loss - reference_loss| (checked steps, on the rank of the last stage's losses)."""
    loss_floor: float | None = None
    """The floor of that loss: check_step's figure of the mean of the microbatch losses (R against C and T)."""
    what: str = ""


@dataclass
class Drift:
    """Whether a run's losses drifting from a single-device run's is float noise or a wrong step."""

    noise: bool
    first_step: int | None
    """The first step outside its floor (None: every checked step held)."""
    drift: list[float]
    """|pipeline loss - single-device loss| per step (empty without single-device losses)."""
    text: str
    floors: list[float | None] = field(default_factory=list)
    """Each step's loss floor (check_step's, re-anchored; None where the step was not checked)."""
    beyond: int | None = None
    """The first step whose drift from the single-device run is beyond NOISE_MULTIPLE x its loss floor: where
    the two runs part by more than one step's rounding (float noise compounded, when every step held)."""


@dataclass
class RunReport:
    steps: list[StepRecord] = field(default_factory=list)
    first_wrong_step: int | None = None
    stage: int | None = None
    failure: str | None = None
    every: int = 1

    @property
    def ok(self) -> bool:
        return self.first_wrong_step is None

    def drift(self, single_device_losses: list[float] | None = None) -> Drift:
        """"My losses drift after 50 steps", in one call: float noise (every step held within its floor, each
        re-anchored on the pipeline's own weights, so the gap to a single-device run is rounding compounded) or
        the first step beyond it, with what went wrong there. With the single-device run's losses, each step's
        drift from them is held against that step's loss floor (`beyond`: where the runs part by more than one
        step's rounding; a gap at step 0 says the two runs did not start from the same weights and batch)."""
        pairs = [(s, float(o)) for s, o in zip(self.steps, single_device_losses or []) if s.loss is not None]
        drift = [abs(s.loss - o) for s, o in pairs]
        floors = [s.loss_floor for s, _ in pairs]
        beyond = next((s.step for (s, _), d in zip(pairs, drift)
                       if s.loss_floor is not None and d > NOISE_MULTIPLE * s.loss_floor), None)
        checked = sum(1 for s in self.steps if s.checked)
        parted = ""
        if pairs:
            parted = ("; every step's drift from the single-device run is within its loss floor" if beyond is None
                      else f"; the losses part from the single-device run's at step {beyond} (beyond "
                           f"{NOISE_MULTIPLE:g}x that step's loss floor)")
            if beyond == pairs[0][0].step:
                parted += ": at the first step, so the two runs did not start from the same weights or batch"
        if self.ok:
            big = max(range(len(drift)), key=drift.__getitem__, default=None)
            said = (f"; the losses drift up to {drift[big]:.3g} from the single-device run's (step "
                    f"{pairs[big][0].step}), float noise compounded over the steps") if big is not None else ""
            return Drift(True, None, drift, f"noise: every step held within its floor ({checked} checked, every "
                                             f"{self.every}){said}{parted}", floors, beyond)
        return Drift(False, self.first_wrong_step, drift,
                     f"step {self.first_wrong_step} is the first beyond its floor (stage {self.stage}): {self.failure}"
                     f"{parted}", floors, beyond)

    def plot(self, ax, single_device_losses=None):
        """The run's losses, each checked step's worst stage ratio (right axis: err / floor, the limit
        dashed), the first wrong step marked; returns the artists."""
        steps = [s.step for s in self.steps if s.loss is not None]
        arts = ax.plot(steps, [s.loss for s in self.steps if s.loss is not None], label="pipeline loss")
        if single_device_losses is not None:
            arts += ax.plot(range(len(single_device_losses)), single_device_losses, "--", label="single device")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        right = ax.twinx()
        chk = [s for s in self.steps if s.stages]
        arts += right.plot([s.step for s in chk], [max(e / f for e, f in s.stages.values()) for s in chk], "o",
                           color="C3", label="worst err / floor")
        arts.append(right.axhline(NOISE_MULTIPLE, ls=":", color="C3"))
        right.set_yscale("log")
        right.set_ylabel("err / floor")
        if self.first_wrong_step is not None:
            arts.append(ax.axvline(self.first_wrong_step, color="C3", alpha=0.5))
        return arts


def plot_run(report: RunReport, ax, single_device_losses=None):
    """`report.plot(ax)`: a plot helper that takes an `ax` (house style)."""
    return report.plot(ax, single_device_losses)
