"""labkit.logs against REAL logs: every fixture under tests/fixtures/pplogs/<torch>/ was printed by
ranks running with TORCH_LOGS=+pp (scripts/capture_fixtures.py). The reference is the plan: a parsed
timeline must hold exactly the actions the schedule planned, in torch's planned order per rank."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from labkit import logs
from labkit.logs.parse import _Parser
from labkit.core.actions import COMPUTE_KINDS

FIXTURES = Path(__file__).parent / "fixtures" / "pplogs"
ALL = sorted(d for d in FIXTURES.glob("*/*") if (d / "result.json").is_file())
IDS = [f"{d.parent.name}/{d.name}" for d in ALL]
RUNTIME = {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
SPLIT_BACKWARD = {"InterleavedZeroBubble", "ZBVZeroBubble"}  # I and W for every microbatch


def result(d: Path) -> dict:
    return json.loads((d / "result.json").read_text())


def capture(d: Path) -> dict:
    return json.loads((d / "capture.json").read_text())


def fixture(name: str, version: str | None = None) -> Path:
    hits = [d for d in ALL if d.name == name and (version is None or d.parent.name == version)]
    if not hits:
        pytest.skip(f"no fixture {name}")
    return hits[-1]


def rank_lines(tl, rank, kinds=COMPUTE_KINDS):
    return [(a.stage, a.kind, a.microbatch) for a in tl.actions if a.rank == rank and a.kind in kinds]


def test_fixtures_exist():
    names = {d.name for d in ALL}
    for s in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert {f"{s}-p2-m4", f"{s}-p4-m8"} <= names, s
    for s in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
        assert f"default_{s}-p2-m4" in names
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert total < 5e6, f"fixtures are {total / 1e6:.1f} MB: keep them small (gzip big logs)"


# ---------------------------------------------------------------------------------------------
# every fixture: exactly the planned actions


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_fixture_holds_planned_actions(d):
    r = result(d)
    cfg = r["config"]
    m, n_stages, steps, schedule = r["n_microbatches"], r["n_stages"], cfg["steps"], r["schedule"]
    tl = logs.timeline_from_path(d)
    assert tl.meta["steps"] == steps
    assert tl.ranks == list(range(r["pp_size"]))
    assert tl.meta["schedule"] == f"Schedule{schedule}"
    for a in tl.actions:  # every action on the rank that holds its stage
        assert a.stage in r["stage_placement"][a.rank], a
    per = Counter((a.stage, a.kind, a.microbatch) for a in tl.compute())
    kinds = {k for (_, k, _) in per}
    for s in range(n_stages):
        for mb in range(m):
            assert per[(s, "F", mb)] == steps, (s, mb)
            if r["inference"]:
                continue
            if schedule in SPLIT_BACKWARD:
                assert per[(s, "I", mb)] == per[(s, "W", mb)] == steps, (s, mb)
            elif schedule == "DualPipeV":
                # DualPipeV runs some backwards whole (B, inside OVERLAP_F_B) and splits the others.
                assert per[(s, "B", mb)] + per[(s, "I", mb)] == steps, (s, mb)
                assert per[(s, "I", mb)] == per[(s, "W", mb)], (s, mb)
            else:
                assert per[(s, "B", mb)] == steps, (s, mb)
    assert sum(per.values()) == len(tl.compute())  # nothing outside range(n_stages) x range(m)
    assert all(0 <= s < n_stages and 0 <= mb < m for (s, _, mb) in per)
    if r["inference"]:
        assert kinds == {"F"}
    elif schedule in SPLIT_BACKWARD:
        assert kinds == {"F", "I", "W"}
    elif schedule == "DualPipeV":
        assert kinds == {"F", "B", "I", "W"}
    else:
        assert kinds == {"F", "B"}


def _torch_plan(schedule: str, pp_size: int, m: int, spr: int) -> dict[int, list[tuple]]:
    """torch's own per-rank plan (compute + SEND/RECV), from its private schedule visualizer."""
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
        ops = get_schedule_ops(schedule, pp_size, m, spr, with_comms=True)
    except Exception as e:  # private API: it moves between torch versions
        pytest.skip(f"torch's schedule visualizer is not usable here: {type(e).__name__}: {e}")
    plan = {}
    for rank, actions in enumerate(ops):
        seq = []
        for a in actions:
            if a is None:
                continue
            d = logs.decode_action(str(a))
            if d is None:
                continue
            if d[4]:
                seq += [tuple((s, k, mb)) for (k, s, mb) in d[4]]
            elif d[0] in ("F", "B", "I", "W", "SEND", "RECV"):
                seq.append((d[1], d[0], d[2], d[3]))
        plan[rank] = seq
    return plan


@pytest.mark.parametrize("d", [d for d in ALL if result(d)["schedule"] in RUNTIME], ids=lambda d: d.name)
def test_runtime_fixture_follows_torchs_plan_in_order(d):
    """Multi-stage schedules: each rank ran exactly torch's planned actions, in the planned order. The
    plan is the installed torch's, so only fixtures captured with this torch (major.minor) are held to
    it: plans change between releases (2.15's ZBVZeroBubble-p4-m8 orders I/W differently from 2.13's)."""
    r = result(d)
    import torch

    here, there = torch.__version__.split("+")[0].rsplit(".", 1)[0], r["torch"].split("+")[0].rsplit(".", 1)[0]
    if here != there:
        pytest.skip(f"fixture captured with torch {r['torch']}; torch {torch.__version__} plans for its own version")
    plan = _torch_plan(r["schedule"], r["pp_size"], r["n_microbatches"], r["stages_per_rank"])
    tl = logs.timeline_from_path(d)
    for rank in tl.ranks:
        want = plan[rank] * r["config"]["steps"]
        if r["inference"]:  # the no-op backwards (and their p2p) are dropped from the timeline
            want = [w for w in want if w[1] not in ("B", "I", "W") and not (len(w) == 4 and w[3].endswith("_B"))]
        want = [w[:3] for w in want]
        got = [(a.stage, a.kind, a.microbatch) for a in tl.actions if a.rank == rank]
        assert got == want, f"rank {rank}"


def _1f1b_order(stage: int, n_stages: int, m: int) -> list[tuple]:
    """Schedule1F1B's loop: (n_stages - stage) warm-up forwards, then B/F pairs, then the last Bs."""
    warm = min(m, n_stages - stage)
    order = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        order.append(("B", b))
        b += 1
        if f < m:
            order.append(("F", f))
            f += 1
    return order


@pytest.mark.parametrize("d", [d for d in ALL if result(d)["schedule"] in ("GPipe", "1F1B")], ids=lambda d: d.name)
def test_single_stage_fixture_follows_the_loop_order(d):
    r = result(d)
    m, p, steps = r["n_microbatches"], r["n_stages"], r["config"]["steps"]
    tl = logs.timeline_from_path(d)
    for rank in tl.ranks:
        if r["schedule"] == "GPipe":
            want = [("F", i) for i in range(m)] + ([] if r["inference"] else [("B", i) for i in range(m)])
        else:
            want = _1f1b_order(rank, p, m)
        got = [(a.kind, a.microbatch) for a in tl.actions if a.rank == rank]
        assert got == want * steps, f"rank {rank}"


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_intervals_do_not_overlap_and_start_at_zero(d):
    tl = logs.timeline_from_path(d)
    sh = tl.shifted()
    assert min(a.start for a in sh.actions) == 0.0
    assert all(a.start >= 0 and a.end >= a.start for a in sh.actions)
    for rank in tl.ranks:
        acts = sorted((a for a in tl.actions if a.rank == rank), key=lambda a: (a.start, a.end))
        for prev, nxt in zip(acts, acts[1:]):
            assert nxt.start >= prev.end - 1e-9, (prev, nxt)
    # all records or only the meaningful ones (what timeline_from_path reads): the same timeline
    assert logs.to_timeline(logs.parse_run_dir(d)).actions == tl.actions
    met = tl.metrics()
    assert 0.0 <= met["bubble_fraction"] < 1.0
    assert met["n_actions"] == len(tl.compute())


@pytest.mark.parametrize("d", ALL, ids=IDS)
def test_split_waits_only_move_starts_later(d):
    fold = logs.timeline_from_path(d)
    split = logs.timeline_from_path(d, waits="split")
    assert split.meta["waits"] == "split" and fold.meta["waits"] == "fold"
    assert len(split.actions) == len(fold.actions)
    for a, b in zip(fold.actions, split.actions):
        assert (a.rank, a.stage, a.kind, a.microbatch, a.end) == (b.rank, b.stage, b.kind, b.microbatch, b.end)
        assert a.start <= b.start <= b.end
    assert split.metrics()["bubble_fraction"] >= fold.metrics()["bubble_fraction"] - 1e-12


def test_split_waits_show_the_gpipe_bubble():
    d = fixture("GPipe-p2-m4")
    events = logs.parse_run_dir(d)
    tl = logs.to_timeline(events, waits="split")
    act = {(a.rank, a.kind, a.microbatch): a for a in tl.actions}
    sends = {r: [e for e in events if e.rank == r and e.kind == "P2P"] for r in (0, 1)}
    # rank 1's first forward waits for rank 0's first send; rank 0's first backward for rank 1's
    chunk0 = next(e for e in events if e.rank == 0 and e.origin == "stage" and e.kind == "F")
    assert act[(1, "F", 0)].start == sends[0][0].time >= chunk0.time  # sent once computed
    first_grad = next(e for e in sends[1] if e.action == "SEND_B")
    assert act[(0, "B", 0)].start == first_grad.time > act[(0, "F", 3)].end
    fold = logs.to_timeline(events)
    fold_f0 = next(a for a in fold.actions if (a.rank, a.kind, a.microbatch) == (1, "F", 0))
    assert fold_f0.start < act[(1, "F", 0)].start  # folded: rank 1's wait was counted as compute
    assert tl.metrics()["bubble_fraction"] > fold.metrics()["bubble_fraction"]
    with pytest.raises(ValueError, match="waits"):
        logs.to_timeline(events, waits="hide")


@pytest.mark.parametrize("name", ["GPipe-p2-m4", "ZBVZeroBubble-p2-m4"])
def test_trim_is_split_then_trim_waits(name):
    """`waits="trim"` (what `labkit.timeline.compare.load_timeline` reads) is split, then `trim_waits`: starts
    only move later, ends stay where torch logged them."""
    from labkit.timeline.compare import load_timeline

    d = fixture(name)
    events = logs.parse_run_dir(d)
    split = logs.to_timeline(events, waits="split")
    trimmed = logs.to_timeline(events, waits="trim")
    assert trimmed.actions == logs.trim_waits(split).actions
    assert trimmed.meta["waits"].startswith("trimmed") and split.meta["waits"] == "split"
    assert all(t.start >= s.start and t.end == s.end for t, s in zip(trimmed.actions, split.actions, strict=True))
    assert load_timeline(d).actions == trimmed.actions
    assert load_timeline(d, trim=False).actions == logs.to_timeline(events).actions


# ---------------------------------------------------------------------------------------------
# both formats


PAIRS = [("default_GPipe-p2-m4", "GPipe-p2-m4"), ("default_1F1B-p2-m4", "1F1B-p2-m4"),
         ("default_Interleaved1F1B-p2-m4", "Interleaved1F1B-p2-m4"),
         ("default_ZBVZeroBubble-p2-m4", "ZBVZeroBubble-p2-m4"), ("default_DualPipeV-p2-m4", "DualPipeV-p2-m4"),
         ("default_tee_rank_1F1B-p2-m4", "1F1B-p2-m4"),
         ("default_tee_default_Interleaved1F1B-p2-m4", "Interleaved1F1B-p2-m4")]


@pytest.mark.parametrize("default_name,kit_name", PAIRS)
def test_both_formats_give_the_same_actions(default_name, kit_name):
    a = logs.timeline_from_path(fixture(default_name))
    b = logs.timeline_from_path(fixture(kit_name))
    assert a.counts() == b.counts()
    assert Counter(x.kind for x in a.actions) == Counter(x.kind for x in b.actions)
    if result(fixture(kit_name))["schedule"] != "DualPipeV":  # which backwards DualPipeV splits varies
        for rank in a.ranks:
            assert rank_lines(a, rank, ("F", "B", "I", "W", "SEND", "RECV")) == \
                rank_lines(b, rank, ("F", "B", "I", "W", "SEND", "RECV"))


def test_default_format_stream_details():
    d = fixture("default_ZBVZeroBubble-p2-m4")
    events = logs.parse_run_dir(d)
    assert {e.rank for e in events} == {0, 1}
    pids = {e.rank: set() for e in events}
    for e in events:
        pids[e.rank].add(e.pid)
    assert all(len(p) == 1 for p in pids.values()) and pids[0] != pids[1]
    # Python's logging gives whole milliseconds in torch's default format.
    assert all(abs(e.time * 1000 - round(e.time * 1000)) < 1e-3 for e in events)
    assert {e.level for e in events} <= {"D", "I", "W", "E", "C"}
    assert any(e.source.startswith("schedules.py:") for e in events)
    # Each rank's lines keep their order even when they share a millisecond.
    for rank in (0, 1):
        ts = [e.time_step for e in events if e.rank == rank and e.time_step is not None]
        assert ts == sorted(ts)


def test_doubled_and_tee_prefixes_are_real():
    text = (fixture("default_tee_rank_1F1B-p2-m4") / "combined.log").read_text()
    assert "[rank0]:[rank0]:" in text and "[rank1]:[rank1]:" in text
    text = (fixture("default_tee_default_Interleaved1F1B-p2-m4") / "combined.log").read_text()
    assert "[default0]:[rank0]:" in text


def test_event_fields_kit_format():
    d = fixture("ZBVZeroBubble-p2-m4")
    events = logs.parse_run_dir(d)
    assert {e.rank for e in events} == {0, 1}  # from the path .../attempt_0/<rank>/stderr.log
    first = events[0]
    assert first.kind == "SCHEDULE" and first.action == "ScheduleZBVZeroBubble" and first.level == "I"
    assert first.time > 1e9 and first.pid is None and first.lineno == 1
    run = [e for e in events if e.origin == "runtime"]
    assert all(e.mark == logs.START for e in run)
    done = [e for e in events if e.mark == logs.END]
    assert done and all(e.origin == "stage" and e.kind in ("F", "B") for e in done)
    # W has no line of its own: no completion says "weight"
    assert not any(e.kind == "W" and e.mark == logs.END for e in events)



@pytest.mark.parametrize("name", ["ZBVZeroBubble-p4-m8", "GPipe-p2-m4", "Interleaved1F1B-p2-m4"])
@pytest.mark.parametrize("meaning_only", [False, True])
def test_kit_format_events_match_the_line_text(name, meaning_only):
    """Every field of every kit-format event, against the line read by hand (the hot loop looks
    repeated text up in caches: this pins what it must produce, line by line, twice over)."""
    for f in logs.log_files(fixture(name)):
        lines = f.read_text().splitlines(keepends=True)
        want = []
        for n, line in enumerate(lines + lines, 1):  # the second copy is served from the caches
            stamp, level, logger, source, msg = line.rstrip("\n").split(" ", 4)
            if "pipelining" not in logger:
                continue
            meaning = logs.decode_message(msg)
            if meaning_only and meaning == (None,) * 7 + ((),):
                continue
            want.append(logs.Event(float(stamp), 3, None, level, msg, *meaning, source[:-1], n))
        got = logs.parse_lines(lines + lines, rank=3, meaning_only=meaning_only)
        assert got == want and all(type(e) is logs.Event for e in got)


@pytest.mark.parametrize("name", ["default_ZBVZeroBubble-p2-m4", "default_GPipe-p2-m4", "default_tee_rank_1F1B-p2-m4"])
@pytest.mark.parametrize("meaning_only", [False, True])
def test_default_format_events_match_the_careful_path(name, meaning_only):
    """The hot loop's cached reading of torch's default format, event by event, against the parser's
    careful line-at-a-time path (`_slow`, which the hot loop leaves other formats to)."""
    lines = (fixture(name) / "combined.log").read_text().splitlines(keepends=True)
    careful = _Parser(None, 2026)
    want = []
    for n, line in enumerate(lines + lines, 1):  # the second copy is served from the caches
        ev, _ = careful._slow(line.rstrip("\n"), n) if "pipelining" in line else (None, False)
        if ev is not None and not (meaning_only and ev.kind is None and ev.mark is None):
            want.append(ev)
    got = logs.parse_lines(lines + lines, year=2026, meaning_only=meaning_only)
    assert len(want) > 20 and got == want and all(type(e) is logs.Event for e in got)

# ---------------------------------------------------------------------------------------------
# messages


@pytest.mark.parametrize("msg,want", [
    ("_PipelineScheduleRuntime running time_step 2, action 0F1", ("F", 0, 1, "start", "runtime", 2, "0F1")),
    ("_PipelineScheduleRuntime running time_step 11, action 3I0", ("I", 3, 0, "start", "runtime", 11, "3I0")),
    ("_PipelineScheduleRuntime running time_step 13, action 3W0", ("W", 3, 0, "start", "runtime", 13, "3W0")),
    ("_PipelineScheduleRuntime running time_step 40, action 0B2", ("B", 0, 2, "start", "runtime", 40, "0B2")),
    ("_PipelineScheduleRuntime running time_step 3, action 2SEND_F0", ("SEND", 2, 0, "start", "runtime", 3, "2SEND_F0")),
    ("_PipelineScheduleRuntime running time_step 6, action 3RECV_B1", ("RECV", 3, 1, "start", "runtime", 6, "3RECV_B1")),
    ("_PipelineScheduleRuntime running time_step 0, action 0UNSHARD", ("UNSHARD", 0, None, "start", "runtime", 0, "0UNSHARD")),
    ("_PipelineScheduleRuntime running time_step 44, action 0REDUCE_GRAD",
     ("REDUCE_GRAD", 0, None, "start", "runtime", 44, "0REDUCE_GRAD")),
    ("[0] Forwarded microbatch 3", ("F", 0, 3, "end", "schedule", None, None)),
    ("[1] Backwarded microbatch 0", ("B", 1, 0, "end", "schedule", None, None)),
    ("[Stage 3] Forwarded chunk 12, outputs: Tensor(torch.Size([2, 8, 64]), grad=True, dtype=torch.float32)",
     ("F", 3, 12, "end", "stage", None, None)),
    ("[Stage 0] Backwarded chunk 2", ("B", 0, 2, "end", "stage", None, None)),
    ("Using ScheduleGPipe", ("SCHEDULE", None, None, None, None, None, "ScheduleGPipe")),
    ("Rank determined inference_mode=dynamic for 2 stage(s)", ("INIT", None, None, None, None, None, None)),
    ("batch_p2p fwd_send, [P2POp(isend pg=0, group_src=0, group_dst=1,  torch.Size([8, 2, 32]), torch.float32)]",
     (None,) * 7),
    ("[Stage 0] Sending tensor to Stage 1: torch.Size([8, 2, 32])", ("P2P", 0, None, None, "stage", None, "SEND_F")),
    ("[Stage 3] Sending gradient to Stage 2: torch.Size([8, 2, 32])", ("P2P", 3, None, None, "stage", None, "SEND_B")),
    ("[Stage 1] Grad send info: [0]", (None,) * 7),
    ("_PipelineScheduleRuntime running time_step 11, action 3I", (None, None, None, "start", "runtime", 11, "3I")),
])
def test_decode_message(msg, want):
    assert logs.decode_message(msg)[:7] == want


def test_decode_overlap():
    d = logs.decode_message("_PipelineScheduleRuntime running time_step 17, action (0F3;3B1)OVERLAP_F_B")
    assert d[0] == "OVERLAP_F_B" and d[7] == (("F", 0, 3), ("B", 3, 1))


def test_overlap_is_split_at_the_first_completion():
    d = fixture("DualPipeV-p2-m4")
    events = logs.parse_run_dir(d)
    tl = logs.to_timeline(events)
    ov = next(e for e in events if e.kind == "OVERLAP_F_B")
    (k1, s1, m1), (k2, s2, m2) = ov.sub
    a1 = next(a for a in tl.actions if (a.rank, a.stage, a.kind, a.microbatch) == (ov.rank, s1, k1, m1))
    a2 = next(a for a in tl.actions if (a.rank, a.stage, a.kind, a.microbatch) == (ov.rank, s2, k2, m2))
    done = next(e for e in events if e.rank == ov.rank and e.mark == logs.END and e.time >= ov.time
                and (e.stage, e.microbatch) == (s1, m1))
    assert a1.start == ov.time and a1.end == done.time == a2.start and a2.end >= a2.start


# ---------------------------------------------------------------------------------------------
# garbage, cut lines, continuation lines


GARBAGE = [
    "hello world, nothing to see\n",
    "pipelining is fun: running time_step 3, action 0F1 and [Stage 0] Forwarded chunk 3\n",
    "Traceback (most recent call last):\n",
    '  File "/x/torch/distributed/pipelining/schedules.py", line 2620, in _step_microbatches\n',
    "    self._comp_type_to_function_map[action.computation_type](\n",
    "RuntimeError: boom [Stage 0] Forwarded chunk 1\n",
    "/work/x.py:12: UserWarning: something odd about 0F1\n",
    "  warnings.warn(\n",
    "W1122 02:17:41.148000 3920 torch/distributed/run.py:792] Setting OMP_NUM_THREADS environment variable\n",
    "1795313848.500000 W torch.distributed.pipelining.schedules schedules.py:1808] a warning of the logger\n",
    "\n",
    "\x00\x01 binary junk \ufffd\ufffd\n",
    "x" * 5000 + "\n",
    "[rank0]:[W1122 02:17:41.000000 socket.cpp:200] [c10d] The hostname could not be resolved\n",
    "1795313848.6 D torch.distributed.pipelining.schedules schedules.py:2614] _PipelineScheduleRuntime runni\n",
]


def _mixed(lines: list[str], seed: int = 0) -> list[str]:
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        if i % 7 == seed % 7:
            out.extend(GARBAGE)
    return out


@pytest.mark.parametrize("name", ["ZBVZeroBubble-p2-m4", "GPipe-p2-m4", "DualPipeV-p2-m4"])
def test_garbage_lines_change_nothing_kit_format(name):
    d = fixture(name)
    clean = logs.timeline_from_path(d)
    events = []
    for f in logs.log_files(d):
        lines = f.read_text().splitlines(keepends=True)
        events += logs.parse_lines(_mixed(lines), rank=logs.rank_from_path(f))
    dirty = logs.to_timeline(events)
    assert dirty.actions == clean.actions


@pytest.mark.parametrize("name", ["default_1F1B-p2-m4", "default_ZBVZeroBubble-p2-m4"])
def test_garbage_lines_change_nothing_default_format(name):
    f = fixture(name) / "combined.log"
    lines = f.read_text().splitlines(keepends=True)
    clean = logs.to_timeline(logs.parse_lines(lines))
    assert logs.to_timeline(logs.parse_lines(_mixed(lines, 3))).actions == clean.actions
    # torchrun's echo and a prefix template stack prefixes in front of torch's own [rankN]:
    for extra in ("[rank{r}]:", "[default{r}]:", "[rank{r}]:[rank{r}]:", "[rank{r}:err] "):
        def add(line):
            m = re.match(r"\[rank(\d)\]:", line)
            return extra.format(r=m.group(1)) + line if m else line
        again = logs.to_timeline(logs.parse_lines([add(x) for x in lines]))
        assert again.actions == clean.actions, extra
    # CRLF line ends
    assert logs.to_timeline(logs.parse_lines([x.replace("\n", "\r\n") for x in lines])).actions == clean.actions


def test_a_cut_last_line_adds_nothing():
    f = logs.log_files(fixture("ZBVZeroBubble-p2-m4"))[0]
    lines = f.read_text().splitlines(keepends=True)
    clean = logs.parse_lines(lines, rank=0)
    base = logs.to_timeline(clean).actions
    t = float(lines[-1].split(" ", 1)[0]) + 0.001
    full = f"{t:.6f} D torch.distributed.pipelining.schedules schedules.py:2614] " \
           "_PipelineScheduleRuntime running time_step 99, action 3F12\n"
    for cut in (full[:40], full[:-3], full[:-2], full.rstrip("\n")[:-1]):  # "3F" / "3F1" / "...time_step 9"
        events = logs.parse_lines(lines + [cut], rank=0)
        assert len(events) in (len(clean), len(clean) + 1)
        assert events[-1].kind is None or len(events) == len(clean)
        assert logs.to_timeline(events).actions[:len(base)] == base
        assert Counter(a.kind for a in logs.to_timeline(events).compute()) == \
            Counter(a.kind for a in logs.to_timeline(clean).compute())
    # Lines handed over without newlines (str.splitlines()) are all whole: the last one counts.
    whole = logs.parse_lines([x.rstrip("\n") for x in lines] + [full.rstrip("\n")], rank=0)
    assert whole[-1].kind == "F" and whole[-1].microbatch == 12


def test_continuation_lines_join_their_record():
    f = logs.log_files(fixture("Interleaved1F1B-p2-m4"))[0]
    lines = f.read_text().splitlines(keepends=True)
    k = 10
    t = lines[k - 1].split(" ", 1)[0]
    err = (f"{t} E torch.distributed.pipelining.schedules schedules.py:2645]         Rank 0 Rank 1\n",
           "Step 00: 0UNSHARD 1UNSHARD\n", "Step 01: 0F0      1RECV_F0 <-- ERROR HERE\n")
    events = logs.parse_lines(lines[:k] + list(err) + lines[k:], rank=0)
    rec = next(e for e in events if e.level == "E")
    assert rec.message.endswith("Step 01: 0F0      1RECV_F0 <-- ERROR HERE") and rec.kind is None
    assert logs.to_timeline(events).actions == logs.to_timeline(logs.parse_lines(lines, rank=0)).actions


def test_yearless_stamps_cross_new_year():
    lines = ["[rank0]:V1231 23:59:59.999000 7 torch/distributed/pipelining/schedules.py:1] "
             "_PipelineScheduleRuntime running time_step 0, action 0F0\n",
             "[rank0]:V0101 00:00:00.001000 7 torch/distributed/pipelining/schedules.py:1] "
             "_PipelineScheduleRuntime running time_step 1, action 0B0\n"]
    ev = logs.parse_lines(lines, year=2025)
    assert ev[1].time - ev[0].time == pytest.approx(0.002, abs=1e-6)
    assert [e.rank for e in ev] == [0, 0]
    # interleaved ranks: a December line after a January one is still last year's
    late = lines[0].replace("[rank0]", "[rank1]").replace("59.999000", "59.998000")
    ev = logs.parse_lines([lines[0], lines[1], late, lines[1].replace("00.001000", "00.002000")], year=2025)
    assert [round(e.time - ev[0].time, 3) for e in ev] == [0.0, 0.002, -0.001, 0.003]
    assert datetime.fromtimestamp(ev[0].time).year == 2025


def test_other_logs_formats():
    # TORCH_LOGS_FORMAT="%(created).6f %(process)d %(name)s %(message)s"
    line = "1795313848.016768 4242 torch.distributed.pipelining.schedules _PipelineScheduleRuntime running " \
           "time_step 11, action 3I0\n"
    (e,) = logs.parse_lines([line], rank=2)
    assert (e.rank, e.pid, e.kind, e.stage, e.microbatch) == (2, 4242, "I", 3, 0)
    # the kit's own live stream prefix, and a string instead of lines
    text = "[rank1:err] 1795313848.016768 D torch.distributed.pipelining.stage stage.py:918] [Stage 1] " \
           "Forwarded chunk 0, outputs: x\n"
    (e,) = logs.parse_lines(text)
    assert (e.rank, e.kind, e.mark, e.origin) == (1, "F", "end", "stage")


# ---------------------------------------------------------------------------------------------
# files and directories


def test_paths_and_gz(tmp_path):
    d = fixture("Interleaved1F1B-p2-m4")
    files = logs.log_files(d)
    assert [logs.rank_from_path(f) for f in files] == [0, 1]
    assert logs.rank_from_path("/x/logs/abc/attempt_0/3/stderr.log") == 3
    assert logs.rank_from_path("rank7.log") == 7 and logs.rank_from_path("combined.log") is None
    assert logs.rank_from_path("/pool/cells/007/rank1.log") == 1  # a live-ranks cell: the name beats the folder
    clean = logs.timeline_from_path(d)
    # the same logs gzipped, and a newer attempt (a restart) that wins over attempt_0
    copy = tmp_path / "run"
    shutil.copytree(d, copy)
    for f in logs.log_files(copy):
        with open(f, "rb") as src, gzip.open(str(f) + ".gz", "wb") as dst:
            dst.write(src.read())
        f.unlink()
    assert all(f.suffix == ".gz" for f in logs.log_files(copy))
    assert logs.timeline_from_path(copy).actions == clean.actions
    shutil.copytree(copy / "logs" / "run" / "attempt_0", copy / "logs" / "run" / "attempt_1")
    assert all("attempt_1" in str(f) for f in logs.log_files(copy))
    # log files given one by one, and a single combined stream
    assert logs.timeline_from_path(logs.log_files(d)).actions == clean.actions
    comb = fixture("default_Interleaved1F1B-p2-m4") / "combined.log"
    assert logs.timeline_from_path(comb).counts() == clean.counts()
    with pytest.raises(FileNotFoundError):
        logs.timeline_from_path(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="TORCH_LOGS"):
        logs.parse_run_dir(tmp_path / "empty")


def test_steps_are_split():
    tl = logs.timeline_from_path(fixture("steps2_GPipe-p2-m4"))
    assert tl.meta["steps"] == 2 and tl.meta["timing"] == {"0": "completion", "1": "completion"}
    tl = logs.timeline_from_path(fixture("steps2_ZBVZeroBubble-p2-m4"))
    assert tl.meta["steps"] == 2 and tl.meta["timing"] == {"0": "runtime", "1": "runtime"}


def test_forward_only_runs_drop_noop_backwards():
    for name in ("inference_GPipe-p2-m4", "inference_Interleaved1F1B-p2-m4"):
        tl = logs.timeline_from_path(fixture(name))
        assert {a.kind for a in tl.compute()} == {"F"}
        assert tl.meta["notes"], "the dropped lines are reported"


# ---------------------------------------------------------------------------------------------
# throughput


def _shifted_copies(lines: list[str], n_lines: int) -> list[str]:
    out, k = [], 0
    while len(out) < n_lines:
        for line in lines:
            t, rest = line.split(" ", 1)
            out.append(f"{float(t) + 10 * k:.6f} {rest}")
        k += 1
    return out


def test_throughput_smoke():
    f = logs.log_files(fixture("ZBVZeroBubble-p2-m4"))[0]
    lines = f.read_text().splitlines(keepends=True)
    per_copy = len(logs.to_timeline(logs.parse_lines(lines, rank=0)).actions)
    copies = 200_000 // len(lines) + 1
    big = _shifted_copies(lines, copies * len(lines))
    assert len(big) >= 200_000
    t0 = time.perf_counter()
    tl = logs.to_timeline(logs.parse_lines(big, rank=0))
    dt = time.perf_counter() - t0
    assert len(tl.actions) == copies * per_copy
    assert tl.meta["steps"] == copies
    print(f"labkit.logs: {len(big):,} lines in {dt:.2f} s ({len(big) / dt:,.0f} lines/s, parse + timeline)")


# torch 2.15's runtime waits: `1WAIT_SEND_F0`, `1WAIT_SEND_B0`, `0WAIT_REDUCE_GRAD`

WAIT_FIXTURES = [d for d in ALL if result(d)["schedule"] in RUNTIME and any(
    e.action and "WAIT_" in e.action for e in logs.parse_files(logs.log_files(d)) if e.origin == "runtime")]


def test_wait_fixtures_exist_for_torch_2_15():
    assert {d.parent.name for d in WAIT_FIXTURES} >= {"2.15.0"}, "capture 2.15 fixtures (scripts/capture_fixtures.py)"


@pytest.mark.parametrize("d", WAIT_FIXTURES, ids=lambda d: f"{d.parent.name}/{d.name}")
def test_runtime_waits_are_counted_never_compute(d):
    """Each send or gradient reduction is waited for by its own action, after it, on the same rank; the
    interval model counts the waits in meta["other_actions"] and never draws them as compute, and the
    action before a wait ends where the wait begins (waiting is not work)."""
    events = logs.parse_files(logs.log_files(d))
    tl = logs.timeline_from_path(d, waits="fold")
    seen: Counter = Counter()
    for rank in tl.ranks:
        runtime = [e for e in events if e.rank == rank and e.origin == "runtime"]
        done: set = set()
        for e in runtime:
            kind, stage, mb, ctype, _ = logs.decode_action(e.action) or (None,) * 5
            seen[ctype] += 1
            if ctype in ("SEND_F", "SEND_B", "REDUCE_GRAD"):
                done.add((ctype, stage, mb))
            elif ctype in ("WAIT_SEND_F", "WAIT_SEND_B", "WAIT_REDUCE_GRAD"):
                assert (ctype[len("WAIT_"):], stage, mb) in done, (rank, e.action)
        starts = {e.time for e in runtime if e.action and "WAIT_" in e.action}
        for a in tl.actions:
            if a.rank == rank:
                assert not any(a.start < t < a.end for t in starts), (a, "spans a wait's start")
    for kind in ("SEND_F", "SEND_B", "REDUCE_GRAD"):
        assert seen[f"WAIT_{kind}"] == seen[kind] > 0, (kind, seen)
        assert tl.meta["other_actions"].get(f"WAIT_{kind}") == seen[kind]
    assert not [a for a in tl.actions if "WAIT" in a.kind]


def test_a_record_that_starts_mid_line_in_a_merged_stream_is_read():
    """One stream merging several writers (2>&1): a progress line written without its newline yet and
    another rank's record share a line (seen in torch 2.12.1's default_ZBVZeroBubble-p4-m8 capture)."""
    rec = ("[rank1]:V1125 20:22:25.210000 17703 torch/distributed/pipelining/schedules.py:2367] "
           "_PipelineScheduleRuntime running time_step 112, action 6W7\n")
    kit = "1764102145.210000 D torch.distributed.pipelining.schedules schedules.py:2367] " \
          "_PipelineScheduleRuntime running time_step 3, action 0F1\n"
    alone, = logs.parse_lines([rec], year=2026)
    merged, = logs.parse_lines(["[labkit] progress 1/1 step" + rec], year=2026)
    assert (merged.rank, merged.time_step, merged.action, merged.time) == (1, 112, alone.action, alone.time)
    assert alone.action == "6W7"
    kit_merged, = logs.parse_lines(["50% done " + kit], rank=0)
    assert (kit_merged.time, kit_merged.action, kit_merged.time_step) == (1764102145.21, "0F1", 3)
    assert logs.parse_lines(["[labkit] progress 1/1 step\n"]) == []
