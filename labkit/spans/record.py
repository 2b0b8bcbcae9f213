"""Recording spans inside a rank: both ends of every pipelining action, on the device's clock.

`install()` patches torch's pipelining classes once per process (class attributes, so every stage
and schedule a script builds is covered, with no change to the script):

- compute: `_PipelineStageBase.forward_one_chunk` (F), `backward_one_chunk` (B, or I when the
  schedule splits the backward: `full_backward=False`) and `backward_weight_one_chunk` (W). The
  schedules wait for incoming tensors outside these calls, so a span is the action's own work, in
  every schedule (GPipe and 1F1B included, which log only when an action ends) and for both halves
  of an OVERLAP_F_B pair (the runtime calls them one after the other);
- communication: `schedules._batch_p2p` (posting sends / receives: kind SEND or RECV) and
  `schedules._wait_batch_p2p` (waiting for them: kind WAIT, `what` says recv, send or both);
- FSDP2 under pipelining: `perform_reduce_grad` (2.15: `start_gradient_reduction` and
  `wait_for_gradient_reduction`) as REDUCE_GRAD, and `FSDPModule.unshard` / `reshard`
  (UNSHARD / RESHARD: the runtime's actions of those names; the all-gather itself may finish inside
  the next compute, which waits for it);
- steps: each schedule class's `step` / `eval`: spans are numbered by step and written when a step
  ends, one JSON line each, to the current file (`spans/rank<N>.jsonl` in a run directory, or a
  live-ranks cell's own file).

Clocks: on CPU a span's ends are `time.time()` (one clock for every rank of a machine, the clock
the PP logs use). On CUDA the ends are CUDA events recorded on the current stream around the action
and read after the step (one synchronize per step); they are placed on the host clock through one
event recorded right after a synchronize at the step's start: device times, not the host's enqueue
times. Cost on CPU: two clock reads and one list append per action (bench: at most 1.03x per step).

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

Loaded in every rank the kit starts through `labkit/spans/boot/sitecustomize.py` when
`LABKIT_SPANS_DIR` is set (labkit.launching.command.job_env sets it); `install` may also be called
directly. Read back by `labkit.spans.read`. Taught in notebook 06.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path

from .paths import OFF_VAR, SPANS_DIR_VAR
COMPUTE = ("F", "B", "I", "W")

_clock = time.time


class Recorder:
    """The spans of one process. `path`: the file a step's spans go to (None: kept until one is set)."""

    def __init__(self, path: str | os.PathLike | None = None, rank: int | None = None):
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.path = Path(path) if path else None
        self.enabled = os.environ.get(OFF_VAR, "1") != "0"
        self.buf: list[list] = []      # [kind, stage, mb, start, end, what]; start/end: float or CUDA event
        self.step = 0
        self.depth = 0                 # nested step()/eval() calls count once
        self.p2p_depth = 0
        self.tags: dict[int, str] = {}  # id(work) -> "send" | "recv" | "both", this step's works
        self.cuda = None               # (host time, event) of the current step's base, on CUDA
        self.device = None             # torch.device of the stages seen (cuda: events)
        self.meta_written: set[Path] = set()
        self.schedule = ""              # the class of the schedule whose step is running
        self.kit = 0.0                 # this step's seconds in the kit's wrappers (host clock), measured
        self.calls = 0                 # wrapped calls this step
        self.loose: list[list[float]] = []  # host intervals of the kit's code in calls without a span
        self.pipeline: list[int] | None = None  # this step's stage's process group: the ranks of its pipeline

    # ---- clocks
    def _on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _base(self):
        import torch

        torch.cuda.synchronize(self.device)
        ev = torch.cuda.Event(enable_timing=True)
        t0 = _clock()
        ev.record()
        self.cuda = (t0, ev)

    def now(self):
        """A span's end: the host clock on CPU, a CUDA event on the current stream on CUDA."""
        if self._on_cuda():
            import torch

            if self.cuda is None:
                self._base()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return _clock()

    def add(self, kind: str, stage: int, mb: int, start, end, what: str = "") -> list:
        row = [kind, stage, mb, start, end, what, 0.0, 0.0, ()]  # + the kit's own: pre, post, loose pieces
        if self.loose:
            row[8], self.loose = self.loose, []
        self.buf.append(row)
        return row

    def own(self, row: list | None, t_in: float, t_call: float, t_back: float, t_out: float) -> None:
        """A wrapped call's own time, host clock: its entry `t_in` to torch's call `t_call`, and that
        call's return `t_back` to its exit `t_out`. With a span (`row`) the two pieces are its pre and
        post; without one (inside a step) they go on the next span's line."""
        pre, post = t_call - t_in, t_out - t_back
        self.kit += pre + post
        self.calls += 1
        if row is not None:
            row[6], row[7] = pre, post
        elif self.depth:
            self.loose += ([t_in, t_call], [t_back, t_out])

    # ---- steps
    def begin_step(self, schedule: str = "") -> None:
        self.depth += 1
        if self.depth == 1 and schedule:
            self.schedule = schedule
        if self.depth == 1 and self._on_cuda():
            self._base()

    def end_step(self, times: tuple[float, float, float] | None = None) -> None:
        """`times`: the step wrapper's entry, its call of the inner step, and that call's return (host clock)."""
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self.flush(times)

    def flush(self, times: tuple[float, float, float] | None = None) -> None:
        """Write the buffered spans (CUDA events resolved to host-clock seconds) as one step; with the
        step wrapper's `times`, end it with the step's wall time and the kit's own seconds in it."""
        kit, calls, loose = self.kit, self.calls, self.loose
        self.kit, self.calls, self.loose = 0.0, 0, []
        if not self.buf:
            self.tags.clear()
            return
        if loose:  # after the step's last span: on its line
            self.buf[-1][8] = [*self.buf[-1][8], *loose]
        host = all(isinstance(x[3], float) for x in self.buf)  # the kit's pieces sit on host-clock spans only
        rows = self._resolve(self.buf)
        self.buf, step = [], self.step
        self.step += 1
        self.tags.clear()
        self.cuda = None
        pipeline, self.pipeline = self.pipeline, None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            if self.path not in self.meta_written:
                self.meta_written.add(self.path)
                f.write(json.dumps({"meta": self.meta()}) + "\n")
            begin = {"begin_step": step, "schedule": self.schedule}
            if pipeline:  # which ranks form this rank's pipeline (labkit.timeline.group_pipelines)
                begin["pipeline"] = pipeline
            f.write(json.dumps(begin) + "\n")
            for kind, stage, mb, s, e, what, pre, post, pieces in rows:
                row = {"rank": self.rank, "step": step, "kind": kind, "stage": stage, "mb": mb,
                       "start": round(s, 7), "end": round(e, 7)}
                if what:
                    row["what"] = what
                if host and (pre or post):
                    row["pre"], row["post"] = round(pre, 9), round(post, 9)
                if host and pieces:
                    row["kit"] = [[round(a, 7), round(b, 7)] for a, b in pieces]
                f.write(json.dumps(row) + "\n")
            if times is not None:
                f.flush()  # writing is the kit's too: measured up to the last line
                t_in, t_call, t_back = times
                now = _clock()
                book = (t_call - t_in) + (now - t_back)
                f.write(json.dumps({"end_step": step, "wall": round(now - t_in, 9), "kit": round(kit + book, 9),
                                    "wrappers": round(kit, 9), "bookkeeping": round(book, 9), "calls": calls}) + "\n")

    def _resolve(self, buf: list[list]) -> list[list]:
        if not any(not isinstance(x[3], float) for x in buf):
            return buf
        import torch

        torch.cuda.synchronize(self.device)
        t0, base = self.cuda if self.cuda is not None else (None, None)
        out = []
        for kind, stage, mb, s, e, what, *own in buf:
            if isinstance(s, float):
                out.append([kind, stage, mb, s, e, what, *own])
            else:
                out.append([kind, stage, mb, t0 + base.elapsed_time(s) / 1e3, t0 + base.elapsed_time(e) / 1e3, what,
                            *own])
        return out

    def meta(self) -> dict:
        import torch

        return {"rank": self.rank, "pid": os.getpid(), "torch": torch.__version__,
                "clock": "cuda events (device time, placed on the host clock at each step's start)"
                if self._on_cuda() else "host (time.time)", "hooks": sorted(_PATCHED)}

    def use_file(self, path: str | os.PathLike | None) -> None:
        """Send the next steps' spans to `path` (a live-ranks cell's file); what is buffered goes first."""
        self.flush()
        self.path = Path(path) if path else None


RECORDER: Recorder | None = None
_PATCHED: set[str] = set()


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
        atexit.register(RECORDER.flush)
    return RECORDER


def _patch() -> None:
    from torch.distributed.pipelining import schedules, stage

    base = stage._PipelineStageBase
    for name, kind_of in (("forward_one_chunk", lambda a, k: "F"),
                          ("backward_one_chunk", _backward_kind),
                          ("backward_weight_one_chunk", lambda a, k: "W")):
        if name in vars(base) and name not in _PATCHED:
            setattr(base, name, _compute_wrapper(getattr(base, name), kind_of))
            _PATCHED.add(name)
    if hasattr(schedules, "_batch_p2p") and "_batch_p2p" not in _PATCHED:
        schedules._batch_p2p = _post_wrapper(schedules._batch_p2p)
        _PATCHED.add("_batch_p2p")
    if hasattr(schedules, "_wait_batch_p2p") and "_wait_batch_p2p" not in _PATCHED:
        schedules._wait_batch_p2p = _wait_wrapper(schedules._wait_batch_p2p)
        _PATCHED.add("_wait_batch_p2p")
    try:  # FSDP2's all-gather / free of a stage's parameters (the runtime's UNSHARD / RESHARD actions)
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover (torch 2.11-2.15 have it)
        FSDPModule = None
    # FSDP's gradient reduce-scatter: perform_reduce_grad (2.11-2.14), start_gradient_reduction and
    # wait_for_gradient_reduction (2.15, the runtime's REDUCE_GRAD / WAIT_REDUCE_GRAD). Without FSDP
    # perform_reduce_grad only scales the gradients by 1/m (runtime work, left to the overhead between
    # actions), so only FSDP stages get a span
    for name in ("perform_reduce_grad", "start_gradient_reduction", "wait_for_gradient_reduction"):
        if FSDPModule is not None and name in vars(base) and name not in _PATCHED:
            setattr(base, name, _op_wrapper(getattr(base, name), "REDUCE_GRAD",
                                            lambda st, rec: isinstance(st.submod, FSDPModule), lambda st: st.stage_index))
            _PATCHED.add(name)
    for name, kind in (("unshard", "UNSHARD"), ("reshard", "RESHARD")):
        if FSDPModule is not None and name in vars(FSDPModule) and f"FSDPModule.{name}" not in _PATCHED:
            # inside a step only: FSDP outside pipelining is left alone
            setattr(FSDPModule, name, _op_wrapper(getattr(FSDPModule, name), kind, lambda m, rec: rec.depth > 0,
                                                  lambda m: -1))
            _PATCHED.add(f"FSDPModule.{name}")
    for obj in list(vars(schedules).values()):
        if isinstance(obj, type) and issubclass(obj, schedules._PipelineSchedule):
            for name in ("step", "eval"):
                key = f"{obj.__name__}.{name}"
                if name in vars(obj) and key not in _PATCHED:
                    setattr(obj, name, _step_wrapper(vars(obj)[name]))
                    _PATCHED.add(key)


def _backward_kind(args, kwargs) -> str:
    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
    return "B" if full else "I"


def _compute_wrapper(inner, kind_of):
    backward = inner.__name__ != "forward_one_chunk"

    def wrapper(self, chunk_id, *args, **kwargs):
        t_in = _clock()
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
        if rec.device is None:
            rec.device = getattr(self, "device", None)
        if rec.pipeline is None:
            rec.pipeline = _pipeline_of(self)
        start = rec.now()
        t_call = start if start.__class__ is float else _clock()
        out = inner(self, chunk_id, *args, **kwargs)
        t_back = _clock() if t_call is not start else None
        end = rec.now()
        row = rec.add(kind_of(args, kwargs), self.stage_index, chunk_id, start, end)
        rec.own(row, t_in, t_call, end if t_back is None else t_back, _clock())
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
        t_call = start if start.__class__ is float else _clock()
        out = inner(self, *args, **kwargs)
        t_back = _clock() if t_call is not start else None
        end = rec.now()
        row = rec.add(kind, stage_of(self), -1, start, end)
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
            t_call = start if start.__class__ is float else _clock()
            works = inner(p2p_ops, *args, **kwargs)
            t_back = _clock() if t_call is not start else None
            end = rec.now()
        finally:
            rec.p2p_depth -= 1
        row = None
        if p2p_ops:
            what = _direction(p2p_ops)
            for w in works or []:
                rec.tags[id(w)] = what
            row = rec.add("RECV" if what == "recv" else "SEND", -1, -1, start, end, what)
        rec.own(row, t_in, t_call, end if t_back is None else t_back, _clock())
        return works

    return _as(inner, wrapper)


def _wait_wrapper(inner):
    def wrapper(works, *args, **kwargs):
        t_in = _clock()
        rec = RECORDER
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
        t_call = start if start.__class__ is float else _clock()
        out = inner(works, *args, **kwargs)
        t_back = _clock() if t_call is not start else None
        end = rec.now()
        row = rec.add("WAIT", -1, -1, start, end, what)
        rec.own(row, t_in, t_call, end if t_back is None else t_back, _clock())
        return out

    return _as(inner, wrapper)


def _step_wrapper(inner):
    def wrapper(self, *args, **kwargs):
        t_in = _clock()
        rec = RECORDER
        if rec is None:
            return inner(self, *args, **kwargs)
        rec.begin_step(type(self).__name__)
        t_call = _clock()
        try:
            return inner(self, *args, **kwargs)
        finally:
            rec.end_step((t_in, t_call, _clock()))

    return _as(inner, wrapper)
