"""The spans of one process (`Recorder`): numbered by step, kept until the rank idles or the step ends,
then written as one JSON line each to the current file (a schedule's step: its last lines by the watcher
thread or where the rank next idles, `flush(later=True)`), with the kit's own time around each action
(`pre`, `post`, `kit`) and a closing `end_step` line; a step in which torch.compile did anything, or in which a
compiled stage ran, says what on its `begin_step` line (`compile`: dynamo's counts since the step
before, and each compiled stage's state carried over cells and steps, `labkit.spans.compiled`); the
first step a schedule object runs in this process says so there too (`"first": true`: a warm-up, in
which torch's stage infers its shapes and sets up its transfers, and the allocator warms up).
`labkit.spans.record` creates one per rank and feeds it from its wrappers; `labkit.spans.read` reads
the lines back."""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from pathlib import Path

from . import compiled
from .held import LATE
from .paths import OFF_VAR

PATCHED: set[str] = set()
"""Which of torch's functions `labkit.spans.record` wrapped in this process (a span file's meta says)."""

COMPUTE = ("F", "B", "I", "W")

_clock = time.time
_native_id, _pread = threading.get_native_id, os.pread
_SCHED_FDS: dict[int, int | None] = {}


def _cpu() -> tuple:
    """(CPU seconds this thread ran, seconds it waited for a CPU while runnable), both cumulative:
    Linux's per-thread scheduler statistics (/proc/self/task/<tid>/schedstat: on-CPU and run-queue
    nanoseconds, one pread of a file kept open, ~1 us); where there are none, (time.thread_time(), None)."""
    tid = _native_id()
    fd = _SCHED_FDS.get(tid, -1)
    if fd == -1:
        try:
            fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        except OSError:
            fd = None
        _SCHED_FDS[tid] = fd
    if fd is not None:
        try:
            ran, queued = _pread(fd, 64, 0).split()[:2]
            return int(ran) / 1e9, int(queued) / 1e9
        except (OSError, ValueError):
            pass
    return time.thread_time(), None


def machine_load(at_start: tuple) -> dict:
    """What the machine was doing at a step's end, for its `end_step` line: the 1-minute load average,
    the processes runnable right now (/proc/loadavg, Linux), the cores, and the rank thread's CPU
    seconds in the step (its own share: cpu / wall) and seconds it waited for a CPU (`queued`), from
    its clocks `at_start` of the step (`_cpu`)."""
    now = _cpu()
    out = {"cpu": round(now[0] - at_start[0], 9), "cores": _CORES}
    if now[1] is not None and at_start[1] is not None:
        out["queued"] = round(now[1] - at_start[1], 9)
    fields = _loadavg()
    if fields:  # Linux: one read gives both
        out["load1"] = round(float(fields[0]), 3)
        out["runnable"] = int(fields[3].split(b"/")[0])
        return out
    try:
        out["load1"] = round(os.getloadavg()[0], 3)
    except (AttributeError, OSError):  # pragma: no cover (not on Windows)
        pass
    return out


_CORES = os.cpu_count()  # read once (a system call's file read, every step otherwise)
_LOADAVG: list = []  # the fd of /proc/loadavg, kept open (None: there is none)


def _loadavg() -> list | None:
    """/proc/loadavg's fields (bytes), one pread of a file kept open; None where there is none."""
    if not _LOADAVG:
        try:
            _LOADAVG.append(os.open("/proc/loadavg", os.O_RDONLY))
        except OSError:
            _LOADAVG.append(None)
    if _LOADAVG[0] is None:
        return None
    try:
        fields = os.pread(_LOADAVG[0], 128, 0).split()
        return fields if len(fields) >= 4 else None
    except OSError:
        return None


def _line(rank: int, step: int, host: bool, kind: str, stage: int, mb, s: float, e: float, what: str, pre: float,
          post: float, pieces, cpu) -> str:
    """One span's JSON line, as `json.dumps` of {"rank", "step", "kind", "stage", "mb", "start", "end", and
    where they apply "what", "pre", "post", "kit", "cpu", "rq"} writes it, written out by hand (a float's
    repr is JSON's; kind and what are the kit's own words): a few microseconds a span fewer, in every step."""
    r, rd = repr, round  # repr: an int where a float is expected is still written
    out = (f'{{"rank": {rank}, "step": {step}, "kind": "{kind}", "stage": {stage}, '
           f'"mb": {mb if mb.__class__ is int else json.dumps(mb)}, "start": {r(rd(s, 7))}, "end": {r(rd(e, 7))}')
    if what:
        out += f', "what": "{what}"'
    if host:
        if pre or post:
            out += f', "pre": {r(rd(pre, 9))}, "post": {r(rd(post, 9))}'
        if pieces:
            out += ', "kit": [' + ", ".join([f"[{r(rd(a, 7))}, {r(rd(b, 7))}]" for a, b in pieces]) + "]"
        if cpu:  # ((ran, queued) at the start, at the end): _cpu
            (c0, q0), (c1, q1) = cpu
            out += f', "cpu": [{r(rd(c0, 7))}, {r(rd(c1, 7))}]'
            if q0 is not None:
                out += f', "rq": [{r(rd(q0, 7))}, {r(rd(q1, 7))}]'
    return out + "}\n"


def _end_line(end: dict) -> str:
    """A step's `end_step` line: its wall time and the kit's seconds in it (`kit`: the wrappers' and the step
    wrapper's bookkeeping, `flush`), the machine's load and the step's numbers."""
    kit, book, calls, wall = end["kit"]
    return json.dumps({"end_step": end["end_step"], "wall": round(wall, 9), "kit": round(kit + book, 9),
                       "wrappers": round(kit, 9), "bookkeeping": round(book, 9), "calls": calls, **end["load"],
                       **(end["numbers"] or {})}) + "\n"


def _first(stepped: weakref.WeakSet, obj) -> bool:
    """Whether `obj` (a schedule) begins its first step in this process; it is noted as stepped. Held by a
    weak reference: nothing is set on the user's object, and a schedule dropped is forgotten with it."""
    try:
        if obj in stepped:
            return False
        stepped.add(obj)
    except TypeError:  # not weakly referable (a schedule class with __slots__): not told
        return False
    return True


class Recorder:
    """The spans of one process. `path`: the file a step's spans go to (None: kept until one is set)."""

    def __init__(self, path: str | os.PathLike | None = None, rank: int | None = None):
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.path = Path(path) if path else None
        self.enabled = os.environ.get(OFF_VAR, "1") != "0"
        self.buf: list[list] = []      # [kind, stage, mb, start, end, what]; start/end: float or CUDA event
        self.lines: list[str] = []     # the lines of buf's first rows, written out ahead (`ahead`)
        self.step = 0
        self.depth = 0                 # nested step()/eval() calls count once
        self.p2p_depth = 0
        self.tags: dict[int, str] = {}  # id(work) -> "send" | "recv" | "both", this step's works
        self.cuda = None               # (host time, event) of the current step's base, on CUDA
        self.device = None             # torch.device of the stages seen (cuda: events)
        self.meta_written: set[Path] = set()
        self._file = None              # (path, pid, the open file): `_open`
        self.schedule = ""              # the class of the schedule whose step is running
        self.kit = 0.0                 # this step's seconds in the kit's wrappers (host clock), measured
        self.calls = 0                 # wrapped calls this step
        self.loose: list[list[float]] = []  # host intervals of the kit's code in calls without a span
        self.pipeline: list[int] | None = None  # this step's stage's process group: the ranks of its pipeline
        self.step_cpu: tuple = (time.thread_time(), None)  # the rank thread's clocks at the step's start (_cpu)
        self.dynamo = compiled.snapshot()  # dynamo's counters at the last step's end (or the file's start)
        self.step_stages: dict[int, object] = {}  # this step's stages by index (`saw_stage`)
        self.window: str | None = None  # what a fall-back is "since": "cell 3" (use_file's), else "step k"
        self.stepped = weakref.WeakSet()  # the schedule objects that began a step in this process
        self.first = False             # this step is its schedule object's first here (a warm-up: `begin_step`)
        self.due = None                # a step ended `later`: its lines, not yet written (`write_due`)
        self._lock = threading.RLock()  # the file, between the rank's thread and the watcher (`write_overdue`)

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

    def add(self, kind: str, stage: int, mb: int, start, end, what: str = "", cpu: tuple = ()) -> list:
        """`cpu`: the rank thread's CPU clock at the span's two ends (host-clock spans only)."""
        row = [kind, stage, mb, start, end, what, 0.0, 0.0, (), cpu]  # + the kit's own: pre, post, loose pieces
        if self.loose:
            row[8], self.loose = self.loose, []
        self.buf.append(row)
        return row

    def ahead(self) -> None:
        """Where the rank would idle (a wait that blocks): the lines of this step's finished spans written out
        now, not at the step's end (host-clock spans only; the last span is left, as pieces of the kit's time
        may still join it). The step's end writes them with the rest, unchanged."""
        done, last = len(self.lines), len(self.buf) - 1
        if done >= last:
            return
        rows = self.buf[done:last]
        if all(r[3].__class__ is float for r in rows):
            self.lines += [_line(self.rank, self.step, True, *r) for r in rows]

    def saw_stage(self, stage) -> None:
        """A stage ran an action in this step: at the step's end, whether it is compiled and what its
        compiled code did (`labkit.spans.compiled.stage_state`)."""
        if stage.stage_index not in self.step_stages:
            self.step_stages[stage.stage_index] = stage

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
    def begin_step(self, schedule: str = "", obj=None) -> None:
        """`obj`: the schedule object whose step (or eval) this is: the first step it runs in this process
        is marked on the step's `begin_step` line (`"first": true`); a nested step counts once."""
        self.depth += 1
        if self.depth == 1:
            self.step_cpu = _cpu()
            if obj is not None:
                self.first = _first(self.stepped, obj)
        if self.depth == 1 and schedule:
            self.schedule = schedule
        if self.depth == 1 and self._on_cuda():
            self._base()

    def end_step(self, times: tuple[float, float, float] | None = None, numbers: dict | None = None,
                 later: bool = False) -> None:
        """`times`: the step wrapper's entry, its call of the inner step, and that call's return (host clock);
        `numbers`: what the step computed (losses, gradient norms: `labkit.spans.numbers.step_numbers`);
        `later`: its lines written where the rank next idles (`flush`)."""
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self.flush(times, numbers, later)

    def flush(self, times: tuple[float, float, float] | None = None, numbers: dict | None = None,
              later: bool = False) -> None:
        """Write the buffered spans (CUDA events resolved to host-clock seconds) as one step; with the
        step wrapper's `times`, end it with the step's wall time and the kit's own seconds in it, and the
        step's `numbers` (`end_step`). An earlier step's lines still due go first. `later` (host clocks
        only): the step's lines are made ready, not written: the rank writes them at its next blocking wait
        (`ahead`), or the watcher thread, which the step wrapper wakes, a moment later (`write_overdue`); the
        next step's end, a change of file or exit, if first: not on the path from the step's last action to
        the next step."""
        self.write_due()
        kit, calls, loose = self.kit, self.calls, self.loose
        self.kit, self.calls, self.loose = 0.0, 0, []
        first, self.first = self.first, False
        if not self.buf:
            self.tags.clear()
            self.step_stages = {}
            return
        if loose:  # after the step's last span: on its line
            self.buf[-1][8] = [*self.buf[-1][8], *loose]
        host = all(isinstance(x[3], float) for x in self.buf)  # the kit's pieces sit on host-clock spans only
        ahead = self.lines if host else []  # written out where the rank idled (`ahead`)
        rows = self._resolve(self.buf[len(ahead):])
        self.buf, self.lines, step = [], [], self.step
        self.step += 1
        self.tags.clear()
        self.cuda = None
        pipeline, self.pipeline = self.pipeline, None
        now = compiled.snapshot()  # what dynamo compiled since the last step (None: never imported, no work)
        dynamo, self.dynamo = compiled.delta(self.dynamo, now), now
        ran, self.step_stages = self.step_stages, {}
        stages = compiled.stage_state(ran, dynamo, self.window or f"step {step}")
        if self.path is None:
            return
        begin = {"begin_step": step, "schedule": self.schedule}
        if pipeline:  # which ranks form this rank's pipeline (labkit.core.actions.group_pipelines)
            begin["pipeline"] = pipeline
        if first:  # its schedule object's first step in this process: a warm-up (labkit.timeline.critical_path)
            begin["first"] = True
        if compiled.any_counts(dynamo) or stages:  # torch.compile in this step (labkit.spans.compiled)
            begin["compile"] = {**dynamo, "stages": stages} if stages else dynamo
        end = {"end_step": step, "numbers": numbers, "load": machine_load(self.step_cpu)} if times else None
        if later and host:
            at = _clock()  # the kit's time in this step ends here: writing is done where it idles later
            if end is not None:
                t_in, t_call, t_back = times
                end["kit"] = (kit, (t_call - t_in) + (at - t_back), calls, at - t_in)
            self.due = (self.path, step, host, begin, ahead, rows, end, at)
            return
        with self._lock:
            f = self._write(self.path, step, host, begin, ahead, rows)
            if end is not None:
                f.flush()  # writing is the kit's too: measured up to the last line
                t_in, t_call, t_back = times
                at = _clock()
                end["kit"] = (kit, (t_call - t_in) + (at - t_back), calls, at - t_in)
                f.write(_end_line(end))
            f.flush()  # every step's lines reach the file when the step ends (a live cell, a crash)

    def _write(self, path: Path, step: int, host: bool, begin: dict, ahead: list, rows: list):
        """A step's meta (a file's first), begin and span lines, to `path` (kept open); the open file."""
        f = self._open(path)  # kept open from step to step
        if path not in self.meta_written:
            self.meta_written.add(path)
            f.write(json.dumps({"meta": self.meta()}) + "\n")
        f.write(json.dumps(begin) + "\n")
        f.write("".join(ahead + [_line(self.rank, step, host, *row) for row in rows]))
        return f

    def write_due(self) -> None:
        """The lines of a step ended `later`, written now (nothing if none are due)."""
        if self.due is None:
            return
        with self._lock:
            due, self.due = self.due, None
            if due is None:  # written meanwhile by the watcher
                return
            path, step, host, begin, ahead, rows, end, _ = due
            f = self._write(path, step, host, begin, ahead, rows)
            if end is not None:
                f.write(_end_line(end))
            f.flush()

    def write_overdue(self, now: float | None = None, at_once: bool = False) -> None:
        """From the watcher thread (`labkit.spans.held`): a step's lines written `at_once` (the step wrapper woke
        the watcher for them), or once due for `LATE` seconds (a rank that stopped in its own code after a step,
        a loader or a collective, has written its last step whatever woke the watcher)."""
        due = self.due
        if due is not None and (at_once or (now if now is not None else _clock()) - due[-1] >= LATE):
            self.write_due()

    def _open(self, path: Path):
        """`path` (the current file), open for appending, kept open from step to step (opened again after a
        fork, when `use_file` moves to another file, and when the file was deleted)."""
        held = self._file
        if held is not None and held[0] == path and held[1] == os.getpid():
            try:
                if os.fstat(held[2].fileno()).st_nlink:  # not deleted meanwhile (then it is made again)
                    return held[2]
            except (OSError, ValueError):
                pass
        self.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
        self._file = (path, os.getpid(), f)
        return f

    def close(self) -> None:
        """The current file closed (its lines written: each step's are flushed when written)."""
        with self._lock:
            held, self._file = self._file, None
            if held is not None and held[1] == os.getpid():
                try:
                    held[2].close()
                except OSError:
                    pass

    def _resolve(self, buf: list[list]) -> list[list]:
        if not any(not isinstance(x[3], float) for x in buf):
            return buf
        import torch

        torch.cuda.synchronize(self.device)
        t0, base = self.cuda if self.cuda is not None else (None, None)
        out = []
        for kind, stage, mb, s, e, what, *own in buf:  # own: pre, post, pieces, cpu
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
                if self._on_cuda() else "host (time.time)", "hooks": sorted(PATCHED)}

    def use_file(self, path: str | os.PathLike | None, window: str | None = None) -> None:
        """Send the next steps' spans to `path` (a live-ranks cell's file); what is buffered goes first.
        dynamo's counts start again here: a cell's first step counts what the cell compiled before it.
        `window`: what these steps are called where a compiled stage falls back ("cell 3"; None: "step k");
        the stages' states carry on from file to file."""
        self.flush()
        self.close()
        self.path = Path(path) if path else None
        self.window = window
        self.dynamo = compiled.snapshot()
