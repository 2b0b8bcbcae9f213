"""Config rules: valid configs build, invalid ones fail with a message that says how to fix them."""

import pytest

from labkit.schedules.table import SCHEDULES, layer_bounds, schedule_info, stage_placement
from labkit.core.errors import ConfigError
from labkit.config.run import RunConfig


def test_every_schedule_has_a_valid_default():
    for name in SCHEDULES:
        cfg = RunConfig(schedule=name)
        assert cfg.n_stages == 2 * cfg.stages_per_rank


@pytest.mark.parametrize("alias", ["gpipe", "ScheduleGPipe", " GPIPE "])
def test_schedule_aliases(alias):
    assert schedule_info(alias).name == "GPipe"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"schedule": "Bogus"}, "Choose one of"),
        ({"schedule": "GPipe", "stages_per_rank": 2}, "exactly one stage per rank"),
        ({"schedule": "Interleaved1F1B", "stages_per_rank": 1}, "use GPipe or 1F1B"),
        ({"schedule": "ZBVZeroBubble", "stages_per_rank": 3}, "exactly --stages-per-rank 2"),
        ({"schedule": "DualPipeV", "n_microbatches": 2}, "at least as many microbatches as stages"),
        ({"schedule": "GPipe", "n_microbatches": 3}, "not divisible"),
        ({"schedule": "GPipe", "n_microbatches": 0}, "at least 1"),
        ({"schedule": "GPipe", "n_microbatches": -2}, "at least 1"),
        ({"schedule": "GPipe", "n_microbatches": 2.5}, "whole number"),
        ({"schedule": "GPipe", "pp_size": 0}, "at least 1"),
        ({"schedule": "GPipe", "pp_size": True}, "whole number"),
        ({"schedule": "GPipe", "steps": 0}, "at least 1"),
        ({"schedule": "GPipe", "split": "auto"}, "--split manual"),
        ({"schedule": "GPipe", "device": "tpu"}, "--device auto"),
        ({"schedule": "GPipe", "preset": "huge"}, "Unknown preset"),
        ({"schedule": "Interleaved1F1B", "pp_size": 8, "stages_per_rank": 2}, "every stage needs at least one"),
        ({"schedule": "ZBVZeroBubble", "inference": True}, "cannot run forward-only"),
        ({"schedule": "GPipe", "pg_timeout": 0}, "positive number"),
        ({"schedule": "GPipe", "batch_size": 0}, "at least 1"),
        ({"schedule": "GPipe", "layout": "seq"}, "layout"),
    ],
)
def test_bad_configs_say_how_to_fix(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RunConfig(**kwargs)


def test_placement_loop_and_v():
    assert stage_placement(2, 2, v_shaped=False) == [[0, 2], [1, 3]]
    assert stage_placement(2, 2, v_shaped=True) == [[0, 3], [1, 2]]
    assert stage_placement(4, 2, v_shaped=True) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert RunConfig(schedule="DualPipeV").stages_of_rank(1) == [1, 2]


def test_layer_bounds_cover_all_layers_evenly():
    assert layer_bounds(8, 2) == [0, 4, 8]
    assert layer_bounds(8, 8) == list(range(9))
    b = layer_bounds(8, 3)
    assert b[0] == 0 and b[-1] == 8 and all(b[i] < b[i + 1] for i in range(3))


@pytest.mark.parametrize("kw, message", [
    ({"dtype": "float16"}, "--dtype float32 .the default., bfloat16 or float64"),
    ({"autocast": "float16"}, "--autocast bfloat16"),
    ({"autocast": "bfloat16", "dtype": "float64"}, "needs --dtype float32"),
    ({"tolerance": 0}, "leave it out to judge the step against its measured float noise"),
])
def test_bad_dtypes_are_refused_with_a_fix(kw, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**kw)


def test_dtype_flags_make_the_config():
    from labkit.cli import build_parser, config_from_flags

    run_parser = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    a = run_parser.parse_args(["--autocast", "bfloat16"])
    assert config_from_flags(a) == RunConfig(autocast="bfloat16") and RunConfig().tolerance is None
    assert config_from_flags(run_parser.parse_args(["--dtype", "float64"])).dtype == "float64"


def test_config_json_round_trip(tmp_path):
    """The job reads its RunConfig back from the run directory's config.json: nothing is lost on the way."""
    cfg = RunConfig(schedule="ZBVZeroBubble", pp_size=2, n_microbatches=8, split="tracer", steps=2,
                    split_points=["layers.2", "layers.4", "layers.6"], tolerance=1e-3, profile=True)
    cfg.to_json(tmp_path / "config.json")
    assert RunConfig.from_json(tmp_path) == cfg == RunConfig.from_json(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="config.json"):
        RunConfig.from_json(tmp_path / "missing")


def test_every_config_field_has_a_flag_with_its_docstring_as_help():
    """`labkit run`'s flags are made from RunConfig's fields: each field (free-form extras aside) has one,
    with the field's docstring as help, and the flags give back the config they name."""
    import argparse
    import dataclasses

    from labkit.cli import build_parser, config_from_flags
    from labkit.config.run import field_docs

    run_parser = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    by_dest = {a.dest: a for a in run_parser._actions}
    docs = field_docs(RunConfig)
    for f in dataclasses.fields(RunConfig):
        if f.name == "extra":
            assert f.name not in by_dest
            continue
        assert f.name in by_dest, f"RunConfig.{f.name} has no flag"
        assert docs[f.name] and by_dest[f.name].help.startswith(docs[f.name][:30]), f.name
    assert "--tolerance" in by_dest["tolerance"].option_strings and "--nproc" in by_dest["pp_size"].option_strings
    a = run_parser.parse_args(["--schedule", "ZBVZeroBubble", "--nproc", "2", "--microbatches", "8", "--tolerance",
                               "0.001", "--split-points", "layers.2,layers.4,layers.6", "--profile"])
    assert config_from_flags(a) == RunConfig(schedule="ZBVZeroBubble", pp_size=2, n_microbatches=8, tolerance=1e-3,
                                             split_points=["layers.2", "layers.4", "layers.6"], profile=True)
    assert config_from_flags(run_parser.parse_args([])) == RunConfig()
    assert isinstance(run_parser, argparse.ArgumentParser)


def test_1f1b_needs_as_many_microbatches_as_stages():
    with pytest.raises(ConfigError, match="1F1B needs at least as many microbatches"):
        RunConfig(schedule="1F1B", pp_size=4, n_microbatches=2)


def test_torch_older_than_the_supported_range_is_refused_with_the_fix():
    from labkit.config.run import validate_torch

    with pytest.raises(ConfigError, match=r"torch 2\.10\.1\+cu128 is older than 2\.11.*pip install 'torch>=2\.11'"):
        validate_torch("2.10.1+cu128")
    for ok in ("2.11.0+cu130", "2.13.0+cpu", "2.15.0", "2.16.0"):  # newer than tested: allowed (doctor warns)
        validate_torch(ok)


def test_the_torch_refusal_reaches_labkit_run_before_any_rank(monkeypatch, tmp_path):
    from importlib import metadata

    import labkit

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "2.9.0" if d == "torch" else real(d))
    with pytest.raises(ConfigError, match="older than 2.11"):
        labkit.run(schedule="ZBVZeroBubble", pp_size=2, n_microbatches=4, device="cpu", out=tmp_path / "never")
    assert not (tmp_path / "never").exists()
