"""Where a hung or crashed run is stuck, in pipeline terms (`where_stuck`, `explain`).

Per rank: the step it is in, the action it is in (or "outside the schedule" with its frame), the
microbatch, and the peer rank and stage it waits on. Then the cause where the kit can tell it: a rank
outside the schedule, ranks in different steps, schedules that differ across ranks (class, microbatch
count, stages), a wait cycle among ranks (only where their orders deadlock), a peer that left first (the
crash a "Connection closed by peer" only echoes), ranked as `stuck_causes` says. Anything it cannot tell
it says (`Stuck.unknown`).

It reads each rank's PP log (`labkit.timeline.logged_steps`: a hung step's spans never reach the file,
they are written when a step ends), how each rank ended as the launcher saw it (`RankEnd`: the stack
of its faulthandler dump or of its traceback, parsed by `labkit.launching.diagnose`), and, where they
exist, its spans files (the steps it finished where the PP logs are off; which ranks form its
pipeline, to name a peer by its global rank). A rank that was computing is not called stuck: a job
stopped by `stall=` while every rank computed is said to be slow. Used by `LaunchError`, `Run.where_stuck()`,
`labkit timeline RUN_DIR` and a live pool's `RanksError` (a cell's own logs: `where_stuck_in_cell`); taught in
notebook 09.

May import: labkit.core, labkit.logs, labkit.spans, labkit.timeline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .logged_steps import LoggedStep, RankLog, Transfer, read_rank_log
from .stuck_causes import causes

__all__ = ["RankEnd", "RankState", "Stuck", "explain", "where_stuck", "where_stuck_in_cell"]

_PIPELINING = "torch/distributed/pipelining/"
_STEP_FUNCS = {"step", "eval", "_step_microbatches"}
_SETUP = {"_initialize_pipeline_distributed_state", "_initialize_stage", "_initialize_pp_stages",
          "_prepare_forward_infra", "_prepare_backward_infra", "_shape_inference", "_backward_metadata_inference",
          "_forward_metadata_inference"}
_COMPUTE = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}
_CELL = re.compile(r"<cell (\d+)>$")


@dataclass
class RankEnd:
    """How one rank's process ended, as the launcher saw it."""

    how: str = "unknown"
    """"stalled": its stack was dumped while it ran (stall, deadline); "raised": it died of an exception
    (a traceback in its log); "exited": it ended without one; "stopped": stopped with the job, no stack
    dumped (an interrupt); a live pool's cell (labkit.Ranks) adds "finished": the rank ended the cell, and
    "idle": it was not sent the cell; "unknown"."""
    frames: list = field(default_factory=list)
    """(file, line, function) of its stack, innermost first."""
    user: tuple | None = None
    """Its innermost frame outside libraries and the kit: (file, line, function)."""
    error: str = ""
    echo: bool = False
    """Its error only echoes a peer's end ("Connection closed by peer")."""
    exitcode: int | None = None


@dataclass
class RankState:
    """Where one rank was, in pipeline terms."""

    rank: int
    how: str
    """As `RankEnd.how`."""
    doing: str
    """"wait" (for a transfer), "setup" (the first step's collective), "compute", "schedule" (elsewhere
    in schedule.step), "outside" (not in schedule.step), "exited", "stopped" (no stack: its log only), "finished"
    and "idle" (a pool's cell: it ended the cell, it was not sent it), "unknown"."""
    step: int | None = None
    """In the schedule: the step it is in (1 = its first call of schedule.step); else the steps it finished."""
    action: tuple | None = None
    """(kind, stage, microbatch) of the action it is in."""
    waits: list = field(default_factory=list)
    """The transfers (`Transfer`) it waits for."""
    where: tuple | None = None
    """Its innermost user frame (file, line, function)."""
    inner: str = ""
    """Its innermost frame, `file:line in function` (a collective's, a wait's)."""
    schedule: str = ""
    microbatches: int | None = None
    """Per step, from its last finished step (None: it finished none, or logged none)."""
    error: str = ""
    exitcode: int | None = None
    last_time: float | None = None
    stages: tuple = ()
    steps_from: str = "logs"
    """Where `step` comes from: "logs", "spans" or "" (unknown)."""
    echo: bool = False
    """Its error only echoes a peer's end (`RankEnd.echo`)."""
    pipeline: tuple = ()
    """The global ranks of its pipeline, where its spans say them (() : unknown, read as one pipeline)."""

    @property
    def in_schedule(self) -> bool:
        return self.doing in ("wait", "setup", "compute", "schedule")

    def frame(self) -> str:
        if not self.where:
            return "an unknown place"
        f, line, fn = self.where
        cell = _CELL.match(str(f))  # a live pool's cell (labkit.Ranks): `<cell 5>`
        if cell:
            at = f"cell {cell.group(1)}, line {line}"
            return at if fn == "<module>" else f"{fn} ({at})"
        return f"{fn} ({Path(f).name}:{line})"

    def action_words(self) -> str:
        if not self.action or self.action[0] is None or self.action[1] is None:
            return ""  # nothing to name: a wait before the log said which stage this rank holds (torch 2.11's set-up)
        k, s, mb = self.action
        return f"{k}(stage {s}, mb {mb})" if mb is not None else f"{k}(stage {s})"

    def sentence(self) -> str:
        """`rank 0 waits in step 2 to receive microbatch 0's gradient from stage 1 (rank 1), for its B(...)`."""
        step = f"step {self.step}" if self.step is not None else "an unknown step"
        act = self.action_words()
        raised = self.how == "raised"
        if self.doing == "wait":
            waits = sorted(self.waits, key=lambda t: t.op != "recv")
            text = (f"{'waited' if raised else 'waits'} in {step}" + (f", in {act}," if act else "") + " "
                    + (" and ".join(t.words() for t in waits) if waits else "for a transfer the log does not name"))
        elif self.doing == "setup":
            text = (f"failed in {step} in the schedule's set-up ({self.inner})" if raised else
                    f"waits in {step} in the schedule's set-up ({self.inner}): an exchange every rank of "
                    "the pipeline joins in its first step")
        elif self.doing == "compute":
            text = (f"failed in {step} computing {act or 'an action'}" if raised else
                    f"computes {act or 'an action'} in {step}: it was working, not waiting")
        elif self.doing == "schedule":
            text = f"is in schedule.step ({step}) at {self.inner}" + (f", after its {act}" if act else "")
        elif self.doing == "outside":
            done = ("may have run steps (its logs say nothing)" if self.step is None else
                    "never entered schedule.step" if not self.step else f"left schedule.step after step {self.step}")
            text = f"is outside the schedule: it {done} and is in {self.frame()}"
        elif self.doing == "stopped":
            text = (f"was stopped with the job (no stack dumped); its log ends in {step}"
                    + (f" after its {act}" if act else ""))
        elif self.doing == "finished":
            text = ("finished the cell without entering schedule.step" if not self.step else
                    f"finished the cell after step {self.step}{self._per_step()}")
        elif self.doing == "idle":
            text = "was not sent the cell (exec(..., ranks=...) left it out)"
        elif self.doing == "exited":
            code = f" (exit code {self.exitcode})" if self.exitcode is not None else ""
            text = f"had ended{code}" + (f" after step {self.step}" if self.step else "") + self._per_step()
        else:
            text = "left no stack and no pipelining log: nothing to read"
        if raised and self.error:
            text += f": {_short(self.error)}" if text.startswith("failed") else f"; it failed with {_short(self.error)}"
        return f"rank {self.rank} {text}"

    def _per_step(self) -> str:
        return f" ({self.microbatches} microbatches per step)" if self.microbatches else ""


@dataclass
class Stuck:
    """Where each rank of a stopped or failed run was, and why, as far as the kit can tell."""

    ranks: dict = field(default_factory=dict)
    """{rank: RankState}."""
    causes: list = field(default_factory=list)
    """Sentences: what made the ranks wait (or leave)."""
    unknown: list = field(default_factory=list)
    """Sentences: what the kit could not tell, and why."""
    pipelined: bool = True
    """Some rank logged pipelining lines, was in torch's schedule, or left spans: False for a job that
    never pipelined (then nothing here is said in pipeline terms)."""
    cell: int | None = None
    """A live pool's cell (labkit.Ranks) this reading is of: its steps are counted from the cell's start."""

    @property
    def hung(self) -> bool:
        """Some rank waited for another (a long computation is not a hang)."""
        return any(s.doing in ("wait", "setup") for s in self.ranks.values())

    def text(self) -> str:
        head = f"In pipeline terms (steps counted from the start of cell {self.cell}):" if self.cell else \
            "In pipeline terms:"
        lines = [head] + [f"  {s.sentence()}" for _, s in sorted(self.ranks.items())]
        lines += [f"Cause: {c}" for c in self.causes]
        lines += [f"Could not tell: {u}" for u in self.unknown]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _short(error: str, n: int = 160) -> str:
    error = " ".join(error.split())
    return error if len(error) <= n else error[: n - 3] + "..."


def _position(frames: list) -> tuple[str, str, str, str]:
    """(doing, the innermost pipelining function, its caller there, the innermost frame) from a stack."""
    pipe = [fr for fr in frames if _PIPELINING in str(fr[0]).replace("\\", "/")]
    inner = f"{Path(frames[0][0]).name}:{frames[0][1]} in {frames[0][2]}" if frames else ""
    if not any(str(f).endswith("schedules.py") and fn in _STEP_FUNCS for f, _, fn in pipe):
        return "outside", "", "", inner
    names = [fn for _, _, fn in pipe]
    caller = names[1] if len(names) > 1 else ""
    if names[0] == "_wait_batch_p2p":
        return "wait", names[0], caller, inner
    if any(fn in _SETUP for fn in names):
        return "setup", next(fn for fn in names if fn in _SETUP), caller, inner
    if any(fn in _COMPUTE for fn in names):
        return "compute", next(fn for fn in names if fn in _COMPUTE), caller, inner
    return "schedule", names[0], caller, inner


def _waits(step: LoggedStep | None, caller: str, placement: dict) -> list[Transfer]:
    """The transfers a rank blocked in `_wait_batch_p2p` waits for: the last it posted, unless its log shows
    that batch over (then an earlier send: the warm-up's wait for the previous send of activations, the
    cool-down's for the previous send of gradients); in the runtime, its action's input."""
    if step is None:
        return []
    if step.runtime:
        return _runtime_waits(step, placement)
    if caller == "_wait_and_release_fwd_send":  # torch 2.15 names the warm-up's wait for its previous send
        for _, _, ts in reversed(step.posts):
            if any(t.op == "send" and t.what == "activation" for t in ts):
                return ts
    if step.posts and _received(step, step.posts[-1][2]):
        # Before that helper the previous send is waited for inline, after the action that consumed the last
        # batch (Schedule1F1B's warm-up and cool-down, torch 2.13): a rank cannot wait for a tensor it has used.
        for _, _, ts in reversed(step.posts[:-1]):
            if any(t.op == "send" for t in ts):
                return [t for t in ts if t.op == "send"]
    return step.posts[-1][2] if step.posts else []


def _received(step: LoggedStep, transfers: list) -> bool:
    """The batch held a receive whose action the step has ended since: that batch is over."""
    consumer = {"activation": ("F", 1), "gradient": ("BI", -1)}  # its kinds, and its stage from the sender's
    recvs = [t for t in transfers if t.op == "recv" and t.mb is not None and t.what in consumer]
    return bool(recvs) and all(any(k in consumer[t.what][0] and mb == t.mb
                                   and (t.peer_stage is None or s == t.peer_stage + consumer[t.what][1])
                                   for k, s, mb in step.done) for t in recvs)


def _runtime_waits(step: LoggedStep, placement: dict) -> list[Transfer]:
    kind, stage, mb, _ = step.action or (None, None, None, "")
    if stage is None:
        return []
    if kind in ("F", "B", "I"):
        forward = kind == "F"
        peer = stage - 1 if forward else stage + 1
        what = "activation" if forward else "gradient"
        posted = [t for _, _, ts in step.posts for t in ts
                  if t.op == "recv" and t.mb == mb and t.peer_stage == peer and t.what == what]
        return posted[-1:] or [Transfer("recv", what, mb, placement.get(peer), peer, group=False)]
    if kind in ("WAIT_SEND_F", "WAIT_SEND_B"):
        forward = kind.endswith("F")
        peer = stage + 1 if forward else stage - 1
        return [Transfer("send", "activation" if forward else "gradient", mb, placement.get(peer), peer, group=False)]
    return step.posts[-1][2] if step.posts else []


def _action(step: LoggedStep | None, doing: str, func: str, waits: list, stage: int | None) -> tuple | None:
    if step is not None and step.runtime and step.action:
        return step.action[:3]
    if doing == "stopped" and step is not None and step.done:
        return step.last_done
    if doing == "compute":
        kind = _COMPUTE[func]
        return (kind, stage, step.count(kind if kind != "B" else "BI", stage) if step else 0)
    if doing == "wait" and waits:
        recv = next((t for t in waits if t.op == "recv"), None)
        if recv is not None:
            return ("F" if recv.what == "activation" else "B", stage, recv.mb)
        return ("SEND", stage, waits[0].mb)
    return None


def _step_number(log: RankLog, doing: str, how: str, spans_done: int | None,
                 logged: bool = False) -> tuple[int | None, str]:
    """(step, where it comes from): in the schedule the step it is in (1-based), else the steps it finished.
    `logged`: the rank's pipelining log was on, so a rank that wrote no line has finished no step."""
    if log.events or (logged and spans_done is None):
        n = len(log.steps)
        if doing == "setup":
            return 1, "logs"
        if doing in ("wait", "compute", "schedule"):
            step = log.step
            ended = step is not None and not step.runtime and step.complete() and step.last == "action"
            return (max(1, n + 1 if ended and how == "stalled" else n)), "logs"
        return n, "logs"
    if spans_done is None:
        return None, ""
    if doing in ("wait", "setup", "compute", "schedule") and how == "stalled":
        return spans_done + 1, "spans"
    return max(spans_done, 1) if how == "raised" and doing != "outside" else spans_done, "spans"


def rank_state(rank: int, log: RankLog, end: RankEnd, placement: dict, spans_done: int | None = None,
               pipeline: list | None = None, logged: bool = False) -> RankState:
    """Where one rank was: its PP log read against how it ended (`logged`: its PP log was on)."""
    doing, func, caller, inner = _position(end.frames) if end.frames else (
        end.how if end.how in ("exited", "stopped", "finished", "idle") else "unknown", "", "", "")
    step = log.step
    stage = min(log.stages) if len(log.stages) == 1 else None
    number, source = _step_number(log, doing, end.how, spans_done, logged)
    if source == "logs" and number is not None and number > len(log.steps):
        step = None  # a step that has logged nothing yet: its first action
    waits = _waits(step, caller, placement) if doing == "wait" else []
    if pipeline:  # group ranks -> global ranks of this rank's pipeline
        waits = [Transfer(t.op, t.what, t.mb, pipeline[t.peer_rank], t.peer_stage, t.shape, False)
                 if t.group and t.peer_rank is not None and t.peer_rank < len(pipeline) else t for t in waits]
    done = [s for s in log.steps if s.complete()]
    return RankState(rank, end.how, doing, number, _action(step, doing, func, waits, stage), waits, end.user, inner,
                     log.schedule, done[-1].microbatches() if done else None, end.error, end.exitcode, log.last_time,
                     tuple(sorted(log.stages)), source, end.echo, tuple(pipeline or ()))


def explain(logs: dict, ends: dict, spans_done: dict | None = None, pipelines: dict | None = None,
            cell: int | None = None) -> Stuck:
    """Where each rank was and why: `logs` {rank: RankLog}, `ends` {rank: RankEnd}; `spans_done` {rank:
    steps its spans file holds} and `pipelines` {rank: the global ranks of its pipeline}, where known.
    `cell`: a live pool's cell (labkit.Ranks), whose every rank logged its pipelining lines from the cell's start
    (a rank that wrote none ran no step in it)."""
    spans_done, pipelines = spans_done or {}, pipelines or {}
    placement = {}
    for r, log in logs.items():
        for s in log.stages:
            placement.setdefault(s, r)
    states = {r: rank_state(r, logs.get(r, RankLog()), ends.get(r, RankEnd()), placement, spans_done.get(r),
                            pipelines.get(r), cell is not None) for r in sorted(set(logs) | set(ends))}
    stuck = Stuck(states, cell=cell)
    stuck.causes, stuck.unknown = causes(states, logs, cell)
    stuck.pipelined = (any(log.events for log in logs.values()) or any(s.in_schedule for s in states.values())
                       or any(spans_done.values()))
    return stuck


def where_stuck(run_dir, ends: dict, cell: int | None = None) -> Stuck:
    """`explain` for a run directory: its ranks' PP logs and spans read there; `ends` {rank: RankEnd}
    (`labkit.launching.diagnose.rank_ends` reads them from the same directory). A live pool's cell
    directory (`cells/NNN/`: rank<r>.log and spans/ of that cell alone) with its number as `cell`
    (`where_stuck_in_cell`)."""
    from ..logs.files import log_files, parse_files, rank_from_path

    logs = {}
    for f in log_files(run_dir):
        r = rank_from_path(f)
        if r is not None:
            logs[r] = read_rank_log(parse_files([f]))
    spans_done, pipelines = _spans_facts(run_dir)
    return explain(logs, ends, spans_done, pipelines, cell)


def where_stuck_in_cell(cell_dir, ends: dict) -> Stuck:
    """Where a live pool's ranks were in a cell that hung or failed (labkit.Ranks; `labkit.ranks.failure`
    says how each rank left it as `RankEnd`s: the stacks the pool took, the tracebacks of ranks that raised,
    "finished", "idle"), read with the cell's own PP logs and spans (`cells/NNN/`)."""
    return where_stuck(cell_dir, ends, int(Path(cell_dir).name))


def _spans_facts(run_dir) -> tuple[dict, dict]:
    """({rank: steps its spans file holds}, {rank: its pipeline's global ranks}) where spans exist."""
    from ..spans.read import has_spans, read_spans

    if not has_spans(run_dir):
        return {}, {}
    try:
        _, meta = read_spans(run_dir)
    except (OSError, ValueError):
        return {}, {}
    done = {r: len(m.get("instrument", {})) for r, m in meta.items()}
    pipes = {r: m["pipelines"][max(m["pipelines"])] for r, m in meta.items() if m.get("pipelines")}
    return done, pipes
