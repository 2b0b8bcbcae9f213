"""Where a hung or crashed pipeline is stuck, in pipeline terms (issue 58).

Pure tests first (synthetic PP logs in the kit's format, synthetic stacks): `labkit.timeline.logged_steps`
(a rank's steps and the transfers it posted; checked against REAL fixture logs), `labkit.timeline.stuck`
(each rank's step, action, microbatch and peer; the cause), `labkit.schedules.deadlock` (an order that
cannot finish refused from the plan alone, with its wait cycle). Then the three hangs of the issue's table
launched for real (`launches`): a rank that never reaches schedule.step, ranks that ran different numbers
of steps, ranks whose schedules run different microbatch counts ("Connection closed by peer"); and on live
ranks (labkit.Ranks, the suite's warm pool): a cell past its deadline, a rank stranded, a rank that failed
while its peer blocks, each said in pipeline terms in the RanksError.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from labkit.core.errors import ConfigError
from labkit.logs.files import parse_files
from labkit.logs.parse import parse_lines
from labkit.schedules.deadlock import find_deadlock, refuse_deadlock
from labkit.schedules.orders import ScheduleError
from labkit.timeline.logged_steps import read_rank_log
from labkit.timeline.stuck import RankEnd, explain

from conftest import module_pool

FIXTURES = Path(__file__).parent / "fixtures" / "pplogs" / "2.15.0"
TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/"
SCHED = TORCH + "pipelining/schedules.py"


# ---------------------------------------------------------------------------------------------
# synthetic logs and stacks


class Log:
    """A rank's PP log in the kit's format, one line per call, a millisecond apart."""

    def __init__(self, schedule: str = "Schedule1F1B"):
        self.t = 1000.0
        self.lines: list[str] = []
        self.add("schedules", f"Using {schedule}", level="I")

    def add(self, module: str, msg: str, level: str = "D") -> "Log":
        self.t += 0.001
        self.lines.append(f"{self.t:.6f} {level} torch.distributed.pipelining.{module} {module}.py:1] {msg}\n")
        return self

    def f(self, stage: int, mb: int) -> "Log":
        return self.add("stage", f"[Stage {stage}] Forwarded chunk {mb}, outputs: Tensor(torch.Size([2, 4]))")

    def b(self, stage: int, mb: int) -> "Log":
        return self.add("stage", f"[Stage {stage}] Backwarded chunk {mb}")

    def p2p(self, desc: str, *ops: tuple[str, int, int]) -> "Log":
        text = ", ".join(f"P2POp({op} pg=0, group_src={s}, group_dst={d},  torch.Size([2, 4]), torch.float32)"
                         for op, s, d in ops)
        return self.add("schedules", f"batch_p2p {desc + ', ' if desc else ''}[{text}]")

    def run(self, step: int, action: str) -> "Log":
        return self.add("schedules", f"_PipelineScheduleRuntime running time_step {step}, action {action}")

    def read(self, rank: int):
        return read_rank_log(parse_lines(self.lines, rank=rank))


def stage0_1f1b_step(log: Log, m: int) -> Log:
    """Stage 0 of a 2-stage Schedule1F1B step with `m` microbatches, as torch 2.15 logs it."""
    log.f(0, 0).p2p("fwd_send", ("isend", 0, 1))
    for i in range(1, m):
        log.f(0, i).p2p("fwd_send_bwd_recv", ("isend", 0, 1), ("irecv", 1, 0)).b(0, i - 1)
    return log.p2p("bwd_recv", ("irecv", 1, 0)).b(0, m - 1)


def stage1_1f1b_step(log: Log, m: int) -> Log:
    """Stage 1 (the last) of the same step."""
    log.p2p("fwd_recv", ("irecv", 0, 1)).f(1, 0).b(1, 0)
    for i in range(1, m):
        log.p2p("bwd_send_fwd_recv", ("isend", 1, 0), ("irecv", 0, 1)).f(1, i).b(1, i)
    return log.p2p("bwd_send", ("isend", 1, 0))


def in_step(*inner: str, user=("/home/me/train.py", 19, "<module>")) -> list:
    """A stack inside schedule.step: `inner` pipelining functions (innermost first), then the user's line."""
    return [(SCHED, 900 + i, fn) for i, fn in enumerate(inner)] + [(SCHED, 1466, "_step_microbatches"),
                                                                   (SCHED, 1190, "step"), user]


def stalled(frames: list) -> RankEnd:
    user = next((f for f in frames if "/venv/" not in f[0]), None)
    return RankEnd("stalled", frames, user)


# ---------------------------------------------------------------------------------------------
# a rank's steps from its log, against real logs


def _fixture_log(name: str, rank: int):
    f = next((FIXTURES / name / "logs" / "run" / "attempt_0" / str(rank)).glob("stderr.log*"))
    return read_rank_log(parse_files([f]))


def test_a_real_1f1b_log_gives_one_step_and_every_transfer_its_microbatch():
    """Every receive and send of a real 1F1B step (torch 2.15, 2 stages, 4 microbatches) gets the
    microbatch it carries: each of 0..3 once per direction, from or to the neighbour stage's rank."""
    first, last = _fixture_log("1F1B-p2-m4", 0), _fixture_log("1F1B-p2-m4", 1)
    for log in (first, last):
        assert len(log.steps) == 1 and log.step.complete() and log.step.microbatches() == 4
        assert log.schedule == "Schedule1F1B"
    def moved(log, op, what):
        return sorted(t.mb for _, _, ts in log.step.posts for t in ts if (t.op, t.what) == (op, what))

    assert moved(first, "send", "activation") == moved(first, "recv", "gradient") == [0, 1, 2, 3]
    assert moved(last, "recv", "activation") == moved(last, "send", "gradient") == [0, 1, 2, 3]
    peers = {(t.peer_rank, t.peer_stage) for _, _, ts in first.step.posts for t in ts}
    assert peers == {(1, 1)}


def test_a_real_log_of_two_steps_is_cut_into_two():
    for rank in (0, 1):
        log = _fixture_log("steps2_GPipe-p2-m4", rank)
        assert len(log.steps) == 2 and all(s.complete() and s.microbatches() == 4 for s in log.steps)


def test_a_real_runtime_log_names_each_posted_transfer_by_its_action():
    log = _fixture_log("Interleaved1F1B-p2-m4", 0)
    assert log.step.runtime and log.stages == {0, 2}
    recvs = [t for _, _, ts in log.step.posts for t in ts if t.op == "recv" and t.what == "activation"]
    assert {(t.peer_stage, t.mb) for t in recvs} == {(1, mb) for mb in range(4)}  # stage 2's inputs, from stage 1


# ---------------------------------------------------------------------------------------------
# the table, read from synthetic logs


def test_a_rank_that_never_reaches_the_schedule():
    rank0 = stalled([(TORCH + "distributed_c10d.py", 4181, "all_reduce")]
                    + in_step("_initialize_pipeline_distributed_state", "_initialize_pp_stages", "_initialize_stage",
                              user=("/home/me/hang.py", 21, "<module>")))
    rank1 = stalled([("/home/me/hang.py", 7, "load_next_batch"), ("/home/me/hang.py", 24, "<module>")])
    stuck = explain({0: Log().read(0), 1: Log().read(1)}, {0: rank0, 1: rank1})
    text = stuck.text()
    assert "rank 0 waits in step 1 in the schedule's set-up (distributed_c10d.py:4181 in all_reduce)" in text
    assert "rank 1 is outside the schedule: it never entered schedule.step and is in load_next_batch (hang.py:7)" in text
    assert stuck.causes[0].startswith("rank 1 is outside the schedule while rank 0 waits for it in step 1: rank 1 "
                                      "never reached schedule.step")
    assert stuck.hung


def test_ranks_that_ran_different_numbers_of_steps():
    """Rank 0 is in its step 2 waiting for microbatch 0's gradient; rank 1 left after step 1 (evaluate)."""
    log0 = stage0_1f1b_step(Log(), 2).f(0, 0).p2p("fwd_send", ("isend", 0, 1)).f(0, 1)
    log0.p2p("fwd_send_bwd_recv", ("isend", 0, 1), ("irecv", 1, 0))
    log1 = stage1_1f1b_step(Log(), 2)
    ends = {0: stalled(in_step("_wait_batch_p2p", "_wait_and_release_fwd_send")),
            1: stalled([("/home/me/train.py", 88, "evaluate"), ("/home/me/train.py", 120, "<module>")])}
    stuck = explain({0: log0.read(0), 1: log1.read(1)}, ends)
    s0, s1 = stuck.ranks[0], stuck.ranks[1]
    assert (s0.step, s0.action, s1.step) == (2, ("B", 0, 0), 1)
    assert s0.sentence() == ("rank 0 waits in step 2, in B(stage 0, mb 0), to receive microbatch 0's gradient from "
                             "stage 1 (rank 1) and until stage 1 (rank 1) receives microbatch 1's activation")
    assert s1.sentence() == "rank 1 is outside the schedule: it left schedule.step after step 1 and is in evaluate (train.py:88)"
    assert "rank 1 left schedule.step after step 1" in stuck.causes[0] and "waits for it in step 2" in stuck.causes[0]


def test_a_send_wait_names_the_microbatch_it_sent():
    """1F1B's warm-up waits for the previous send (as seen on torch 2.15 with gloo) after a later forward."""
    log0 = stage0_1f1b_step(Log(), 2).f(0, 0).p2p("fwd_send", ("isend", 0, 1)).f(0, 1)
    ends = {0: stalled(in_step("_wait_batch_p2p", "_wait_and_release_fwd_send")),
            1: stalled([("/home/me/train.py", 88, "evaluate")])}
    s0 = explain({0: log0.read(0), 1: stage1_1f1b_step(Log(), 2).read(1)}, ends).ranks[0]
    assert s0.sentence() == "rank 0 waits in step 2, in SEND(stage 0, mb 0), until stage 1 (rank 1) receives microbatch 0's activation"


def test_a_peer_that_left_is_named_with_what_the_crashed_rank_waited_for():
    """Rank 0 built 4 microbatches, rank 1 8: rank 0 ends its step and exits; rank 1, waiting for
    microbatch 4, dies of "Connection closed by peer"."""
    log1 = Log()
    log1.p2p("fwd_recv", ("irecv", 0, 1)).f(1, 0).b(1, 0)
    for i in range(1, 4):
        log1.p2p("bwd_send_fwd_recv", ("isend", 1, 0), ("irecv", 0, 1)).f(1, i).b(1, i)
    log1.p2p("bwd_send_fwd_recv", ("isend", 1, 0), ("irecv", 0, 1))
    error = "RuntimeError: [gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:14753."
    ends = {0: RankEnd("exited", exitcode=0),
            1: RankEnd("raised", in_step("_wait_batch_p2p"), ("/home/me/train.py", 19, "<module>"), error, True, 1)}
    stuck = explain({0: stage0_1f1b_step(Log(), 4).read(0), 1: log1.read(1)}, ends)
    assert stuck.ranks[0].sentence() == "rank 0 had ended (exit code 0) after step 1 (4 microbatches per step)"
    assert stuck.ranks[1].sentence().startswith(
        "rank 1 waited in step 1, in F(stage 1, mb 4), to receive microbatch 4's activation from stage 0 (rank 0)")
    assert stuck.causes[0].startswith("rank 0 left first: it ended (exit code 0) after its step 1 (4 microbatches per "
                                      "step), while rank 1 waited in step 1 to receive microbatch 4's activation from "
                                      "stage 0 (rank 0)")
    assert any(c.startswith("the ranks' schedules differ: rank 1 waited for microbatch 4's activation from rank 0, "
                            "whose schedule runs 4 microbatches per step") for c in stuck.causes)


# ---------------------------------------------------------------------------------------------
# the other causes


def test_a_wait_cycle_among_ranks():
    """A custom order run on the runtime: rank 0 in B(0, 0) waits for stage 1's gradient, rank 1 in F(1, 1)
    for stage 0's activation."""
    log0 = Log("_PipelineScheduleRuntime").run(0, "0F0").f(0, 0).run(1, "0SEND_F0")
    log0.p2p("", ("isend", 0, 1)).run(2, "0RECV_B0").p2p("", ("irecv", 1, 0)).run(3, "0B0")
    log1 = Log("_PipelineScheduleRuntime").run(0, "1RECV_F0").p2p("", ("irecv", 0, 1)).run(1, "1F0").f(1, 0)
    log1.run(2, "1RECV_F1").p2p("", ("irecv", 0, 1)).run(3, "1F1")
    ends = {r: stalled(in_step("_wait_batch_p2p", "_step_microbatches")) for r in (0, 1)}
    stuck = explain({0: log0.read(0), 1: log1.read(1)}, ends)
    assert stuck.ranks[0].sentence() == ("rank 0 waits in step 1, in B(stage 0, mb 0), to receive microbatch 0's "
                                         "gradient from stage 1 (rank 1)")
    assert stuck.ranks[1].sentence() == ("rank 1 waits in step 1, in F(stage 1, mb 1), to receive microbatch 1's "
                                         "activation from stage 0 (rank 0)")
    assert any(c.startswith("a wait cycle: rank 0 waits for rank 1, rank 1 waits for rank 0") for c in stuck.causes)


def test_ranks_in_different_steps_and_schedule_classes_that_differ():
    log0 = stage0_1f1b_step(Log(), 2).f(0, 0).p2p("fwd_send_bwd_recv", ("isend", 0, 1), ("irecv", 1, 0))
    log1 = Log("ScheduleGPipe").p2p("fwd_recv", ("irecv", 0, 1))
    ends = {r: stalled(in_step("_wait_batch_p2p")) for r in (0, 1)}
    stuck = explain({0: log0.read(0), 1: log1.read(1)}, ends)
    text = stuck.text()
    assert "the ranks are in different steps (rank 0 in step 2, rank 1 in step 1)" in text
    assert "rank 0 built Schedule1F1B, rank 1 built ScheduleGPipe" in text


def test_microbatch_counts_that_differ_and_two_ranks_on_one_stage():
    log0, log1 = stage0_1f1b_step(Log(), 4), stage0_1f1b_step(Log(), 2)
    stuck = explain({0: log0.read(0), 1: log1.read(1)}, {0: RankEnd("exited", exitcode=0),
                                                        1: RankEnd("exited", exitcode=0)})
    text = stuck.text()
    assert "rank 0 runs 4, rank 1 runs 2 microbatches per step" in text
    assert "ranks 0, 1 all hold stage 0" in text


def test_a_job_where_every_rank_computes_is_not_called_hung():
    log = stage0_1f1b_step(Log(), 2)
    ends = {0: stalled([("/home/me/model.py", 40, "forward")] + in_step("forward_one_chunk"))}
    stuck = explain({0: log.read(0)}, ends)
    assert not stuck.hung
    assert stuck.ranks[0].sentence() == "rank 0 computes F(stage 0, mb 0) in step 2: it was working, not waiting"
    assert stuck.causes == [stuck.causes[0]] and "not a hang" in stuck.causes[0] and "raise stall=" in stuck.causes[0]


def test_without_pp_logs_the_steps_come_from_spans_and_the_rest_is_said_unknown():
    ends = {0: stalled(in_step("_wait_batch_p2p")), 1: stalled([("/home/me/train.py", 88, "evaluate")])}
    stuck = explain({}, ends, spans_done={0: 1, 1: 1})
    assert stuck.ranks[0].step == 2 and stuck.ranks[0].steps_from == "spans"
    assert stuck.ranks[1].sentence().startswith("rank 1 is outside the schedule: it left schedule.step after step 1")
    assert any("TORCH_LOGS=+pp off" in u and "rank 0" in u for u in stuck.unknown)


def test_group_ranks_are_named_by_their_global_rank():
    """A pipeline of global ranks 1 and 3 (pp x dp): the log's group_src 1 is global rank 3."""
    log = stage1_1f1b_step(Log(), 2).p2p("fwd_recv", ("irecv", 0, 1))
    log0 = Log().f(0, 0)
    stuck = explain({1: log0.read(1), 3: log.read(3)}, {3: stalled(in_step("_wait_batch_p2p"))},
                    pipelines={3: [1, 3]})
    assert "from stage 0 (rank 1)" in stuck.ranks[3].sentence()


def test_a_wait_posted_before_the_log_names_a_stage_still_names_the_peer():
    """torch 2.11's first step opens with an exchange of both ranks (a `batch_p2p` with no direction) and
    waits in `_wait_batch_p2p`: rank 0 waits in step 1 for rank 1, with no action to name."""
    log0 = Log("ScheduleGPipe").p2p("", ("isend", 0, 1), ("irecv", 1, 0))
    ends = {0: stalled(in_step("_wait_batch_p2p")), 1: stalled([("/home/me/hang.py", 26, "load_next_batch")])}
    stuck = explain({0: log0.read(0), 1: Log("ScheduleGPipe").read(1)}, ends)
    s0 = stuck.ranks[0]
    assert (s0.doing, s0.step, s0.action_words()) == ("wait", 1, "")
    assert {t.peer_rank for t in s0.waits} == {1} and "B(stage None" not in s0.sentence()
    assert stuck.causes[0].startswith("rank 1 is outside the schedule while rank 0 waits for it in step 1: rank 1 "
                                      "never reached schedule.step")


# ---------------------------------------------------------------------------------------------
# a rank outside the schedule before any wait cycle it induces (issue 63, 7a): a recorded torch 2.13 hang,
# 4 ranks of Schedule1F1B (4 microbatches), the last rank alone in an all_reduce after its step 5
# (tests/fixtures/hangs/2.13.0-allreduce-1F1B-p4-m4: each rank's pipelining lines and its stack, as
# `labkit launch ... stall=8` left them; the script is ALLREDUCE_ALONE below)

RECORDED_213 = Path(__file__).parent / "fixtures" / "hangs" / "2.13.0-allreduce-1F1B-p4-m4"


def _recorded_213():
    import json

    logs = {r: read_rank_log(parse_files([RECORDED_213 / f"rank{r}.log"])) for r in range(4)}
    ends = {}
    for r, e in json.loads((RECORDED_213 / "stacks.json").read_text()).items():
        frames = [tuple(f) for f in e["frames"]]
        ends[int(r)] = RankEnd(e["how"], frames, frames[-1])  # the script's line is each stack's outermost kept
    return logs, ends


def test_a_recorded_2_13_hang_names_the_rank_outside_the_schedule_not_a_wait_cycle():
    """torch 2.13's 1F1B waits for its previous send inline (2.15 calls `_wait_and_release_fwd_send`): rank 2,
    stage 2, had received and forwarded microbatch 1 and waits until rank 3 takes microbatch 0. It was read
    as waiting for rank 1's microbatch 1, which made ranks 1 and 2 wait for each other: "a wait cycle"."""
    logs, ends = _recorded_213()
    stuck = explain(logs, ends)
    s = stuck.ranks
    assert [s[r].step for r in range(4)] == [6, 6, 6, 5] and s[3].doing == "outside"
    assert s[2].sentence() == ("rank 2 waits in step 6, in SEND(stage 2, mb 0), until stage 3 (rank 3) receives "
                               "microbatch 0's activation")
    assert s[3].sentence() == ("rank 3 is outside the schedule: it left schedule.step after step 5 and is in "
                               "<module> (hang_allreduce.py:20)")
    assert stuck.causes[0].startswith("rank 3 is outside the schedule while rank 2 waits for it in step 6: rank 3 "
                                      "left schedule.step after step 5 and is in <module> (hang_allreduce.py:20)")
    assert not any("wait cycle" in c for c in stuck.causes) and stuck.unknown == []


def test_waits_that_go_round_in_orders_that_finish_are_no_wait_cycle():
    """The same recorded states with rank 2's wait as it was misread (for rank 1's microbatch 1): ranks 1 and 2
    seem to wait for each other, but Schedule1F1B's plan for 4 ranks and 4 microbatches finishes
    (find_deadlock), so no wait cycle is named; rank 3, outside the schedule, is still the first cause, though
    no logged wait names it: its pipeline's ranks wait in a step that needs it."""
    from dataclasses import replace

    from labkit.theory import planned_actions
    from labkit.timeline.logged_steps import Transfer
    from labkit.timeline.stuck_causes import causes

    logs, ends = _recorded_213()
    states = explain(logs, ends).ranks
    states[2] = replace(states[2], action=("F", 2, 1), waits=[Transfer("recv", "activation", 1, 1, 1, "[2, 4]", False)])
    assert find_deadlock(planned_actions("1F1B", 4, 4)) is None
    found, unknown = causes(states, logs)
    assert found[0].startswith("rank 3 is outside the schedule while ranks 0, 1, 2 wait in step 6 of its pipeline: "
                               "rank 3 left schedule.step after step 5")
    assert not any("wait cycle" in c for c in found) and unknown == []


def test_a_wait_cycle_is_named_only_when_the_orders_deadlock():
    """A custom order on the runtime (no plan the kit knows): a cycle is checked on what the ranks ran, the
    action each is blocked at and what the other waits for from it. The same waits with rank 1's read as a wait
    for microbatch 0's activation, which rank 0 has produced, do not go round: no cycle is named."""
    from dataclasses import replace

    from labkit.timeline.stuck_causes import causes

    log0 = Log("_PipelineScheduleRuntime").run(0, "0F0").f(0, 0).run(1, "0SEND_F0")
    log0.p2p("", ("isend", 0, 1)).run(2, "0RECV_B0").p2p("", ("irecv", 1, 0)).run(3, "0B0")
    log1 = Log("_PipelineScheduleRuntime").run(0, "1RECV_F0").p2p("", ("irecv", 0, 1)).run(1, "1F0").f(1, 0)
    log1.run(2, "1RECV_F1").p2p("", ("irecv", 0, 1)).run(3, "1F1")
    ends = {r: stalled(in_step("_wait_batch_p2p", "_step_microbatches")) for r in (0, 1)}
    logs = {0: log0.read(0), 1: log1.read(1)}
    states = explain(logs, ends).ranks
    assert causes(states, logs)[0][0].startswith("a wait cycle: rank 0 waits for rank 1, rank 1 waits for rank 0")
    states[1] = replace(states[1], waits=[replace(t, mb=0) for t in states[1].waits])
    found, unknown = causes(states, logs)
    assert not any("wait cycle" in c for c in found) and unknown == []


def test_a_send_wait_after_the_consumed_receive_is_read_on_every_release():
    """torch 2.13's 1F1B cool-down waits for its previous gradient send inline, after the backward that
    consumed its last receive: stage 1 of 4 (4 microbatches), after B(1, 2), waits until stage 0 takes
    microbatch 1's gradient (not for microbatch 2's gradient, which it has used)."""
    log = Log().p2p("fwd_recv", ("irecv", 0, 1)).f(1, 0).p2p("fwd_send", ("isend", 1, 2))
    log.p2p("fwd_recv", ("irecv", 0, 1)).f(1, 1).p2p("fwd_send", ("isend", 1, 2))
    log.p2p("fwd_recv", ("irecv", 0, 1)).f(1, 2)
    log.p2p("fwd_send_bwd_recv", ("isend", 1, 2), ("irecv", 2, 1)).b(1, 0)
    log.p2p("bwd_send_fwd_recv", ("isend", 1, 0), ("irecv", 0, 1)).f(1, 3)
    log.p2p("fwd_send_bwd_recv", ("isend", 1, 2), ("irecv", 2, 1)).b(1, 1)
    log.p2p("bwd_send", ("isend", 1, 0)).p2p("bwd_recv", ("irecv", 2, 1)).b(1, 2)
    s1 = explain({1: log.read(1)}, {1: stalled(in_step("_wait_batch_p2p"))}).ranks[1]
    assert s1.sentence() == ("rank 1 waits in step 1, in SEND(stage 1, mb 1), until stage 0 (rank 0) receives "
                             "microbatch 1's gradient")


# ---------------------------------------------------------------------------------------------
# a live pool's cell (labkit.Ranks): the cell's own logs, ranks that finished it or were not sent it


def test_a_cell_counts_steps_from_its_start_and_names_the_rank_that_finished_it():
    """Rank 1 stepped once and finished the cell; rank 0 waits in its second step. A rank that logged no
    line in the cell ran no step in it (every rank of a pool logs its pipelining lines)."""
    log0 = stage0_1f1b_step(Log(), 2).f(0, 0).p2p("fwd_send", ("isend", 0, 1))
    ends = {0: stalled(in_step("_wait_batch_p2p", "_wait_and_release_fwd_send", user=("<cell 7>", 3, "<module>"))),
            1: RankEnd("finished")}
    stuck = explain({0: log0.read(0), 1: stage1_1f1b_step(Log(), 2).read(1)}, ends, cell=7)
    assert stuck.text().splitlines()[0] == "In pipeline terms (steps counted from the start of cell 7):"
    assert stuck.ranks[1].sentence() == "rank 1 finished the cell after step 1 (2 microbatches per step)"
    assert stuck.causes[0].startswith("rank 1 finished the cell after step 1 while rank 0 waits for it in step 2.")
    silent = explain({}, {0: stalled(in_step("_initialize_pipeline_distributed_state")),
                          1: stalled([("<cell 7>", 2, "<module>")]), 2: RankEnd("idle")}, cell=7)
    assert silent.ranks[0].sentence().startswith("rank 0 waits in step 1 in the schedule's set-up")
    assert silent.ranks[1].sentence() == "rank 1 is outside the schedule: it never entered schedule.step and is in cell 7, line 2"
    assert silent.ranks[2].sentence() == "rank 2 was not sent the cell (exec(..., ranks=...) left it out)"
    assert silent.unknown == []  # no "TORCH_LOGS=+pp off": a pool's ranks always log


def test_a_slow_cell_is_not_called_hung_and_leaves_the_deadline_hint_to_the_pool():
    ends = {0: stalled([("/home/me/model.py", 40, "forward")] + in_step("forward_one_chunk"))}
    stuck = explain({0: stage0_1f1b_step(Log(), 2).read(0)}, ends, cell=3)
    assert not stuck.hung and stuck.causes[0].endswith("a long step is not a hang.")
    assert "stall=" not in stuck.text()  # the pool's own line says exec(..., timeout=S) or %%ranks --timeout S


def test_the_pools_stacks_and_tracebacks_are_read_as_rank_ends():
    """`labkit.ranks.failure.cell_ends`: a stack the rank sent (oldest first), a faulthandler dump (innermost
    first), a traceback; the learner's frame is the cell's line, not the kit's nor torch's."""
    from types import SimpleNamespace

    from labkit.ranks.failure import cell_ends

    KIT = Path(cell_ends.__code__.co_filename).parent.parent  # labkit/: the kit's frames are not the learner's

    sent = ('  File "<cell 4>", line 3, in <module>\n    schedule.step(x)\n'
            f'  File "{KIT}/spans/record.py", line 307, in wrapper\n    return inner(self)\n'
            f'  File "{SCHED}", line 1190, in step\n    self._step_microbatches(\n'
            f'  File "{SCHED}", line 958, in _wait_batch_p2p\n    w.wait()\n')
    dump = ("(from faulthandler: the rank could not answer, e.g. C code holding the GIL)\n"
            "Current thread 0x00007f (most recent call first):\n"
            '  File "/home/me/data.py", line 9 in load\n  File "<cell 4>", line 2 in <module>')
    tb = ('Traceback (most recent call last):\n  File "<cell 4>", line 5, in <module>\n    1 / 0\n'
          "ZeroDivisionError: division by zero\n")
    cell = SimpleNamespace(failures={2: {"error": tb}}, dead=[], results={3: None}, targets=[0, 1, 2, 3])
    ends = cell_ends(cell, {0: sent, 1: dump}, 5)
    assert ends[0].how == "stalled" and ends[0].frames[0][2] == "_wait_batch_p2p" and ends[0].user == ("<cell 4>", 3, "<module>")
    assert ends[1].frames[0] == ("/home/me/data.py", 9, "load") and ends[1].user == ("/home/me/data.py", 9, "load")
    assert (ends[2].how, ends[2].error, ends[2].user) == ("raised", "ZeroDivisionError: division by zero",
                                                          ("<cell 4>", 5, "<module>"))
    assert (ends[3].how, ends[4].how) == ("finished", "idle")


def test_traceback_frames_are_read_innermost_first():
    from labkit.launching.diagnose import traceback_frames

    text = textwrap.dedent("""\
        1.0 D torch.distributed.pipelining.schedules schedules.py:855] batch_p2p fwd_recv, []
        Traceback (most recent call last):
          File "/home/me/train.py", line 19, in <module>
            schedule.step(x)
          File "/venv/torch/distributed/pipelining/schedules.py", line 958, in _wait_batch_p2p
            w.wait()
        RuntimeError: Connection closed by peer
        """)
    frames, error = traceback_frames(text)
    assert frames == [("/venv/torch/distributed/pipelining/schedules.py", 958, "_wait_batch_p2p"),
                      ("/home/me/train.py", 19, "<module>")]
    assert error == "RuntimeError: Connection closed by peer"


# ---------------------------------------------------------------------------------------------
# an order that deadlocks, refused from the plan alone


DEADLOCK = {0: "0F0 0B0 0F1 0B1".split(), 1: "1F0 1F1 1B0 1B1".split()}  # notebook 08, section 3


def test_a_deadlocking_order_gives_its_wait_cycle():
    found = find_deadlock(DEADLOCK)
    assert found.cycle == [0, 1, 0]
    assert found.hops[0] == "rank 0 waits, at B(stage 0, mb 0), for stage 1's B of microbatch 0 (rank 1)"
    assert found.hops[1] == "rank 1 waits, at F(stage 1, mb 1), for stage 0's F of microbatch 1 (rank 0)"
    assert "a wait cycle: rank 0 waits" in found.text() and "Reorder the actions" in found.text()
    with pytest.raises(ScheduleError, match="a wait cycle"):
        refuse_deadlock(DEADLOCK, where="my.csv")


def test_a_rank_that_waits_for_itself_and_ranks_whose_plans_disagree():
    own = find_deadlock({0: ["0F0", "0B0"], 1: ["1B0", "1F0"]})
    assert own.cycle == [1, 1] and "which it plans itself later (position 1)" in own.text()
    from labkit.theory import planned_actions

    four, eight = planned_actions("1F1B", 2, 4), planned_actions("1F1B", 2, 8)
    mixed = find_deadlock({0: four[0], 1: eight[1]})
    assert mixed.cycle == [] and mixed.waits_for == {1: None}
    assert "rank 1 waits, at F(stage 1, mb 4), for stage 0's F of microbatch 4, which no rank plans" in mixed.text()
    assert "the ranks' orders disagree" in mixed.text()


@pytest.mark.parametrize("schedule,p,m,spr", [("GPipe", 2, 4, 1), ("1F1B", 4, 8, 1), ("Interleaved1F1B", 2, 4, 2),
                                               ("ZBVZeroBubble", 2, 4, 2)])
def test_every_planned_schedule_finishes(schedule, p, m, spr):
    from labkit.theory import planned_actions

    assert find_deadlock(planned_actions(schedule, p, m, spr)) is None


def test_the_simulator_says_the_same_cycle():
    from labkit.theory import ScheduleDeadlock, simulate_order

    with pytest.raises(ScheduleDeadlock) as e:
        simulate_order(DEADLOCK, n_stages=2, n_microbatches=2)
    assert e.value.deadlock.cycle == [0, 1, 0]


def test_a_deadlocking_schedule_csv_is_refused_before_the_run(tmp_path):
    from labkit.config.run import validate_order_csv

    csv = tmp_path / "order.csv"
    csv.write_text("".join(",".join(row) + "\n" for row in DEADLOCK.values()))
    with pytest.raises(ConfigError) as e:
        validate_order_csv(str(csv), 2, 2, None)
    assert "cannot run: This order deadlocks" in str(e.value)
    assert "rank 0 waits, at B(stage 0, mb 0), for stage 1's B of microbatch 0 (rank 1)" in str(e.value)
    csv.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    validate_order_csv(str(csv), 2, 2, None)  # one that finishes is accepted


def test_the_custom_schedule_script_refuses_a_deadlocking_csv(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "custom_schedule", Path(__file__).parent.parent / "notebooks" / "scripts" / "custom_schedule.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    csv = tmp_path / "order.csv"
    csv.write_text("".join(",".join(row) + "\n" for row in DEADLOCK.values()))
    with pytest.raises(ValueError, match="a wait cycle: rank 0 waits"):
        script.read_order(csv, 2)


# ---------------------------------------------------------------------------------------------
# the three hangs, launched (2 gloo ranks, a 2-stage Schedule1F1B of two Linear layers)

_HEAD = textwrap.dedent("""
    import sys, time
    import torch, torch.nn as nn
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    def load_next_batch():
        while True:  # a data loader waiting for a file that never comes
            time.sleep(0.05)

    def evaluate():
        while True:  # an evaluation loop that only rank 1 runs, and never leaves
            time.sleep(0.05)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stage = PipelineStage(full[rank], rank, 2, torch.device("cpu"))
    loss = lambda out, target: ((out - target) ** 2).mean()
""")

NEVER_REACHED = _HEAD + textwrap.dedent("""
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss)
    print("ready", flush=True)
    if rank == 0:
        schedule.step(torch.randn(8, 4))
    else:
        target = load_next_batch()
        schedule.step(target=target)
""")

STEPS_DIFFER = _HEAD + textwrap.dedent("""
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss)
    print("ready", flush=True)
    for step in range(2 if rank == 0 else 1):
        schedule.step(torch.randn(8, 4)) if rank == 0 else schedule.step(target=torch.randn(8, 4))
        print("step", step, flush=True)
    if rank == 1:
        evaluate()
""")

MICROBATCHES_DIFFER = _HEAD + textwrap.dedent("""
    m = 4 if rank == 0 else 8  # the bug: each rank its own n_microbatches (same microbatch size)
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss)
    print("ready", flush=True)
    schedule.step(torch.randn(2 * m, 4)) if rank == 0 else schedule.step(target=torch.randn(2 * m, 4))
    print("done", flush=True)
    dist.destroy_process_group()
""")


ALLREDUCE_ALONE = textwrap.dedent("""
    import torch, torch.nn as nn
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world)])
    stage = PipelineStage(full[rank], rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    print("ready", flush=True)
    for step in range(1, 11):
        if rank == 0:
            schedule.step(torch.randn(8, 4))
        elif rank == world - 1:
            schedule.step(target=torch.randn(8, 4))
        else:
            schedule.step()
        if rank == world - 1 and step % 5 == 0:
            dist.all_reduce(torch.ones(1))  # the bug: a collective only the last rank joins
    print("done", flush=True)
""")


def _launch_failing(path, runs, nproc=2, **kw):
    from labkit.launching.launch import LaunchError, launch

    with pytest.raises(LaunchError) as e:
        launch(path, nproc=nproc, runs_root=runs, progress=False, stream="none", timeout=240, **kw)
    print(e.value)  # what a learner reads (pytest -s shows it)
    return str(e.value), e.value.run


def _timeline_stderr(run, capsys) -> str:
    from labkit.cli import main

    capsys.readouterr()
    main(["timeline", str(run.run_dir)])
    return capsys.readouterr().err


@pytest.mark.launches
def test_launched_a_rank_that_never_reaches_the_schedule(tmp_path, runs, capsys):
    (tmp_path / "hang_never.py").write_text(NEVER_REACHED)
    msg, run = _launch_failing(tmp_path / "hang_never.py", runs, stall=8)
    assert "rank 0 waits in step 1 in the schedule's set-up (" in msg
    assert "rank 1 is outside the schedule: it never entered schedule.step and is in load_next_batch (hang_never.py:" in msg
    assert "Cause: rank 1 is outside the schedule while rank 0 waits for it in step 1" in msg
    assert "Raise stall= (--stall)" in msg  # stall stays opt-in and says how to raise it
    assert run.where_stuck().causes == _read_back_causes(run)
    assert "rank 1 is outside the schedule: it never entered schedule.step" in _timeline_stderr(run, capsys)


def _read_back_causes(run):
    """The same reading from the run directory alone (what an old run gives back)."""
    from labkit.launching.rundir import Run

    return Run.read(run.run_dir).where_stuck().causes


@pytest.mark.launches
def test_launched_ranks_that_ran_different_numbers_of_steps(tmp_path, runs, capsys):
    (tmp_path / "hang_steps.py").write_text(STEPS_DIFFER)
    msg, run = _launch_failing(tmp_path / "hang_steps.py", runs, stall=8)
    stuck = run.where_stuck()
    assert stuck.ranks[0].sentence().startswith("rank 0 waits in step 2, in ") and "(rank 1)" in stuck.ranks[0].sentence()
    assert stuck.ranks[1].sentence().startswith(
        "rank 1 is outside the schedule: it left schedule.step after step 1 and is in evaluate (hang_steps.py:")
    assert stuck.ranks[0].sentence() in msg and stuck.ranks[1].sentence() in msg
    assert "Cause: rank 1 is outside the schedule while rank 0 waits for it in step 2" in msg
    err = _timeline_stderr(run, capsys)
    assert "this run did not finish (status timeout" in err and stuck.ranks[1].sentence() in err


@pytest.mark.launches
def test_launched_4_ranks_where_the_last_is_alone_in_an_all_reduce(tmp_path, runs):
    """Issue 63, 7a: the cause is the rank outside the schedule, never a wait cycle, on every release (torch
    2.13 read rank 2's wait for its previous send as a wait for rank 1, and named a cycle of ranks 1 and 2)."""
    (tmp_path / "hang_allreduce.py").write_text(ALLREDUCE_ALONE)
    msg, run = _launch_failing(tmp_path / "hang_allreduce.py", runs, nproc=4, stall=8)
    stuck = run.where_stuck()
    assert [stuck.ranks[r].step for r in range(4)] == [6, 6, 6, 5]
    assert stuck.ranks[3].sentence().startswith(
        "rank 3 is outside the schedule: it left schedule.step after step 5 and is in <module> (hang_allreduce.py:")
    assert stuck.causes[0].startswith("rank 3 is outside the schedule while rank 2 waits for it in step 6: rank 3 "
                                      "left schedule.step after step 5")
    assert "Cause: rank 3 is outside the schedule while rank 2 waits for it in step 6" in msg
    assert "wait cycle" not in msg and stuck.causes == _read_back_causes(run)


def test_the_stack_dump_freezes_every_worker_first_and_aims_each_abort_at_its_main_thread(monkeypatch):
    """labkit.launching.stop.dump_all's order: SIGSTOP to every worker, SIGABRT to each one's main thread (tgkill,
    the main thread's id is the pid), SIGCONT to every worker; where no signal can be aimed at a thread, SIGABRT
    to each as before. And the tgkill it finds, from the C library or as a raw system call, reaches this process."""
    import os
    import platform
    import signal

    from labkit.launching import stop

    class Worker:
        def __init__(self, pid):
            self.pid = pid

        def status(self):
            return "stopped"

        def is_running(self):
            return True

    sent = []
    monkeypatch.setattr(stop, "_each", lambda ws, sig: sent.append((sig, [w.pid for w in ws])))
    monkeypatch.setattr(stop, "_tgkill", lambda: lambda tgid, tid, sig: sent.append(("tgkill", tgid, tid, sig)))
    stop.dump_all([Worker(11), Worker(12)])
    assert sent == [(signal.SIGSTOP, [11, 12]), ("tgkill", 11, 11, signal.SIGABRT), ("tgkill", 12, 12, signal.SIGABRT),
                    (signal.SIGCONT, [11, 12])]
    sent.clear()
    monkeypatch.setattr(stop, "_tgkill", lambda: None)
    stop.dump_all([Worker(11), Worker(12)])
    assert sent == [(signal.SIGABRT, [11, 12])]
    monkeypatch.undo()
    if platform.system() == "Linux":
        assert stop._tgkill()(os.getpid(), os.getpid(), 0) == 0  # signal 0: the thread exists, nothing sent
        if platform.machine() in stop._TGKILL_SYSCALL:
            import ctypes

            raw = ctypes.CDLL(None).syscall(stop._TGKILL_SYSCALL[platform.machine()], os.getpid(), os.getpid(), 0)
            assert raw == 0


@pytest.mark.launches
def test_each_ranks_stack_is_where_it_was_stuck_however_slowly_the_ranks_are_stopped(tmp_path, runs, monkeypatch):
    """The stacks are taken with every rank frozen, each SIGABRT aimed at its rank's main thread: however long
    the stopper takes between two ranks (here 0.4 s, as a stopper descheduled on a busy machine), no rank's
    dump shows what an earlier rank's death did to it. Sent one by one to running ranks, rank 0 died first and
    rank 3's all_reduce failed and unwound out of the script before its own dump (`rank_main (warm.py)`)."""
    import signal
    import time

    from labkit.launching import stop
    from labkit.launching.diagnose import rank_ends

    each = stop._each

    def slowly(workers, sig):
        for w in workers:
            each([w], sig)
            if sig == signal.SIGCONT:
                time.sleep(0.4)

    monkeypatch.setattr(stop, "_each", slowly)
    (tmp_path / "hang_allreduce.py").write_text(ALLREDUCE_ALONE)
    msg, run = _launch_failing(tmp_path / "hang_allreduce.py", runs, nproc=4, stall=8)
    ends = rank_ends(run)
    for r in range(4):  # each dumped while it ran, the script's own line innermost of its code
        assert ends[r].how == "stalled" and ends[r].user and ends[r].user[0].endswith("hang_allreduce.py"), ends[r]
    stuck = run.where_stuck()
    assert stuck.ranks[3].sentence().startswith(
        "rank 3 is outside the schedule: it left schedule.step after step 5 and is in <module> (hang_allreduce.py:")
    assert "warm.py" not in msg


@pytest.mark.launches
def test_launched_ranks_whose_microbatch_counts_differ(tmp_path, runs):
    (tmp_path / "hang_mbs.py").write_text(MICROBATCHES_DIFFER)
    msg, run = _launch_failing(tmp_path / "hang_mbs.py", runs)
    assert msg.startswith("Rank 1 failed: RuntimeError:") and "by peer" in msg.splitlines()[0]
    assert "rank 0 had ended (exit code 0) after step 1 (4 microbatches per step)" in msg
    assert ("Cause: rank 0 left first: it ended (exit code 0) after its step 1 (4 microbatches per step), while rank 1 "
            "waited in step 1 to receive microbatch 4's activation from stage 0 (rank 0)") in msg
    assert ("Cause: the ranks' schedules differ: rank 1 waited for microbatch 4's activation from rank 0, whose "
            "schedule runs 4 microbatches per step (0-3)") in msg


# ---------------------------------------------------------------------------------------------
# the same reading on live ranks (labkit.Ranks): a cell that hangs, or leaves a rank blocked, is said in
# pipeline terms in the RanksError, from that cell's own PP logs and the stacks the pool took

pool = module_pool(2)

_CELL_BUILD = textwrap.dedent("""
    import time
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stage = PipelineStage(full[rank], rank, world_size, device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    def step():
        schedule.step(torch.randn(8, 4)) if rank == 0 else schedule.step(target=torch.randn(8, 4))
    def load_next_batch():
        raise ValueError("no batch")
""")


def _cell_error(pool, code: str, **kw):
    from labkit.ranks import RanksError

    with pytest.raises(RanksError) as e:
        pool.exec(_CELL_BUILD + code, **kw)
    print(e.value)  # what a learner reads (pytest -s shows it)
    return str(e.value), e.value


@pytest.mark.launches
def test_live_ranks_where_one_rank_steps_once_and_the_other_twice(pool):
    """Rank 1 ends the cell after one step while rank 0 waits in its second: stranded, said in pipeline terms,
    released (no restart)."""
    msg, e = _cell_error(pool, "for _ in range(2 if rank == 0 else 1):\n    step()")
    n = e.cell
    assert f"In pipeline terms (steps counted from the start of cell {n}):" in msg
    assert "  rank 0 waits in step 2" in msg and "(rank 1)" in msg.split("  rank 0 waits in step 2")[1].splitlines()[0]
    assert "  rank 1 finished the cell after step 1 (4 microbatches per step)" in msg
    assert "Cause: rank 1 finished the cell after step 1 while rank 0 waits for it in step 2." in msg
    assert not e.restarted and "The pool released rank 0" in msg


@pytest.mark.launches
def test_live_ranks_where_a_rank_fails_before_the_step_while_its_peer_blocks(pool):
    msg, e = _cell_error(pool, "if rank == 1:\n    load_next_batch()\nstep()")
    n = e.cell
    assert "Rank 0 did not finish within 3 s after rank 1 failed" in msg  # the pool's own words, kept
    assert "  rank 0 waits in step 1" in msg
    assert (f"  rank 1 is outside the schedule: it never entered schedule.step and is in load_next_batch (cell {n}, "
            f"line 12); it failed with ValueError: no batch") in msg
    assert "Cause: rank 1 is outside the schedule while rank 0 waits for it in step 1" in msg
    assert not e.restarted


@pytest.mark.launches
def test_live_ranks_where_rank_1_skips_the_step_and_the_cell_times_out(pool):
    """The issue's first hang on live ranks: rank 1 never reaches schedule.step (here it sleeps), the cell's
    deadline passes; rank 1 is not in torch.distributed, so the pool restarts, as before."""
    msg, e = _cell_error(pool, "if rank == 1:\n    time.sleep(600)\nstep()", timeout=3)
    n = e.cell
    assert f"Cell {n} did not finish within its 3 s deadline on ranks 0, 1" in msg
    assert f"In pipeline terms (steps counted from the start of cell {n}):" in msg
    assert "  rank 0 waits in step 1" in msg
    assert f"  rank 1 is outside the schedule: it never entered schedule.step and is in cell {n}, line 14" in msg
    assert (f"Cause: rank 1 is outside the schedule while rank 0 waits for it in step 1: rank 1 never reached "
            f"schedule.step and is in cell {n}, line 14.") in msg
    assert msg.index("Where each rank was:") < msg.index("In pipeline terms") < msg.index("--timeout")
    assert e.restarted and pool.exec("rank") == {0: 0, 1: 1}


# ---------------------------------------------------------------------------------------------
# the timeline of a hang: the last actions drawn, each rank's open action marked


def test_the_last_actions_before_a_hang_are_drawn_and_each_open_action_marked(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.core.actions import Action, Timeline
    from labkit.timeline.stuck_plot import plot_stuck

    log0 = stage0_1f1b_step(Log(), 2).f(0, 0).p2p("fwd_send", ("isend", 0, 1)).f(0, 1)
    ends = {0: stalled(in_step("_wait_batch_p2p", "_wait_and_release_fwd_send")),
            1: stalled([("/home/me/train.py", 88, "evaluate")])}
    stuck = explain({0: log0.read(0), 1: stage1_1f1b_step(Log(), 2).read(1)}, ends)
    acts = [Action(0, 0, mb, k, 1000.0 + i * 0.01, 1000.0 + i * 0.01 + 0.008) for i, (k, mb) in
            enumerate([("F", 0), ("F", 1), ("B", 0), ("B", 1), ("F", 0), ("F", 1)])]
    acts += [Action(1, 1, mb, k, 1000.005 + i * 0.01, 1000.005 + i * 0.01 + 0.004) for i, (k, mb) in
             enumerate([("F", 0), ("B", 0), ("F", 1), ("B", 1)])]
    fig, ax = plt.subplots()
    artists = plot_stuck(ax, stuck, Timeline(acts, source="measured"), last=3)
    labels = [t.get_text() for t in ax.texts]
    assert "SEND(stage 0, mb 0) waits: send mb 0 activation to rank 1 " in labels
    assert "outside the schedule: evaluate (train.py:88) " in labels
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0, step 2", "rank 1, step 1"]
    bars = [a for a in artists if a.__class__.__name__ == "PolyCollection" or hasattr(a, "get_paths")]
    assert len(bars) >= 3 + 3 + 2  # 3 last actions per rank, and one open action each
    fig.savefig(tmp_path / "hang.png")
    plt.close(fig)
