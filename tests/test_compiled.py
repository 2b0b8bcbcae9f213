"""What torch.compile actually ran (labkit.spans.compiled): dynamo's counts over a window, read from
synthetic snapshots (no process, no compile), carried on a step's spans line into a timeline's
`meta["compile"]` and an idle report's words; and on a live 2-rank Schedule1F1B step, a compiled stage
that ran compiled against one that recompiled past a limit of 1 and fell back to eager. A stage that fell
back keeps saying so in every later cell and step until it compiles again (issue 57: what ran, in every
cell and step), with no dynamo count moving then."""

from __future__ import annotations

import sys

import pytest

from conftest import module_pool
from labkit.spans import compile_notes, compiled, explain_idle_spans, read_spans, timeline_from_spans
from labkit.spans import recorder as recorder_mod

LIMIT_TEXT = ("Dynamo recompile limit exceeded\n  Explanation: ... exceeding the recompile_limit cache size limit "
              "(currently set to 8). ...\n\n  Developer debug context: Limit type: recompile_limit")


def state(total=0, ok=0, graphs=0, breaks=0, compiles=None, hits=None, limits=None) -> dict:
    """A snapshot as `labkit.versions.dynamo_counters` gives it."""
    return {"frames_total": total, "frames_ok": ok, "graphs": graphs, "graph_breaks": breaks,
            "compiles": dict(compiles or {}), "limit_hits": dict(hits or {}), "limits": dict(limits or {})}


def test_a_window_counts_compiles_recompiles_breaks_and_frames_at_the_limit():
    before = state(total=2, ok=2, graphs=2, compiles={0: 1, 1: 1})
    # frame 0 recompiled 7 times, then met the limit (one more attempt, not compiled); frame 2 is new,
    # compiled as 2 graphs around a break; frame 3 could not be compiled at all
    after = state(total=13, ok=11, graphs=12, breaks=1, compiles={0: 9, 1: 1, 2: 1, 3: 1},
                  hits={"recompile_limit": 1}, limits={"recompile_limit": 8})
    d = compiled.delta(before, after)
    assert d == {"frames": 9, "graphs": 10, "graph_breaks": 1, "recompiles": 7, "fell_back": 2, "at_limit": 1,
                 "limit_name": "recompile_limit", "limit": 8}
    assert compiled.delta(after, after) == compiled.zero() and not compiled.any_counts(compiled.zero())
    assert compiled.delta(None, None) == compiled.zero()  # dynamo never imported: nothing to count
    assert compiled.delta(None, state(total=1, ok=1, graphs=1, compiles={0: 1}))["frames"] == 1


def test_a_reset_in_the_window_counts_what_came_after_it():
    """torch._dynamo.reset() empties the per-frame counter and the graph-break list (frame ids start
    again at 0); the counters go on."""
    before = state(total=5, ok=5, graphs=6, breaks=3, compiles={0: 3, 1: 1, 2: 1})
    after = state(total=7, ok=7, graphs=8, breaks=1, compiles={0: 2})  # frame 0 compiled, then recompiled once
    d = compiled.delta(before, after)
    assert (d["frames"], d["graphs"], d["graph_breaks"], d["recompiles"]) == (2, 2, 1, 1)


def test_windows_add_and_travel_as_floats():
    a = compiled.delta(state(), state(total=1, ok=1, graphs=1, compiles={0: 1}))
    b = compiled.delta(state(total=1, ok=1, graphs=1, compiles={0: 1}),
                       state(total=2, ok=1, graphs=1, compiles={0: 2}, hits={"recompile_limit": 1},
                             limits={"recompile_limit": 1}))
    both = compiled.add(a, b)
    assert both == {"frames": 1, "graphs": 1, "graph_breaks": 0, "recompiles": 0, "fell_back": 1, "at_limit": 1,
                    "limit_name": "recompile_limit", "limit": 1}
    assert compiled.from_floats(compiled.as_floats(both)) == both
    assert compiled.from_floats(compiled.as_floats(a)) == a  # no limit met: no limit fields


def test_no_dynamo_no_work(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    assert compiled.snapshot() is None


def test_the_notes_say_where_a_compiled_stage_ran_eagerly():
    per_rank = {"0": {"frames": 2, "graphs": 2, "graph_breaks": 0, "recompiles": 0, "fell_back": 0, "at_limit": 0},
                "1": {"frames": 8, "graphs": 9, "graph_breaks": 1, "recompiles": 7, "fell_back": 4, "at_limit": 3,
                      "limit_name": "recompile_limit", "limit": 8}}
    notes = compile_notes(per_rank)
    assert notes[0] == ("rank 1: 3 frames recompiled until dynamo's limit (torch._dynamo.config.recompile_limit = 8) "
                        "and then ran eagerly: the compiled code never ran for inputs that needed a new version "
                        "(raise the limit, or make what changes a tensor or dynamic)")
    assert notes[1].startswith("rank 1: 1 frame that dynamo could not compile ran eagerly")
    assert notes[2].startswith("rank 1: 7 recompiles (a guard failed")
    assert notes[3].startswith("rank 1: 1 graph break: ")
    assert compile_notes(per_rank, fell_back_only=True) == notes[:2]
    assert compile_notes({0: per_rank["0"]}) == [] and compile_notes(None) == []


def test_a_step_carries_its_counts_into_the_timeline_and_the_idle_report(tmp_path, monkeypatch):
    snaps = iter([state(),  # the recorder's start
                  state(total=2, ok=1, graphs=1, compiles={0: 2}, hits={"recompile_limit": 1},
                        limits={"recompile_limit": 1}),  # after step 0: compiled once, then met the limit
                  state(total=2, ok=1, graphs=1, compiles={0: 2}, hits={"recompile_limit": 1},
                        limits={"recompile_limit": 1})])  # after step 1: nothing new (it just ran eagerly)
    monkeypatch.setattr(compiled, "snapshot", lambda: next(snaps))
    r = recorder_mod.Recorder(tmp_path / "rank1.jsonl", rank=1)
    for step in range(2):
        r.begin_step("Schedule1F1B")
        r.add("F", 1, 0, 10.0 * step, 10.0 * step + 1.0)
        r.add("B", 1, 0, 10.0 * step + 2.0, 10.0 * step + 3.0)
        r.end_step()
    _, meta = read_spans(tmp_path)
    assert list(meta[1]["compile"]) == [0]  # only the step in which dynamo did something says so
    tl = timeline_from_spans(tmp_path)
    assert tl.meta["compile"] == {"1": {"frames": 1, "graphs": 1, "graph_breaks": 0, "recompiles": 0, "fell_back": 1,
                                        "at_limit": 1, "limit_name": "recompile_limit", "limit": 1}}
    assert "compile" not in timeline_from_spans(tmp_path, which="last").meta  # the last step compiled nothing
    # ... but the frame still runs eagerly there: the idle report of the last step says so
    text = explain_idle_spans(tmp_path).text()
    assert ("torch.compile, rank 1: 1 frame recompiled until dynamo's limit (torch._dynamo.config.recompile_limit "
            "= 1) and then ran eagerly") in text


class _Module:
    def __init__(self, compiled_):
        self.compiled = compiled_


class _Stage:
    """What the recorder reads of a stage: its index and its module (compiled or not)."""

    def __init__(self, index, module):
        self.stage_index, self.submod = index, module


def test_a_stage_that_fell_back_keeps_saying_so_until_it_compiles_again(tmp_path, monkeypatch):
    """Four cells on rank 1 (the recorder carries on from one cell's file to the next): cell 1 compiles
    stage 1, 4 frames dynamo cannot compile fall back; cell 2 moves no count (the frames just run
    eagerly) but says stage 1 still runs eagerly since cell 1; cell 3 compiles again without falling
    back: compiled; cell 4 runs an eager stage 1: nothing compiled, no `compile` at all."""
    fell = state(total=6, ok=2, graphs=2, compiles={0: 1, 1: 1})
    snaps = iter([state(), state(),          # the recorder's start, cell 1's file
                  fell, fell, fell,          # cell 1's step; cell 2's file and step (nothing moved)
                  fell, state(total=1, ok=1, graphs=1, compiles={0: 1}),  # cell 3: reset, compiled again
                  state(total=1, ok=1, graphs=1, compiles={0: 1}), state(total=1, ok=1, graphs=1, compiles={0: 1}),
                  state(total=1, ok=1, graphs=1, compiles={0: 1})])
    monkeypatch.setattr(compiled, "snapshot", lambda: next(snaps))
    monkeypatch.setattr(compiled, "is_compiled", lambda m: m.compiled)
    r = recorder_mod.Recorder(None, rank=1)
    kept = _Stage(1, _Module(True))  # one compiled stage, kept over cells 1-3; cell 4 runs a new, eager one
    for cell, stage in ((1, kept), (2, kept), (3, kept), (4, _Stage(1, _Module(False)))):
        r.use_file(tmp_path / f"{cell:03d}" / "rank1.jsonl", f"cell {cell}")
        r.begin_step("Schedule1F1B")
        for kind, t in (("F", 0.0), ("B", 2.0)):
            r.saw_stage(stage)
            r.add(kind, 1, 0, 10.0 * cell + t, 10.0 * cell + t + 1.0)
        r.end_step()
    r.use_file(None)
    metas = [timeline_from_spans(tmp_path / f"{cell:03d}").meta.get("compile") for cell in (1, 2, 3, 4)]
    eager = {"ran": "eager", "since": "cell 1", "why": "dynamo could not compile 4 frames"}
    assert metas[0]["1"]["fell_back"] == 4 and metas[0]["1"]["stages"] == {"1": eager}
    assert metas[1] == {"1": {**compiled.zero(), "stages": {"1": eager}}}  # no count moved: still eager
    assert compiled.stage_notes(metas[1]) == ["rank 1: stage 1 runs eagerly since cell 1: dynamo could not "
                                              "compile 4 frames"]
    assert compile_notes(metas[1], fell_back_only=True) == compiled.stage_notes(metas[1])
    assert "torch.compile, rank 1: stage 1 runs eagerly since cell 1" in explain_idle_spans(tmp_path / "002").text()
    assert metas[2]["1"]["stages"] == {"1": {"ran": "compiled", "since": "cell 3"}}
    assert compiled.stage_notes(metas[2]) == ["rank 1: stage 1 runs compiled (since cell 3)"]
    assert compiled.ran_compiled(metas[2]) == {"1": {"1": True}}
    assert compiled.ran_compiled(metas[1]) == {"1": {"1": False}}
    assert compile_notes(metas[2], fell_back_only=True) == []
    assert metas[3] is None and compiled.ran_compiled(metas[3]) is None  # nothing compiled: None
    # a job's steps (no cell): since the step it fell back in
    assert compiled.stage_state({0: _Stage(0, _Module(True))}, compiled.delta(state(), fell), "step 3") == \
        {"0": {**eager, "since": "step 3"}}
    # an eager stage run between two cells of a compiled one (notebook 14's rounds) leaves its state alone
    other = _Stage(1, _Module(True))
    compiled.stage_state({1: other}, compiled.delta(state(), fell), "cell 5")
    assert compiled.stage_state({1: _Stage(1, _Module(False))}, compiled.zero(), "cell 6") == {}
    assert compiled.stage_state({1: other}, compiled.zero(), "cell 7") == {"1": {**eager, "since": "cell 5"}}


def test_is_compiled_sees_both_ways_of_compiling():
    import torch
    from torch import nn

    assert not compiled.is_compiled(nn.Linear(2, 2)) and not compiled.is_compiled(None)
    assert compiled.is_compiled(torch.compile(nn.Linear(2, 2), backend="eager"))
    inner = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    inner[0].compile(backend="eager")  # in place, inside the stage's module
    assert compiled.is_compiled(inner)


def test_an_eager_step_records_no_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(compiled, "snapshot", lambda: None)
    r = recorder_mod.Recorder(tmp_path / "rank0.jsonl", rank=0)
    r.begin_step("ScheduleGPipe")
    r.add("F", 0, 0, 0.0, 1.0)
    r.end_step()
    assert "compile" not in read_spans(tmp_path)[1][0] and "compile" not in timeline_from_spans(tmp_path).meta
    assert explain_idle_spans(tmp_path).notes == []


# ---- on live ranks: a compiled stage of a 2-rank Schedule1F1B step -----------------------------------------

SETUP = """
import torch, torch.nn as nn, torch._dynamo
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

class Steady(nn.Module):  # compiles once: same shapes, no Python value that changes
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    def forward(self, x):
        return torch.relu(self.lin(x))

class Counting(nn.Module):  # a Python int it changes on every call: each call needs a new compiled version
    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(8, 8), 0
    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls

def compiled_step(cls, limit=None):
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    old = getattr(cfg, name)
    torch._dynamo.reset()  # this module's frames start with no compiled versions
    try:
        if limit is not None:
            setattr(cfg, name, limit)
        torch.manual_seed(0)
        stage = PipelineStage(torch.compile(cls(), backend="eager"), rank, 2, device)
        sched = Schedule1F1B(stage, 4, loss_fn=nn.MSELoss())
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        sched.step(x) if rank == 0 else sched.step(target=y)
    finally:
        setattr(cfg, name, old)
        torch._dynamo.reset()
"""

pool = module_pool(2, SETUP)


@pytest.mark.launches
def test_a_live_cell_says_whether_its_compiled_stage_ran_compiled(pool):
    pool.exec("compiled_step(Steady)")
    clean = pool.timeline().meta["compile"]
    assert set(clean) == {"0", "1"}
    for counts in clean.values():
        assert counts["frames"] > 0 and counts["graphs"] > 0
        assert counts["fell_back"] == 0 and counts["at_limit"] == 0
    assert compile_notes(clean, fell_back_only=True) == []
    assert "torch.compile" not in pool.idle().text()

    pool.exec("compiled_step(Counting, limit=1)")
    tl = pool.timeline()
    fell = tl.meta["compile"]
    for rank, counts in fell.items():
        assert counts["fell_back"] >= 1 and counts["at_limit"] >= 1, (rank, counts)
        assert counts["limit_name"] == "recompile_limit" and counts["limit"] == 1
    notes = compile_notes(fell, fell_back_only=True)
    assert [n.split(":")[0] for n in notes] == ["rank 0", "rank 1"]
    assert all("recompiled until dynamo's limit (torch._dynamo.config.recompile_limit = 1) and then ran eagerly" in n
               for n in notes)
    assert notes[1] in pool.idle().text()
    print(f"clean: {clean}\nat the limit: {fell}")


@pytest.mark.launches
def test_the_check_notes_a_compiled_stage_that_ran_eagerly(pool):
    """check_step on compiled stages says in its notes when a frame of this rank fell back to eager (here
    the earlier cell's, at a recompile limit of 1: dynamo's counts since the rank's process started)."""
    pool.exec("compiled_step(Counting, limit=1)")
    code = """
import labkit
torch.manual_seed(0); _a = Steady(); torch.manual_seed(0); _b = Steady()
_full = nn.Sequential(_a, _b)
import copy
_stage = PipelineStage(torch.compile(copy.deepcopy(_full[rank]), backend="eager"), rank, 2, device)
_x, _y = torch.randn(8, 8), torch.randn(8, 8)
_losses = []
_sched = Schedule1F1B(_stage, 4, loss_fn=nn.MSELoss())
_sched.step(_x) if rank == 0 else _sched.step(target=_y, losses=_losses)
_c = labkit.check_step(_full, [_stage], _x, _y, _losses, 4, nn.MSELoss())
torch._dynamo.reset()
(_c.ok, [n for n in _c.notes if n.startswith("torch.compile")])
"""
    out = pool.exec(code)
    assert out[0] == out[1]
    ok, notes = out[0]
    assert ok, notes
    assert [n.split(":")[0] for n in notes] == ["torch.compile, rank 0", "torch.compile, rank 1"], notes
    assert all("recompiled until dynamo's limit" in n and "since the rank's process started" in n for n in notes)


@pytest.mark.launches
def test_a_stage_that_fell_back_keeps_saying_so_in_the_next_cell(pool):
    """Cell A: a compiled stage recompiles past a limit of 1 and falls back. Cell B runs the same stage
    again: no dynamo count moves (the frame just runs eagerly), yet meta["compile"] still says, per
    rank, that its stage runs eagerly since cell A, and so do the notes and the idle report. Cell C
    compiles a stage again: compiled."""
    pool.exec("""
torch._dynamo.reset()
_cfg = torch._dynamo.config
_name = "recompile_limit" if hasattr(_cfg, "recompile_limit") else "cache_size_limit"
_old_limit = getattr(_cfg, _name)
setattr(_cfg, _name, 1)
torch.manual_seed(0)
_kept = PipelineStage(torch.compile(Counting(), backend="eager"), rank, 2, device)
_kept_sched = Schedule1F1B(_kept, 4, loss_fn=nn.MSELoss())
_kx, _ky = torch.randn(8, 8), torch.randn(8, 8)
def _kept_step():
    _kept_sched.step(_kx) if rank == 0 else _kept_sched.step(target=_ky)
_kept_step()
""")
    try:
        cell_a = pool.last_cell
        fell = pool.timeline().meta["compile"]
        assert all(c["fell_back"] >= 1 for c in fell.values()), fell
        pool.exec("_kept_step()")
        cell_b = pool.last_cell
        later = pool.timeline().meta["compile"]
    finally:
        pool.exec("setattr(_cfg, _name, _old_limit); torch._dynamo.reset()")
    assert sorted(later) == ["0", "1"]
    for rank, c in later.items():
        assert c["stages"] == {rank: {"ran": "eager", "since": f"cell {cell_a}", "why": c["stages"][rank]["why"]}}, c
        assert "recompiled until dynamo's limit" in c["stages"][rank]["why"]
    notes = compiled.stage_notes(later)
    assert [n.split(":")[0] for n in notes] == ["rank 0", "rank 1"]
    assert all(f"runs eagerly since cell {cell_a}: " in n for n in notes), notes
    idle = pool.idle(cell_b).text()
    assert all(f"since cell {cell_a}" in n for n in compile_notes(later, fell_back_only=True))
    assert all(n in idle for n in compile_notes(later, fell_back_only=True))
    pool.exec("compiled_step(Steady)")
    again = pool.timeline().meta["compile"]
    assert compiled.ran_compiled(again) == {"0": {"0": True}, "1": {"1": True}}, again
    print(f"at the limit: {fell}\nthe next cell: {later}\ncompiled again: {again}")


def test_a_recompile_the_kit_caused_is_said_as_the_kits():
    """A guard on what the kit installed (its `_labkit...` state or a file of the kit: what the input
    hooks once were) is counted apart and every note names the kit as the cause, never the user's code;
    the counts travel as floats with it (issue 63)."""
    before = state(total=1, ok=1, graphs=1, compiles={0: 1})
    after = {**state(total=10, ok=9, graphs=9, compiles={0: 9}, hits={"recompile_limit": 1},
                     limits={"recompile_limit": 8}), "kit_guards": 8}
    d = compiled.delta(before, after)
    assert d["kit_recompiles"] == 8 and d["at_limit"] == 1
    assert "not on your code (the kit's cause" in compiled.fell_back_reason(d)
    notes = compile_notes({0: d})
    assert any(n.startswith("rank 0: 8 recompiles came from a guard on what the kit installed") for n in notes)
    assert compiled.from_floats(compiled.as_floats(d)) == d
    user = compiled.delta(before, {**after, "kit_guards": 0})  # the same counts from the user's own guards
    assert "kit_recompiles" not in user and "kit" not in compiled.fell_back_reason(user)


def test_the_kits_guard_pattern_names_only_the_kit():
    from labkit.versions import KIT_GUARD

    assert KIT_GUARD.search("len(G['stage']._labkit_received) == 7  # got = ... # labkit/spans/received.py:62 in hook")
    assert KIT_GUARD.search("x  # /site-packages/labkit/spans/record.py:40 in wrapper")
    assert not KIT_GUARD.search("len(G['__import___main__'].d) == 1  # def hook(mod, args): ... # mp/lim.py:4 in hook")


def test_dynamos_own_guards_on_the_kits_state_are_counted_as_the_kits():
    """Real dynamo (the eager backend, one process): a pre-hook that grows a `_labkit...` record inside the
    compiled region recompiles once per call, and those guards are counted as the kit's."""
    import torch

    from labkit.versions import dynamo_counters

    class Holder:
        pass

    holder = Holder()
    holder._labkit_seen = {}
    m = torch.nn.Linear(4, 4)
    m.register_forward_pre_hook(lambda mod, args: holder._labkit_seen.__setitem__(len(holder._labkit_seen), 1))
    m.compile(backend="eager")
    before = compiled.snapshot()
    for _ in range(4):
        m(torch.randn(2, 4))
    d = compiled.delta(before, dynamo_counters())
    assert d["recompiles"] >= 3 and d.get("kit_recompiles", 0) >= 3
    torch._dynamo.reset()
