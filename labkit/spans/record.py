"""Recording spans inside a rank: both ends of every pipelining action, on the device's clock.

`install()` patches torch's pipelining classes once per process (class attributes, so every stage
and schedule a script builds is covered, with no change to the script):

- compute: the stages' base class's `forward_one_chunk` (F), `backward_one_chunk` (B, or I when the
  schedule splits the backward: `full_backward=False`) and `backward_weight_one_chunk` (W). The
  schedules wait for incoming tensors outside these calls, so a span is the action's own work, in
  every schedule (GPipe and 1F1B included, which log only when an action ends) and for both halves
  of an OVERLAP_F_B pair (the runtime calls them one after the other);
- communication: torch's functions that post sends / receives (kind SEND or RECV) and wait for them
  (kind WAIT, `what` says recv, send or both): `labkit.versions.wrap_p2p`;
- FSDP2 under pipelining: `perform_reduce_grad` (2.15: `start_gradient_reduction` and
  `wait_for_gradient_reduction`) as REDUCE_GRAD, and `FSDPModule.unshard` / `reshard`
  (UNSHARD / RESHARD: the runtime's actions of those names; the all-gather itself may finish inside
  the next compute, which waits for it);
- steps: each schedule class's `step` / `eval`: spans are numbered by step and written when a step
  ends, one JSON line each, to the current file (`spans/rank<N>.jsonl` in a run directory, or a
  live-ranks cell's own file).

Clocks: on CPU a span's ends are `time.time()` (one clock for every rank of a machine, the clock
the PP logs use), and beside them the rank thread's scheduler clocks (Linux's schedstat, `_cpu`):
the seconds it ran (`cpu` on each line) and the seconds it was runnable but waited for a CPU (`rq`:
the machine was busy; a sleep or a blocking wait is neither). The ranks compute on that one thread
(OMP_NUM_THREADS=1). Each step's `end_step` line adds the machine's load: the 1-minute load
average, the runnable processes, the cores, and the rank thread's CPU and run-queue seconds in the
step (`labkit.spans.idle`: the cause "descheduled: the machine was busy"). On CUDA the ends are CUDA
events recorded on the current stream around the action
and read after the step (one synchronize per step); they are placed on the host clock through one
event recorded right after a synchronize at the step's start: device times, not the host's enqueue
times. Cost on CPU: two clock reads and one list append per action, a few per cent of a CPU step at
most (bench/RESULTS.md).

The kit's own share, measured (not estimated): each wrapper also reads the host clock on entry and
on exit, so the time it spends around torch's call is known: `pre` (entry to the span's start) and
`post` (the span's end to exit) on each span's line; a wrapped call that makes no span (an empty
post, a wait for nothing, torch's gradient scaling without FSDP) gives its two pieces as intervals
(`kit`) on the line of the span that follows it. The step wrapper adds its bookkeeping (its entry to
the inner step, and the step's return to the spans written). A step ends with one line,
`{"end_step": k, "wall": ..., "kit": ..., ...}`: the step's wall time as its caller saw it and the
kit's seconds in it. `labkit.spans.read` gives them per rank as `instrument_overhead`;
`labkit.spans.idle` counts the pieces inside a gap between two actions as their own cause
("instrument overhead"), apart from the runtime's.

What a step computed is on that line too (`labkit.spans.numbers`): the microbatches' losses the caller
passed (`losses=`) as exact floats, and each of the schedule's stages' gradient norm in float64 (of the
local shard under FSDP / DTensor), read after torch's step returned, under no_grad, outside any compiled
region: `labkit timeline --compare A B --numbers` says the first step two runs differ in, bit for bit.

Where the rank would idle (a wait that blocks: a transfer not yet complete) the kit does its deferred work:
torch's pipelining records held on CPU are written (`labkit.spans.held`), the activations' fingerprints taken
(`labkit.spans.received`) and the step's finished spans written out (`Recorder.ahead`); torch's records and
fingerprints still due, at the step's end (`labkit.spans.later`). A step's own last lines (its last spans,
`begin_step`, `end_step`) are made ready when it ends, not written between its last action and the next
step (the first stage's step end is on the pipeline's critical path): the rank writes them at its next
blocking wait, or the watcher thread, woken for them, `SOON` (50 ms) later while the rank goes on
(`labkit.spans.held`); the next step's end, a live cell's end and exit (`write_all` before an `os._exit`)
write them if first.

Loaded in every rank the kit starts through `labkit/spans/boot/sitecustomize.py` when
`LABKIT_SPANS_DIR` is set (labkit.launching.command.job_env sets it); `install` may also be called
directly. Read back by `labkit.spans.read`. Taught in notebook 06b.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

from . import held, received
from .later import blocks as _blocks, due as _due, idle as _idle, not_recorded as _not_recorded
from .numbers import step_numbers
from .paths import SPANS_DIR_VAR
from .recorder import PATCHED as _PATCHED
from .recorder import Recorder, _cpu
_clock = time.time


RECORDER: Recorder | None = None


def recorder() -> Recorder | None:
    return RECORDER


def install(out_dir: str | os.PathLike | None = None, rank: int | None = None) -> Recorder:
    """Record spans in this process (idempotent). `out_dir`: where `rank<N>.jsonl` goes (default:
    $LABKIT_SPANS_DIR; none: kept in memory until `Recorder.use_file`)."""
    global RECORDER
    if RECORDER is None:
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        out_dir = out_dir or os.environ.get(SPANS_DIR_VAR)
        RECORDER = Recorder(Path(out_dir) / f"rank{rank}.jsonl" if out_dir else None, rank)
        _patch()
        held.watch_loggers()
        atexit.register(RECORDER.flush)  # the last step's lines, where still due
        held.TICKS.append(_overdue)  # ... or by the watcher thread (labkit.spans.held)
        atexit.register(held.release)  # runs before logging's own shutdown (registered earlier, run later)
    return RECORDER


def write_all() -> None:
    """Everything of the kit's still due in this process written now (torch's held records, the last step's
    span lines): before an exit that skips `atexit` (`os._exit`)."""
    held.release()
    if RECORDER is not None:
        RECORDER.flush()


def _patch() -> None:
    # torch's private classes and functions come from labkit.versions (the releases each covers)
    from ..versions import (schedule_classes, stage_base_class, stage_module_call, stage_reduce_grad_methods,
                            wrap_p2p)

    base = stage_base_class()
    for name, kind_of in (("forward_one_chunk", lambda a, k: "F"),
                          ("backward_one_chunk", _backward_kind),
                          ("backward_weight_one_chunk", lambda a, k: "W")):
        if name in vars(base) and name not in _PATCHED:
            setattr(base, name, _compute_wrapper(getattr(base, name), kind_of))
            _PATCHED.add(name)
    call = stage_module_call()  # what the stage hands its module, fingerprinted outside the module
    if call is not None and call not in _PATCHED:
        setattr(base, call, _module_call_wrapper(getattr(base, call)))
        _PATCHED.add(call)
    for which, make_wrapper in (("post", _post_wrapper), ("wait", _wait_wrapper)):
        if (name := wrap_p2p(which, make_wrapper, skip=_PATCHED)) is not None:
            _PATCHED.add(name)
    try:  # FSDP2's all-gather / free of a stage's parameters (the runtime's UNSHARD / RESHARD actions)
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover (torch 2.11-2.15 have it)
        FSDPModule = None
    # FSDP's gradient reduce-scatter (the runtime's REDUCE_GRAD / WAIT_REDUCE_GRAD). Without FSDP
    # perform_reduce_grad only scales the gradients by 1/m (runtime work, left to the overhead between
    # actions), so only FSDP stages get a span
    for name in stage_reduce_grad_methods():
        if FSDPModule is not None and name not in _PATCHED:
            setattr(base, name, _op_wrapper(getattr(base, name), "REDUCE_GRAD",
                                            lambda st, rec: isinstance(st.submod, FSDPModule),
                                            lambda st: st.stage_index))
            _PATCHED.add(name)
    for name, kind in (("unshard", "UNSHARD"), ("reshard", "RESHARD")):
        if FSDPModule is not None and name in vars(FSDPModule) and f"FSDPModule.{name}" not in _PATCHED:
            # inside a step only: FSDP outside pipelining is left alone
            setattr(FSDPModule, name, _op_wrapper(getattr(FSDPModule, name), kind, lambda m, rec: rec.depth > 0,
                                                  lambda m: -1))
            _PATCHED.add(f"FSDPModule.{name}")
    for obj in schedule_classes():
        for name in ("step", "eval"):
            key = f"{obj.__name__}.{name}"
            if name in vars(obj) and key not in _PATCHED:
                setattr(obj, name, _step_wrapper(vars(obj)[name], grads=name == "step"))
                _PATCHED.add(key)


def _backward_kind(args, kwargs) -> str:
    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
    return "B" if full else "I"


def _compute_wrapper(inner, kind_of):
    backward = inner.__name__ != "forward_one_chunk"

    def wrapper(self, chunk_id, *args, **kwargs):
        t_in = _clock()
        if not backward:
            _received(self, chunk_id)
        rec = RECORDER
        if rec is None or not rec.enabled:
            return inner(self, chunk_id, *args, **kwargs)
        if backward and not getattr(self, "has_backward", True):
            # a forward-only step (loss_fn=None, eval): GPipe still calls the backward, which returns at once
            t_call = _clock()
            out = inner(self, chunk_id, *args, **kwargs)
            t_back = _clock()
            rec.own(None, t_in, t_call, t_back, _clock())
            return out
        if rec.device is None and getattr(self, "device", None) is not None:
            import torch  # every form torch's PipelineStage takes: "cpu", "cuda:1", 1, torch.device

            rec.device = torch.device(self.device)
        if rec.pipeline is None:
            rec.pipeline = _pipeline_of(self)
        rec.saw_stage(self)  # a compiled stage's state is kept per step (labkit.spans.compiled)
        start = rec.now()
        c0 = _cpu()
        t_call = start if start.__class__ is float else _clock()
        out = inner(self, chunk_id, *args, **kwargs)
        t_back = _clock() if t_call is not start else None
        c1 = _cpu()
        end = rec.now()
        row = rec.add(kind_of(args, kwargs), self.stage_index, chunk_id, start, end, cpu=(c0, c1))
        rec.own(row, t_in, t_call, end if t_back is None else t_back, _clock())
        return out

    return _as(inner, wrapper)


def _received(stage, chunk_id) -> None:
    """Notes the microbatch whose inputs the stage's module call will fingerprint (labkit.spans.received)."""
    try:
        received.begin(stage, chunk_id)
    except Exception as e:  # noqa: BLE001  (never break the user's step over the check's record)
        _not_recorded(stage, e)


def _module_call_wrapper(inner):
    """The stage's call of its module on one microbatch: its inputs and output fingerprinted around it
    (labkit.spans.received), in torch's stage code, never inside the module (a compiled module's graphs,
    guards and recompiles are the user's alone). Inside a forward's span: its cost is the forward's."""
    def wrapper(self, *args, **kwargs):
        if getattr(self, received._CHUNK, None) is None:  # not a forward the kit noted: left alone
            return inner(self, *args, **kwargs)
        try:
            received.before(self, args, kwargs)
        except Exception as e:  # noqa: BLE001  (never break the user's step over the check's record)
            _not_recorded(self, e)
        out = inner(self, *args, **kwargs)
        try:
            received.after(self, out)
        except Exception as e:  # noqa: BLE001
            _not_recorded(self, e)
        return out

    return _as(inner, wrapper)


def _pipeline_of(stage) -> list[int]:
    """The global ranks of the stage's process group, in group-rank order: the ranks of its pipeline
    (a pipeline inside a (pp, dp, tp) mesh is built on `mesh["pp"]`'s group). Read once per stage."""
    ranks = getattr(stage, "_labkit_pipeline", None)
    if ranks is None:
        import torch.distributed as dist

        try:
            group = getattr(stage, "group", None)
            ranks = [int(r) for r in dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)]
        except Exception:  # no process group (a stage driven by hand): record nothing rather than guess
            ranks = []
        try:
            stage._labkit_pipeline = ranks
        except AttributeError:
            pass
    return ranks


def _op_wrapper(inner, kind: str, applies, stage_of):
    """A call that is not compute (FSDP's REDUCE_GRAD, UNSHARD, RESHARD): a span of `kind` when
    `applies(self, recorder)`, in the row of stage `stage_of(self)` (-1: the next compute's)."""
    def wrapper(self, *args, **kwargs):
        t_in = _clock()
        rec = RECORDER
        if rec is None or not rec.enabled:
            return inner(self, *args, **kwargs)
        if not applies(self, rec):
            t_call = _clock()
            out = inner(self, *args, **kwargs)
            t_back = _clock()
            rec.own(None, t_in, t_call, t_back, _clock())
            return out
        start = rec.now()
        c0 = _cpu()
        t_call = start if start.__class__ is float else _clock()
        out = inner(self, *args, **kwargs)
        t_back = _clock() if t_call is not start else None
        c1 = _cpu()
        end = rec.now()
        row = rec.add(kind, stage_of(self), -1, start, end, cpu=(c0, c1))
        rec.own(row, t_in, t_call, end if t_back is None else t_back, _clock())
        return out

    return _as(inner, wrapper)


def _as(inner, wrapper):
    """`wrapper` stands for `inner` (name, docstring; `__wrapped__` leads back to torch's own)."""
    wrapper.__wrapped__ = inner  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(inner, "__name__", wrapper.__name__)
    wrapper.__doc__ = inner.__doc__
    return wrapper


def _direction(ops) -> str:
    names = {getattr(getattr(p, "op", None), "__name__", "") for p in ops}
    send, recv = any("send" in n for n in names), any("recv" in n for n in names)
    return "both" if send and recv else ("recv" if recv else "send")


def _post_wrapper(inner):
    def wrapper(p2p_ops, *args, **kwargs):
        t_in = _clock()
        rec = RECORDER
        if rec is None or not rec.enabled or rec.p2p_depth:  # nested: the outer call's span covers it
            return inner(p2p_ops, *args, **kwargs)
        rec.p2p_depth += 1
        try:
            start = rec.now()
            c0 = _cpu()
            t_call = start if start.__class__ is float else _clock()
            works = inner(p2p_ops, *args, **kwargs)
            t_back = _clock() if t_call is not start else None
            c1 = _cpu()
            end = rec.now()
        finally:
            rec.p2p_depth -= 1
        row = None
        if p2p_ops:
            what = _direction(p2p_ops)
            for w in works or []:
                rec.tags[id(w)] = what
            row = rec.add("RECV" if what == "recv" else "SEND", -1, -1, start, end, what, cpu=(c0, c1))
        rec.own(row, t_in, t_call, end if t_back is None else t_back, _clock())
        return works

    return _as(inner, wrapper)


def _overdue(woke: bool = False) -> bool:
    """From the watcher thread: the last step's lines written when it was woken for them, or once `LATE` seconds
    old (`Recorder.write_overdue`); whether any are still due."""
    rec = RECORDER
    if rec is not None:
        rec.write_overdue(at_once=woke)
    return rec is not None and rec.due is not None


def _wait_wrapper(inner):
    def wrapper(works, *args, **kwargs):
        t_in = _clock()
        rec = RECORDER
        if works and _due(rec) and _blocks(works):
            _idle(rec, works)  # the rank is about to idle: the kit's deferred work, until the works complete
        if rec is None or not rec.enabled:
            return inner(works, *args, **kwargs)
        if not works:
            t_call = _clock()
            out = inner(works, *args, **kwargs)
            t_back = _clock()
            rec.own(None, t_in, t_call, t_back, _clock())
            return out
        tags = {rec.tags.get(id(w), "?") for w in works}
        what = "both" if "both" in tags or {"send", "recv"} <= tags else ("recv" if "recv" in tags else
                                                                          ("send" if "send" in tags else "?"))
        start = rec.now()
        c0 = _cpu()
        t_call = start if start.__class__ is float else _clock()
        out = inner(works, *args, **kwargs)
        t_back = _clock() if t_call is not start else None
        c1 = _cpu()
        end = rec.now()
        row = rec.add("WAIT", -1, -1, start, end, what, cpu=(c0, c1))
        rec.own(row, t_in, t_call, end if t_back is None else t_back, _clock())
        return out

    return _as(inner, wrapper)


def _step_wrapper(inner, grads: bool = True):
    """A schedule's `step` (`grads`: its stages' gradient norms recorded too) or `eval`: its spans written
    when it returns, with its numbers (`labkit.spans.numbers`) on its `end_step` line."""
    def wrapper(self, *args, **kwargs):
        t_in = _clock()
        rec = RECORDER
        if rec is None:
            return inner(self, *args, **kwargs)
        rec.begin_step(type(self).__name__, self)  # its first step in this process is marked (a warm-up)
        outer = rec.depth == 1
        if outer:  # torch's records written where the rank would idle (labkit.spans.held), on CPU
            held.watch_loggers()
            held.HOLD.on = held.holds(self)
        t_call = _clock()
        try:
            out = inner(self, *args, **kwargs)
        except BaseException:
            t_back = _clock()
            if outer:
                held.HOLD.on = False
            _idle()
            rec.end_step((t_in, t_call, t_back))
            raise
        t_back = _clock()  # the numbers are read after it: the kit's bookkeeping, measured as such
        if outer:
            held.HOLD.on = False
        _idle()  # the records and fingerprints still due (a forward-only step waits for no gradient)
        numbers = step_numbers(self, kwargs.get("losses"), grads) if rec.depth == 1 and rec.enabled else None
        # the step's lines written where the rank next idles: not between its last action and the next step
        rec.end_step((t_in, t_call, t_back), numbers, later=True)
        if rec.due is not None:
            held.nudge()  # ... by the watcher thread: once LATE s old in any case
            held.wake()  # ... SOON after, unless the rank idles first
        return out

    return _as(inner, wrapper)
