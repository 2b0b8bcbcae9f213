"""A rank's steps as its PP log tells them (`read_rank_log`): which actions each step ended, which
action the runtime started last, and every point-to-point transfer the rank posted (`Transfer`: send or
receive, activation or gradient, microbatch, peer rank and stage, shape). What `labkit.timeline.stuck`
reads to say where a hung or crashed rank was; it needs no spans (they reach the file only when a step
ends, so a hung step's spans are never written).

How the log is cut into steps (torch writes no "step begins" line for GPipe or 1F1B): the runtime's
`time_step 0` starts a step of a multi-stage schedule; an action a step has already ended (`[Stage 0]
Forwarded chunk 0` again) starts the next; so does a receive of activations posted once every forward
of the step has had its backward (the last stage's first `fwd_recv` of a new step). A step's
transfers get their microbatch from the actions it had ended when they were posted: a stage posts the
receive of microbatch f's input after f forwards, the send of f-1's output after them, and likewise
for gradients with its backwards (GPipe's and 1F1B's loops, torch 2.11-2.15); the runtime names the
microbatch in its `RECV_F1` / `SEND_B0` action. Taught in notebook 09.

May import: labkit.core, labkit.logs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..core.actions import COMPUTE_KINDS
from ..logs.messages import END, START, Event

__all__ = ["LoggedStep", "RankLog", "Transfer", "read_rank_log"]

# `P2POp(isend pg=0, group_src=0, group_dst=1,  torch.Size([2, 4]), torch.float32)` (torch 2.11-2.15)
_OP = re.compile(r"P2POp\((isend|irecv)\b[^()]*?group_src=(\d+),\s*group_dst=(\d+),\s*(?:torch\.Size\((\[[^\]]*\])\))?")
_DESC = re.compile(r"batch_p2p (?:([a-z_]+), )?\[")
_SENDING = re.compile(r"\[Stage (\d+)\] Sending (?:zero )?(tensor|gradient) to Stage (\d+)")


@dataclass(frozen=True)
class Transfer:
    """One tensor a rank posted to send or receive. `peer_rank` is the peer's rank in the stage's
    process group (the kit maps it to a global rank where the spans say which ranks form the pipeline)."""

    op: str            # "send" | "recv"
    what: str          # "activation" | "gradient"
    mb: int | None     # the microbatch (None: the log does not tell)
    peer_rank: int | None
    peer_stage: int | None
    shape: str = ""    # "[2, 4]"
    group: bool = True
    """`peer_rank` is a rank of the stage's process group (read from the op), not yet a global rank."""

    def words(self) -> str:
        """`to receive microbatch 4's activation from stage 0 (rank 0)`, or `until stage 1 (rank 1) receives
        microbatch 0's activation` for a send."""
        mb = f"microbatch {self.mb}'s" if self.mb is not None else "a microbatch's"
        rank = f"rank {self.peer_rank}" if self.peer_rank is not None else "rank unknown"
        peer = f"stage {self.peer_stage} ({rank})" if self.peer_stage is not None else rank
        if self.op == "recv":
            return f"to receive {mb} {self.what} from {peer}"
        return f"until {peer} receives {mb} {self.what}"


@dataclass
class LoggedStep:
    """One step of a rank, as far as its log goes."""

    done: set = field(default_factory=set)
    """(kind, stage, microbatch) of every compute action the step ended."""
    posts: list = field(default_factory=list)
    """[(time, desc, [Transfer, ...])]: each `batch_p2p` line, in order."""
    action: tuple | None = None
    """The runtime's last started action: (kind, stage, microbatch, torch's text), multi-stage schedules."""
    runtime: bool = False
    last: str = ""
    """What the step logged last: "action" (an action's end) or "post" (a batch_p2p line)."""
    last_done: tuple | None = None
    """(kind, stage, microbatch) of the last action the step ended."""

    def count(self, kinds: str, stage: int | None) -> int:
        return sum(1 for k, s, _ in self.done if k in kinds and (stage is None or s == stage))

    def complete(self) -> bool:
        """Every forward of the step has had its backward (a training step's end), and there was one."""
        fwd = {(s, mb) for k, s, mb in self.done if k == "F"}
        return bool(fwd) and fwd == {(s, mb) for k, s, mb in self.done if k in "BI"}

    def microbatches(self) -> int | None:
        """How many microbatches the step ran (forwards of its busiest stage)."""
        stages = {s for k, s, _ in self.done if k == "F"}
        return max((self.count("F", s) for s in stages), default=None)


@dataclass
class RankLog:
    """What a rank's PP log says: its schedule class, its stages, its steps."""

    schedule: str = ""
    """The class of the schedule it built last (`Using Schedule1F1B`)."""
    stages: set = field(default_factory=set)
    steps: list = field(default_factory=list)
    sends_to: dict = field(default_factory=dict)
    """{stage: the stage its activations go to} (`[Stage 0] Sending tensor to Stage 1`)."""
    last_time: float | None = None
    events: int = 0
    """Pipelining lines read: 0 when the rank logged none (TORCH_LOGS=+pp off)."""

    @property
    def step(self) -> LoggedStep | None:
        return self.steps[-1] if self.steps else None


def read_rank_log(events: list[Event]) -> RankLog:
    """One rank's events (`labkit.logs.parse_files(..., meaning_only=False)`) read into its steps."""
    log = RankLog()
    for e in events:
        log.events += 1
        log.last_time = e.time
        if e.kind == "SCHEDULE":
            log.schedule = e.action or ""
        elif e.origin == "runtime" and e.mark == START:
            _runtime_action(log, e)
        elif e.mark == END and e.origin == "stage" and e.kind in COMPUTE_KINDS:
            key = (e.kind, e.stage, e.microbatch)
            if log.step is None or (key in log.step.done and not log.step.runtime):
                log.steps.append(LoggedStep())
            log.step.done.add(key)
            log.step.last, log.step.last_done = "action", key
            log.stages.add(e.stage)
        elif e.message.startswith("batch_p2p"):
            _posted(log, e)
        elif e.kind == "P2P":
            m = _SENDING.match(e.message)
            if m and m.group(2) == "tensor":
                log.sends_to[int(m.group(1))] = int(m.group(3))
    return log


def _runtime_action(log: RankLog, e: Event) -> None:
    if e.time_step == 0 or log.step is None or not log.step.runtime:
        log.steps.append(LoggedStep(runtime=True))
    log.step.action = (e.kind, e.stage, e.microbatch, e.action)
    if e.kind in COMPUTE_KINDS and e.stage is not None:
        log.stages.add(e.stage)


def _posted(log: RankLog, e: Event) -> None:
    m = _DESC.match(e.message)
    desc = (m.group(1) or "") if m else ""
    ops = _OP.findall(e.message)
    if not ops:
        return
    step = log.step
    starts_step = desc == "fwd_recv" or (not desc and all(op == "irecv" for op, *_ in ops))
    if step is None or (starts_step and not step.runtime and step.complete()):
        log.steps.append(LoggedStep())
        step = log.step
    if step.runtime:
        transfers = _runtime_transfers(step, ops)
    else:
        transfers = [_single_stage_transfer(log, step, desc, op) for op in ops]
    step.posts.append((e.time, desc, transfers))
    step.last = "post"


def _own_stage(log: RankLog, step: LoggedStep) -> int | None:
    """A one-stage-per-rank schedule's stage: the one its step's actions name, else any it logged."""
    stages = {s for _, s, _ in step.done} or log.stages
    return min(stages) if len(stages) == 1 else None


def _single_stage_transfer(log: RankLog, step: LoggedStep, desc: str, op: tuple) -> Transfer:
    """GPipe / 1F1B: the microbatch from what the step had ended when the op was posted."""
    kind, src, dst, shape = op
    src, dst = int(src), int(dst)
    send = kind == "isend"
    tokens = dict((d, f) for f, d in re.findall(r"(fwd|bwd)_(send|recv)", desc))
    fwd = tokens.get("send" if send else "recv")
    if fwd is None:  # torch < 2.15 names no direction: activations flow to higher group ranks
        fwd = "fwd" if (dst > src if send else src < dst) else "bwd"
    forward = fwd == "fwd"
    stage = _own_stage(log, step)
    ended = step.count("F" if forward else "BI", stage)
    mb = ended - 1 if send else ended
    peer_stage = None
    if stage is not None:
        peer_stage = (log.sends_to.get(stage, stage + 1) if send else stage - 1) if forward else \
            (stage - 1 if send else stage + 1)
    return Transfer("send" if send else "recv", "activation" if forward else "gradient",
                    mb if mb >= 0 else None, dst if send else src, peer_stage, shape)


def _runtime_transfers(step: LoggedStep, ops: list) -> list[Transfer]:
    """A multi-stage schedule: the action that posted them (`2RECV_F1`) says stage and microbatch."""
    kind, stage, mb, text = step.action or (None, None, None, "")
    ctype = re.sub(r"^\d+|\d+$", "", text or "")
    out = []
    for op, src, dst, shape in ops:
        send = op == "isend"
        forward = ctype.endswith("_F") if ctype in ("SEND_F", "SEND_B", "RECV_F", "RECV_B") else None
        peer_stage = None
        if forward is not None and stage is not None:
            peer_stage = stage + 1 if forward == send else stage - 1
        what = "activation" if forward else ("gradient" if forward is False else "tensor")
        out.append(Transfer("send" if send else "recv", what, mb, int(dst) if send else int(src), peer_stage, shape))
    return out
