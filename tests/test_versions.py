"""labkit.versions against the installed torch: the feature table must agree with torch's own API
(run on both ends of the supported range by the README's test command), and the one workaround."""

import inspect
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
    """If torch moves a feature (or the table is wrong), this fails on one end of the range."""
    actual = {
        "pre-split microbatches": "arg_mbs" in inspect.signature(ScheduleGPipe.step).parameters,
        "activation liveness": hasattr(pipelining, "analyze_pipeline_activation_liveness"),
        "WAIT actions": hasattr(schedules._ComputationType, "WAIT_SEND_F"),
    }
    assert set(actual) == set(versions.FEATURES)
    for name, present in actual.items():
        assert versions.has(name) == present, f"{name}: torch {torch.__version__} has it: {present}"
    with pytest.raises(KeyError, match="Unknown feature 'teleport'"):
        versions.has("teleport")


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
