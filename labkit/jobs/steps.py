"""The reference job's training loop (`labkit.jobs.train`; not an entry point of its own): run the
schedule step by step over a `StepPlan`, time each step, keep what the reference check reads of the
first, and the benchmarks' switches (`BenchOptions`, scripts/bench.py) beside the loop, not in it.
Taught in notebooks 00 and 04.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config.run import RunConfig
from ..worker import distributed as worker
from ..check.noise import autocast_ctx
from ..check.reference import stage_grads


@dataclass
class BenchOptions:
    """The benchmarks' switches (scripts/bench.py, `--log-ab` / `--spans-ab`), off the training path:
    each turns a recorder on for half the steps and off for the other half, in the alternating pairs of
    `worker.pp_logs_on_step`, so one job measures what the recorder costs."""

    log_ab: bool = False
    """Switch torch's pipelining debug logger on and off step by step (result.json: step_pp_logs)."""
    spans_ab: bool = False
    """The same for span recording, labkit.spans.record (result.json: step_spans)."""

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "BenchOptions":
        return cls(log_ab=a.log_ab, spans_ab=a.spans_ab)

    def start(self) -> None:
        self._switch = worker.PPLogSwitch() if self.log_ab else None
        self._spans = _spans_recorder() if self.spans_ab else None

    def before_step(self, step: int) -> None:
        if self._switch:
            self._switch.set(worker.pp_logs_on_step(step))
        if self._spans is not None:
            self._spans.enabled = worker.pp_logs_on_step(step)

    def finish(self) -> None:
        if self._switch:
            self._switch.set(True)  # the logger as TORCH_LOGS set it for everything after the steps

    def result_fields(self, steps: int) -> dict:
        """Which steps logged / recorded spans, for result.json."""
        on = [worker.pp_logs_on_step(i) for i in range(steps)]
        return {**({"step_pp_logs": on} if self.log_ab else {}), **({"step_spans": list(on)} if self.spans_ab else {})}


def _spans_recorder():
    from ..spans.record import recorder

    rec = recorder()
    if rec is None:
        raise RuntimeError("--spans-ab: no span recorder in this rank (launch the job with labkit.run, which "
                           "records spans in every rank)")
    return rec


@dataclass
class StepPlan:
    """What each training step runs on this rank and does to the gradients (built by `plan_steps`)."""

    schedule: Any
    """The pipeline schedule (torch.distributed.pipelining) over this rank's stages."""
    chunks: list
    """[(args, kwargs, target)]: one `schedule.step` each, whose gradients one update accumulates
    (--accumulate G: G of them, else one: this rank's inputs and this replica's targets)."""
    after_backward: Callable | None = None
    """after_backward(stages): before the gradients are read or applied (tied weights' all-reduce,
    replicas' average)."""
    grad_scale: float | None = None
    """Multiply the accumulated gradients by it before they are read or applied (--accumulate)."""
    clip: Callable | None = None
    """clip(stages): last, before the gradients are read (--clip-grad-norm)."""
    memory: bool = False
    """Measure this rank's bytes of parameters, gradients, optimizer state and activations in the first
    step (first["memory"]; composed runs)."""


def run_steps(cfg: RunConfig, d, stages, plan: StepPlan, bench: BenchOptions | None = None):
    """Run the schedule `cfg.steps` times; per-step times, mean loss per step, and the first step's
    losses/grads/output ({"losses", "grads", "output"}, and "memory" when `plan.memory`).
    bench: the benchmarks' switches (`BenchOptions`), None on the training path."""
    params = [p for s in stages for p in s.submod.parameters()]
    opt = _optimizer(cfg, params, plan.memory)
    first = {"losses": [], "grads": None, "output": None}
    step_times, step_losses = [], []
    worker.reset_peak_memory(d.device)
    bench = bench or BenchOptions()
    bench.start()
    tracker = None
    if plan.memory and not cfg.inference:
        from ..worker.memory import SavedTensorTracker
        tracker = SavedTensorTracker(stages)
    for step in range(cfg.steps):
        bench.before_step(step)
        with worker.timed(d.device) as elapsed:
            losses, out = _one_update(cfg, d, stages, plan, params)
        step_times.append(elapsed())
        if step == 0:
            first = _first_step(stages, losses, out, tracker)
        step_losses.append(sum(float(l.detach()) for l in losses) / len(losses) if losses else float("nan"))
        if opt is not None:
            opt.step()
            if step == 0 and "memory" in first:  # the optimizer's state, created by its first step
                first["memory"][2] = _optimizer_bytes(opt)
            opt.zero_grad(set_to_none=True)
        if d.rank == 0:
            worker.progress(step + 1, cfg.steps)
    bench.finish()
    return step_times, step_losses, first


def _optimizer(cfg: RunConfig, params: list, memory: bool):
    """SGD over this rank's parameters (None for inference or a rank without any). Composed runs
    (memory measured) keep a momentum buffer per parameter, an optimizer state for FSDP2 to shard like
    the gradients; its first update equals plain SGD's, the step the reference check reads."""
    if cfg.inference or not params:
        return None
    return torch.optim.SGD(params, lr=0.01, momentum=0.9 if memory else 0.0)


def _one_update(cfg: RunConfig, d, stages, plan: StepPlan, params: list):
    """One schedule step per accumulated chunk, then the gradients made ready for the update:
    after_backward, grad_scale, clip. Returns this rank's losses and the last chunk's output."""
    has_last = any(s.is_last for s in stages)
    autocast = getattr(torch, cfg.autocast) if cfg.autocast else None
    losses: list = []
    out = None
    for args, model_kwargs, target in plan.chunks:
        mine: list = []  # step() clears the list it is given: one per chunk
        kwargs = {"target": target, "losses": mine} if (has_last and not cfg.inference) else {}
        with autocast_ctx(d.device, autocast):
            out = plan.schedule.step(*args, **model_kwargs, **kwargs)
        losses += mine
    if cfg.inference:
        return losses, out
    if plan.after_backward is not None:
        plan.after_backward(stages)
    if plan.grad_scale is not None:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(plan.grad_scale)
    if plan.clip is not None:
        plan.clip(stages)
    return losses, out


def _first_step(stages, losses: list, out, tracker) -> dict:
    """What the reference check reads of the first step: losses, gradients, the output (last stage),
    and with a memory tracker the rank's bytes (optimizer state: after its first update)."""
    has_last = any(s.is_last for s in stages)
    first = {"losses": list(losses), "grads": stage_grads(stages),
             "output": out.detach() if (has_last and out is not None) else None,
             # the weights the step ran with: the optimizer moves them before the check (check_step(values=))
             "values": {int(s.stage_index): {n: p.detach().clone() for n, p in s.submod.named_parameters()}
                        for s in stages}}
    if tracker is not None:
        from ..parallel.compose import memory_row
        # the rank's stages together, at every change; optimizer state: after its first step, below
        first["memory"] = memory_row(stages, None, tracker.rank_peak())
    return first


def _optimizer_bytes(opt) -> float:
    from ..parallel.compose import local_bytes
    return float(local_bytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)))


@contextlib.contextmanager
def compile_counts(device):
    """Collective: yields a dict that, after the block, holds every rank's torch.compile counts over it
    ({str(rank): labkit.spans.compiled counts}, for result.json; all zeros where dynamo did nothing)."""
    from ..spans import compiled

    before, counts = compiled.snapshot(), {}
    yield counts
    every = worker.all_gather_floats(compiled.as_floats(compiled.delta(before, compiled.snapshot())), device)
    counts.update({str(r): compiled.from_floats(v) for r, v in enumerate(every)})
