"""labkit.versions against the installed torch: the feature table must agree with torch's own API
(run on both ends of the supported range by the README's test command), and the one workaround."""

import inspect
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining import ScheduleGPipe, schedules

from labkit import versions


def test_the_installed_torch_is_in_the_supported_range():
    low, high = versions.SUPPORTED
    assert low <= versions.installed() <= high, f"torch {torch.__version__} is outside the tested range"
    assert versions.support_problem(torch.__version__) is None


def test_each_feature_is_present_exactly_from_its_version_on():
    """If torch moves a feature (or the table is wrong), this fails on the release that disagrees (dev.py
    test runs it on both ends of the range and on a middle release)."""
    actual = {
        "pre-split microbatches": "arg_mbs" in inspect.signature(ScheduleGPipe.step).parameters,
        "loss kwargs": "loss_kwargs" in inspect.signature(pipelining.Schedule1F1B.step).parameters,
        "activation liveness": hasattr(pipelining, "analyze_pipeline_activation_liveness"),
        "WAIT actions": hasattr(schedules._ComputationType, "WAIT_SEND_F"),
        "deferred FSDP gradients": "finalize_gradients" in inspect.signature(ScheduleGPipe.step).parameters,
    }
    assert set(actual) == set(versions.FEATURES)
    for name, present in actual.items():
        assert versions.has(name) == present, f"{name}: torch {torch.__version__} has it: {present}"
    with pytest.raises(KeyError, match="Unknown feature 'teleport'"):
        versions.has("teleport")


# ---- the release facts (labkit.versions.RELEASE_FACTS): one table, every supported release measured ----
def test_every_release_fact_is_measured_on_every_supported_minor_release():
    assert versions.MINORS == ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
    assert (versions.MINORS[0], versions.MINORS[-1]) == versions.SUPPORTED
    for name, f in versions.RELEASE_FACTS.items():
        assert f.name == name and f.measured.strip(), name
        assert tuple(f.outcomes) == versions.MINORS, f"{name}: measured on {list(f.outcomes)}, not {versions.MINORS}"
        assert all(o is not None for o in f.outcomes.values()), f"{name}: an outcome is missing: {f.outcomes}"
        if f.feature:  # an API added in one release: absent before it, present from it on
            seen = [f.outcomes[v] for v in versions.MINORS]
            assert all(isinstance(o, bool) for o in seen) and seen == sorted(seen), (name, seen)
    assert set(versions.FEATURES) == {n for n, f in versions.RELEASE_FACTS.items() if f.feature}
    assert versions.FEATURES["loss kwargs"][0] == (2, 13) and versions.FEATURES["WAIT actions"][0] == (2, 15)
    assert versions.SELF_P2P_FIXED == (2, 15)


def test_fact_gives_the_installed_releases_outcome():
    here = versions.installed()
    for name, f in versions.RELEASE_FACTS.items():
        assert versions.fact(name) == f.outcomes[here] == versions.fact(name, torch.__version__), name
        assert versions.fact(name, here) == versions.fact(name, f"{here[0]}.{here[1]}.7+cpu")  # any patch, any build
        if f.feature:
            assert versions.has(name) == versions.fact(name)
    assert versions.fact("loss kwargs", "2.12.1+cu130") is False and versions.fact("loss kwargs", (2, 13)) is True
    assert versions.fact("skip connection error", "2.16.0") == versions.fact("skip connection error", "2.15.0")
    with pytest.raises(ValueError, match="older than 2.11, the oldest the kit supports"):
        versions.fact("loss kwargs", "2.10.0")
    with pytest.raises(KeyError, match="Unknown release fact 'teleport'"):
        versions.fact("teleport")


def test_the_facts_torch_states_itself_hold_on_the_installed_release():
    """The rows a release's own code settles (measured by running the lessons on each release): the
    error classes it defines and raises, when it checks shapes, what it warns, where it warms up."""
    from torch.distributed.pipelining import stage as pp_stage
    from torch.distributed.pipelining import _utils as pp_utils

    source = open(pp_stage.__file__).read()
    shape_error = versions.fact("shape error class")
    assert hasattr(pp_utils, shape_error)
    assert not hasattr(pp_utils, ({"PipeliningShapeError", "PipeliningMetadataError"} - {shape_error}).pop())
    raised = re.search(r"raise (\w+)\(\s*\"Backward of skip connections not supported yet\"", source)
    assert raised and raised.group(1) == versions.fact("skip connection error")
    assert ("dist.get_debug_level() == dist.DebugLevel.DETAIL" in source) == versions.fact("shape check needs DETAIL")
    assert ("passing input_args and performing init-time shape inference is deprecated" in source) == \
        versions.fact("input_args deprecation warning")
    sends_to_self = versions.fact("self warm-up sends")
    assert ("_get_init_p2p_neighbors_ops" in vars(pp_stage._PipelineStageBase)) == bool(sends_to_self)
    assert ("_warmup_forward_vote" in vars(pp_stage.PipelineStage)) == (sends_to_self == ("traced",))


HAND_WRITTEN_RELEASE = re.compile(r"(versions\.installed\(\)|__version__[^\n]*\))\s*(<|>|<=|>=)\s*\(\s*2\s*,\s*\d"
                                  r"|\b(on|before|since|after)_2_\d+\b|WARMUP_WAIT")
"""A cell or test that compares the release itself instead of asking `versions.fact`."""
NOT_YET_FROM_THE_TABLE: set[str] = set()
"""Files still comparing releases by hand (none: notebook 09's branches became the rows 'shape error class',
'shape check needs DETAIL', 'uneven batch goes through', 'non-contiguous gradient fails on gloo' and
'warm-up wait')."""


def release_sources() -> dict[str, str]:
    """{path from the repository's root: its code} for every notebook (code cells) and test file."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = {str(p.relative_to(root)): p.read_text() for p in sorted((root / "tests").glob("*.py"))}
    for p in sorted((root / "notebooks").glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        found[str(p.relative_to(root))] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return found


def test_notebooks_and_tests_ask_the_table_for_what_a_release_does():
    asked, by_hand = {}, []
    for path, code in release_sources().items():
        for name in re.findall(r"versions\.(?:fact|has)\(\s*[\"']([^\"']+)[\"']", code):
            asked.setdefault(name, []).append(path)
        hit = HAND_WRITTEN_RELEASE.search(code)
        if hit and path != "tests/test_versions.py" and path not in NOT_YET_FROM_THE_TABLE:
            by_hand.append(f"{path}: {hit.group(0)}")
    unknown = {n: p for n, p in asked.items() if n not in versions.RELEASE_FACTS and n != "teleport"}
    assert not unknown, f"asked of labkit.versions but not in RELEASE_FACTS: {unknown}"
    assert not by_hand, ("compare releases through labkit.versions.fact (a row of RELEASE_FACTS, measured on "
                         "every supported release), not by hand:\n" + "\n".join(by_hand))
    assert {"ZBVZeroBubble compiled in place", "skip connection error", "input_args deprecation warning"} <= set(asked)


def test_support_problem_says_how_to_fix_it():
    assert "pip install 'torch>=2.11'" in versions.support_problem("2.10.0")
    assert "newer than 2.15" in versions.support_problem("2.16.1+cu130")
    assert versions.support_problem("2.11.0+cu130") is None
    assert versions.parse("2.15.0+cu132") == (2, 15)


def test_self_warmups_are_dropped_and_neighbour_warmups_kept():
    ops = [SimpleNamespace(group_peer=p, name=n) for p, n in ((1, "recv from 1"), (0, "send to self"), (2, "send to 2"))]
    assert [o.name for o in versions.drop_self_p2p(ops, group_rank=0)] == ["recv from 1", "send to 2"]


def test_the_workaround_patches_only_the_torch_that_needs_it():
    from torch.distributed.pipelining import stage as pp_stage

    applied = versions.apply_workarounds()
    method = pp_stage._PipelineStageBase.__dict__.get("_get_init_p2p_neighbors_ops")
    if versions.installed() < versions.SELF_P2P_FIXED:
        assert applied and method.__wrapped__ is not None
    else:
        assert applied == []
        assert method is None or not hasattr(method, "__wrapped__")
    assert versions.apply_workarounds() == applied  # idempotent: never wrapped twice


# ---- every dependency's range (labkit.versions.RANGES) and `labkit doctor` against it ----
def test_every_installed_dependency_is_inside_its_range():
    """Run on both legs of `dev.py test`: the main lock (the newest tested of everything) and the
    floors lock (torch 2.11, transformers 5.23, ...) must both be inside the declared ranges."""
    from importlib.metadata import PackageNotFoundError, version

    seen = {}
    for name in versions.RANGES:
        try:
            seen[name] = version(name)
        except PackageNotFoundError:
            continue
        assert versions.range_problem(name, seen[name]) is None, (name, seen[name])
    assert {"torch", "matplotlib", "nbval"} <= set(seen), seen


def test_range_problem_compares_at_the_precision_written():
    assert versions.release("2.15.0+cu132") == (2, 15, 0) and versions.release("5.24.0rc1") == (5, 24, 0)
    assert versions.range_problem("transformers", "5.23.0") is None
    assert versions.range_problem("transformers", "5.24.3") is None        # a patch of the newest tested minor
    kind, message = versions.range_problem("transformers", "5.22.9")
    assert kind == "older" and "pip install 'transformers>=5.23'" in message
    kind, message = versions.range_problem("transformers", "5.25.0")
    assert kind == "newer" and "newer than 5.24, the newest the kit was tested on" in message
    assert versions.range_problem("nbval", "0.1.0") is None                 # no floor declared: nothing is too old
    assert versions.range_problem("nbval", "0.12.0")[0] == "newer"
    assert versions.SUPPORTED == (versions.parse(versions.RANGES["torch"].floor + ".0"),
                                  versions.parse(versions.RANGES["torch"].newest + ".0"))


def _doctor_with(monkeypatch, **fake):
    """doctor() with some packages' installed versions replaced (None: not installed)."""
    from labkit import doctor as doctor_mod

    real = doctor_mod._version
    monkeypatch.setattr(doctor_mod, "_version", lambda name: fake[name] if name in fake else real(name))
    return doctor_mod.doctor(), doctor_mod.format_report


def test_doctor_calls_a_transformers_below_its_floor_a_problem_with_the_pip_fix(monkeypatch):
    report, fmt = _doctor_with(monkeypatch, transformers="5.22.0", matplotlib="3.11.2")
    assert not report["ok"]
    assert {"what": "transformers 5.22.0 is older than 5.23, the oldest the kit supports",
            "fix": "pip install 'transformers>=5.23' (the kit is tested on 5.23 to 5.24)"} in report["problems"]
    text = fmt(report)
    assert "PROBLEM      transformers 5.22.0 is older than 5.23" in text
    assert "  fix:       pip install 'transformers>=5.23'" in text


def test_doctor_warns_about_releases_newer_than_tested_and_a_missing_optional_package(monkeypatch):
    report, fmt = _doctor_with(monkeypatch, transformers="5.25.0", matplotlib="3.12.0", torch="2.16.0")
    assert not any("transformers" in p["what"] or "matplotlib" in p["what"] for p in report["problems"])
    text = fmt(report)
    for name, newest in (("transformers", "5.24"), ("matplotlib", "3.11"), ("torch", "2.15")):
        assert f"is newer than {newest}, the newest the kit was tested on" in text, name
        assert f"pip install '{name}=={newest}.*'" in text
    report, fmt = _doctor_with(monkeypatch, transformers=None)
    assert report["packages"]["transformers"] is None
    assert any(w.startswith("transformers is not installed (needed by notebook 11") and "'.[models]'" in w
               for w in report["warnings"])
    assert not any("transformers" in p["what"] for p in report["problems"])


def test_dynamo_counters_see_a_compile_a_graph_break_and_a_frame_at_the_recompile_limit():
    """What labkit.spans.compiled reads of dynamo, on this torch (both ends of the range): a frame that
    compiles, one with a graph break, and one that meets a recompile limit of 1 and runs eagerly."""
    import torch._dynamo

    from labkit.spans import compiled

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    old = getattr(cfg, name)
    torch._dynamo.reset()
    try:
        start = compiled.snapshot()
        torch.compile(lambda x: torch.relu(x) + 1, backend="eager")(torch.randn(3))
        clean = compiled.delta(start, after := compiled.snapshot())
        assert (clean["frames"], clean["graphs"], clean["fell_back"], clean["at_limit"]) == (1, 1, 0, 0)

        def broken(x):
            x = x + 1
            torch._dynamo.graph_break()
            return x * 2
        torch.compile(broken, backend="eager")(torch.randn(3))
        assert compiled.delta(after, after := compiled.snapshot())["graph_breaks"] == 1

        setattr(cfg, name, 1)
        scale = torch.compile(lambda x, k: x * k, backend="eager")
        for k in range(3):  # a Python int is guarded by value: each k needs its own compiled version
            scale(torch.randn(3), k)
        limited = compiled.delta(after, compiled.snapshot())
        assert (limited["fell_back"], limited["at_limit"], limited["recompiles"]) == (1, 1, 0), limited
        assert (limited["limit_name"], limited["limit"]) == ("recompile_limit", 1)
    finally:
        setattr(cfg, name, old)
        torch._dynamo.reset()
