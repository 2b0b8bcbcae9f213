"""What torch.compile actually ran: dynamo's counts over a step, a cell or a job, per rank, and what
they mean in words.

A compiled stage can run uncompiled without an error: a frame that dynamo recompiled up to its limit
(`torch._dynamo.config.recompile_limit`, 8 by default) runs eagerly from then on whenever none of its
compiled versions fits, and a frame dynamo cannot trace runs eagerly too. Each count here is a
difference of dynamo's own counters (`labkit.versions.dynamo_counters`) over a window:

- `frames`: frames dynamo compiled; `graphs`: the graphs it made of them; `graph_breaks`: where it
  cut a frame's code into several graphs with Python between them;
- `recompiles`: compiles of a frame it had compiled before (a guard failed: a shape or a Python
  value changed);
- `fell_back`: frames dynamo gave up on, which ran eagerly; `at_limit` of them at a recompile limit
  (then `limit_name` and `limit` say which limit and its value);
- `kit_recompiles` (only where not 0): recompiles whose failed guard was on the kit's own state or code
  (`labkit.versions.KIT_GUARD`): the kit, not the user's program, changed what dynamo compiled. The kit
  records from outside the user's modules (labkit.spans.received), so this stays 0; where it is not,
  every note says the kit is the cause.

The spans recorder (`labkit.spans.recorder`) takes them over each step, in every rank it records
(a live-ranks cell's steps and a job's); `labkit.spans.read` sums them per rank into a timeline's
`meta["compile"]`; a job's result.json has them over its steps (`labkit.jobs.train`); the idle report
says in words when a stage fell back (`compile_notes`). Reading costs nothing in a process that never
imported torch._dynamo, about 6 us a step where it did (torch's pipelining imports it).

A frame that fell back moves no count afterwards: it just runs eagerly. So the recorder also keeps, in
the rank's process, what each compiled stage (`is_compiled`: its module, or one inside it, compiled by
`torch.compile(m)` or `m.compile()`) last did (`stage_state`, on the stage's module): "compiled"
(since the window where dynamo compiled for it without falling back, or first ran it so), or "eager"
since the cell or step where a frame fell back while it ran, with why (`fell_back_reason`), until a
later window compiles again. Every step of such a stage carries it (`stages`: {stage: {"ran", "since",
"why"}} beside the counts), so every later cell's and job step's `meta["compile"]` says it
(`stage_notes`, `ran_compiled`); `None` only where nothing is compiled. dynamo's counts are the
process's: a rank with several compiled stages that ran in the window where a frame fell back marks
each of them. Notebook 14 compiles stages.
"""

from __future__ import annotations

import sys

COUNTS = ("frames", "graphs", "graph_breaks", "recompiles", "fell_back", "at_limit")
"""The counts of a window, each an int (a window's dict may add `limit_name` and `limit`)."""

LIMIT_NAMES = ("recompile_limit", "accumulated_recompile_limit")
"""dynamo's recompile limits (torch._dynamo.config), as `limit_name` gives them."""


def snapshot() -> dict | None:
    """dynamo's cumulative counters in this process now; None (and no work) when torch._dynamo was
    never imported, and when this torch's dynamo cannot be read."""
    if "torch._dynamo" not in sys.modules:
        return None
    from ..versions import dynamo_counters

    try:
        return dynamo_counters()
    except Exception:  # a release that moved what is read: no counts rather than a failed step
        return None


def zero() -> dict:
    return dict.fromkeys(COUNTS, 0)


def _grew(before: int, after: int) -> int:
    """How much a cumulative count grew; a count that went back was reset (torch._dynamo.reset()) in
    between: all of it is new."""
    return after - before if after >= before else after


def delta(before: dict | None, after: dict | None) -> dict:
    """The counts (`COUNTS`) of the window between two `snapshot`s (None: dynamo not yet imported)."""
    out = zero()
    if after is None:
        return out
    b = before or {"frames_total": 0, "frames_ok": 0, "graphs": 0, "graph_breaks": 0, "compiles": {},
                   "limit_hits": {}, "limits": {}}
    was = b["compiles"]
    if len(after["compiles"]) < len(was) or any(after["compiles"].get(k, 0) < n for k, n in was.items()):
        # torch._dynamo.reset() in between: the per-frame counts and the graph breaks start again from 0
        was, b = {}, {**b, "graph_breaks": 0}
    out["frames"] = _grew(b["frames_ok"], after["frames_ok"])
    out["graphs"] = _grew(b["graphs"], after["graphs"])
    out["graph_breaks"] = _grew(b["graph_breaks"], after["graph_breaks"])
    hits = {name: _grew(b["limit_hits"].get(name, 0), n) for name, n in after["limit_hits"].items()}
    hits = {name: n for name, n in hits.items() if n > 0}
    out["at_limit"] = sum(hits.values())
    out["fell_back"] = max(_grew(b["frames_total"], after["frames_total"]) - out["frames"], out["at_limit"])
    again = 0  # compile attempts of frames compiled before: recompiles, and the attempts that met a limit
    for frame, n in after["compiles"].items():
        new = n - was.get(frame, 0)
        if new > 0:
            again += new - (was.get(frame, 0) == 0)
    out["recompiles"] = max(0, again - out["at_limit"])
    if kit := _grew(int(b.get("kit_guards", 0)), int(after.get("kit_guards", 0))):
        out["kit_recompiles"] = kit
    if hits:
        name = max(hits, key=hits.get)
        out["limit_name"], out["limit"] = name, after["limits"].get(name)
    return out


def any_counts(counts: dict | None) -> bool:
    """Whether a window's counts say dynamo did anything in it."""
    return bool(counts) and any(counts.get(k, 0) for k in COUNTS)


def add(a: dict | None, b: dict | None) -> dict:
    """Two windows' counts as one (a cell's steps, a job's); the later window's limit and stage states win."""
    out = zero()
    for counts in (a, b):
        for k in COUNTS:
            out[k] += int((counts or {}).get(k, 0))
        if (counts or {}).get("kit_recompiles"):
            out["kit_recompiles"] = out.get("kit_recompiles", 0) + int(counts["kit_recompiles"])
        if (counts or {}).get("limit_name"):
            out["limit_name"], out["limit"] = counts["limit_name"], counts.get("limit")
        if (counts or {}).get("stages"):
            out["stages"] = {**out.get("stages", {}), **counts["stages"]}
    return out


def is_compiled(module) -> bool:
    """Whether torch.compile wraps `module` or a module inside it: `torch.compile(m)` (an OptimizedModule)
    or `m.compile()` (compiled in place). False without torch._dynamo imported (nothing compiled)."""
    if module is None or "torch._dynamo" not in sys.modules or not hasattr(module, "modules"):
        return False
    from ..versions import compiled_module

    try:
        return compiled_module(module)
    except Exception:  # a release that moved what is read: not known to be compiled, rather than a failed step
        return False


def fell_back_reason(counts: dict) -> str:
    """Why a window's frames ran eagerly, in a few words ('' when none did)."""
    at_limit, fell = int(counts.get("at_limit", 0)), int(counts.get("fell_back", 0))
    parts = []
    if at_limit:
        name = counts.get("limit_name") or "recompile_limit"
        value = f" = {counts['limit']}" if counts.get("limit") is not None else ""
        parts.append(f"{_n(at_limit, 'frame')} recompiled until dynamo's limit (torch._dynamo.config.{name}{value})")
    if fell > at_limit:
        parts.append(f"dynamo could not compile {_n(fell - at_limit, 'frame')}")
    if parts and counts.get("kit_recompiles"):
        parts.append(KIT_CAUSE.format(n=_n(int(counts["kit_recompiles"]), "recompile")))
    return " and ".join(parts)


KIT_CAUSE = ("{n} came from a guard on what the kit installed in this rank, not on your code (the kit's "
             "cause: please report it)")


STATE_ATTR = "_labkit_compile_state"
"""Where a compiled stage's module keeps its state (`stage_state`): it lives as long as the module does."""


def stage_state(ran: dict, counts: dict, here: str) -> dict:
    """What each compiled stage that ran in a window did, carried over windows on the stage's module.

    `ran`: {stage index: the stage (its `submod`)} that ran actions in the window; `counts`: the window's
    (`delta`); `here`: its name ("cell 3", "step 7"). A frame that fell back: each compiled stage that ran
    is "eager" since here, with why (one already eager keeps its since); dynamo compiled and nothing fell
    back: "compiled" since here; nothing moved: as it was ("compiled" since here for a stage seen first).
    Uncompiled stages are left out. Returns {str(stage index): its state} for the compiled ones."""
    why, out = fell_back_reason(counts), {}
    for index, stage in sorted(ran.items()):
        module = getattr(stage, "submod", None)
        if not is_compiled(module):
            continue
        was = vars(module).get(STATE_ATTR) if hasattr(module, "__dict__") else None
        now = was
        if why:
            if not was or was["ran"] != "eager":
                now = {"ran": "eager", "since": here, "why": why}
        elif counts.get("frames", 0) > 0 or not was:
            now = {"ran": "compiled", "since": here}
        if hasattr(module, "__dict__"):  # on the module itself: a later cell's step of the same stage finds it
            vars(module)[STATE_ATTR] = now
        out[str(index)] = dict(now)
    return out


def as_floats(counts: dict) -> list[float]:
    """A window's counts as a fixed-length list of floats (`from_floats` reads it back): what a job's
    ranks all-gather for result.json."""
    name = counts.get("limit_name")
    return [float(counts.get(k, 0)) for k in COUNTS] + [
        float(LIMIT_NAMES.index(name)) if name in LIMIT_NAMES else -1.0,
        float(counts["limit"]) if counts.get("limit") is not None else -1.0,
        float(counts.get("kit_recompiles", 0))]


def from_floats(values: list[float]) -> dict:
    out = {k: int(round(v)) for k, v in zip(COUNTS, values)}
    name, limit = (int(round(v)) for v in values[len(COUNTS):len(COUNTS) + 2])
    if len(values) > len(COUNTS) + 2 and int(round(values[len(COUNTS) + 2])):
        out["kit_recompiles"] = int(round(values[len(COUNTS) + 2]))
    if 0 <= name < len(LIMIT_NAMES):
        out["limit_name"], out["limit"] = LIMIT_NAMES[name], limit if limit >= 0 else None
    return out


def _n(k: int, one: str, many: str | None = None) -> str:
    return f"{k} {one if k == 1 else (many or one + 's')}"


def compile_notes(per_rank: dict | None, fell_back_only: bool = False) -> list[str]:
    """In words, per rank (`per_rank`: a timeline's `meta["compile"]` or result.json's `compile`, keyed
    by rank, str or int): where a compiled stage did not run compiled (frames that fell back to
    eager, at a recompile limit or not), then, unless `fell_back_only`, its recompiles and graph
    breaks. A compiled stage that fell back in an earlier window (no count moved in this one) is said
    as still running eagerly (`stage_notes`). [] when dynamo did nothing of the kind."""
    notes = []
    for rank, c in sorted((per_rank or {}).items(), key=lambda kv: int(kv[0])):
        at_limit, fell = int(c.get("at_limit", 0)), int(c.get("fell_back", 0))
        if at_limit:
            name = c.get("limit_name") or "recompile_limit"
            value = f" = {c['limit']}" if c.get("limit") is not None else ""
            notes.append(f"rank {rank}: {_n(at_limit, 'frame')} recompiled until dynamo's limit "
                         f"(torch._dynamo.config.{name}{value}) and then ran eagerly: the compiled code never ran "
                         f"for inputs that needed a new version (raise the limit, or make what changes a tensor "
                         f"or dynamic)")
        if fell > at_limit:
            notes.append(f"rank {rank}: {_n(fell - at_limit, 'frame')} that dynamo could not compile ran eagerly "
                         f"(TORCH_LOGS=graph_breaks says why)")
        if not fell:  # a stage that fell back before this window: no count moves, it still runs eagerly
            notes += [n for n in stage_notes({rank: c}) if " runs eagerly since " in n]
        if fell_back_only:
            continue
        if c.get("kit_recompiles"):
            notes.append(f"rank {rank}: " + KIT_CAUSE.format(n=_n(int(c["kit_recompiles"]), "recompile")))
        if c.get("recompiles"):
            notes.append(f"rank {rank}: {_n(int(c['recompiles']), 'recompile')} (a guard failed: a shape or a "
                         f"Python value changed); each one's compile time is inside the action that ran it")
        if c.get("graph_breaks"):
            notes.append(f"rank {rank}: {_n(int(c['graph_breaks']), 'graph break')}: its compiled code ran as "
                         f"several graphs with Python between them (TORCH_LOGS=graph_breaks says where)")
    return notes


def stage_notes(per_rank: dict | None) -> list[str]:
    """Per rank and compiled stage, in words, whether the compiled code ran (a timeline's
    `meta["compile"]`, whose ranks carry `stages`): "rank 1: stage 1 runs eagerly since cell 1: dynamo
    could not compile 4 frames", "rank 0: stage 0 runs compiled (since cell 1)". [] where nothing is
    compiled (or the counts were recorded before the kit kept stage states)."""
    notes = []
    for rank, c in sorted((per_rank or {}).items(), key=lambda kv: int(kv[0])):
        for stage, st in sorted((c or {}).get("stages", {}).items(), key=lambda kv: int(kv[0])):
            if st.get("ran") == "eager":
                notes.append(f"rank {rank}: stage {stage} runs eagerly since {st.get('since')}: {st.get('why')}")
            else:
                notes.append(f"rank {rank}: stage {stage} runs compiled (since {st.get('since')})")
    return notes


def ran_compiled(per_rank: dict | None) -> dict[str, dict[str, bool]] | None:
    """{rank: {stage: whether its compiled code ran}} of a timeline's `meta["compile"]`; None where no
    stage is compiled."""
    out = {str(rank): {str(s): st.get("ran") == "compiled" for s, st in c["stages"].items()}
           for rank, c in (per_rank or {}).items() if (c or {}).get("stages")}
    return out or None
