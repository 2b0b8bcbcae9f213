"""`labkit timeline PATH` with the DEFAULT source (`auto`) decides by what PATH holds (issue 30 item 1).

A log from a plain `torchrun` run (all ranks interleaved in one file, torch's default format, plain
or gzipped, with or without torchrun's --tee prefixes) must be read as a log, not handed to the
profiler's JSON reader; a run directory, a live-ranks cell directory and a profiler trace as what
they are; anything else gets one clear error and a non-zero exit, never a traceback. Every log is a
REAL fixture (scripts/capture_fixtures.py): each read must hold exactly the actions the schedule
planned, rank by rank. Most reads go through `labkit.cli.main` in this process (the CLI's own
parsing, reading and JSON output); a few go through `python -m labkit` as a user types it.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.core.errors import ConfigError
from labkit.versions import SUPPORTED

from conftest import labkit_cli

FIXTURES = Path(__file__).parent / "fixtures" / "pplogs"
TRACES = Path(__file__).parent / "fixtures" / "traces"
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SHAPES = ((2, 4), (4, 8))  # (ranks, microbatches)
SPLIT_BACKWARD = {"InterleavedZeroBubble", "ZBVZeroBubble"}
VERSIONS = sorted(d.name for d in FIXTURES.iterdir() if d.is_dir())
# every minor release of the supported range (labkit.versions.SUPPORTED: 2.11 to 2.15)
RANGE = tuple(f"{SUPPORTED[0][0]}.{minor}" for minor in range(SUPPORTED[0][1], SUPPORTED[1][1] + 1))


def log_file(d: Path) -> Path:
    """The one file a plain torchrun run left: combined.log, or combined.log.gz when it was big."""
    hits = [p for p in (d / "combined.log", d / "combined.log.gz") if p.is_file()]
    assert len(hits) == 1, f"{d}: expected combined.log or combined.log.gz"
    return hits[0]


def cli_json(capsys, *args: str) -> dict:
    """`labkit timeline ARGS --json` through the CLI's own main(), in this process."""
    assert main(["timeline", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _1f1b_order(stage: int, n_stages: int, m: int) -> list[tuple]:
    """Schedule1F1B's loop: (n_stages - stage) warm-up forwards, then B/F pairs, then the last Bs."""
    warm = min(m, n_stages - stage)
    order = [("F", i) for i in range(warm)]
    f = warm
    for b in range(m):
        order.append(("B", b))
        if f < m:
            order.append(("F", f))
            f += 1
    return order


def per_rank(actions: list[dict]) -> dict[int, list[tuple]]:
    out: dict[int, list[tuple]] = {}
    for a in actions:
        out.setdefault(a["rank"], []).append((a["stage"], a["kind"], a["microbatch"]))
    return out


def assert_planned(actions: list[dict], r: dict, ranks=None) -> None:
    """The actions (the CLI's JSON: compute only) are exactly what the run planned: on each rank, every
    (stage, microbatch) of its stages once per kind the schedule runs, and nothing else."""
    schedule, m, placement = r["schedule"], r["n_microbatches"], r["stage_placement"]
    ranks = list(range(r["pp_size"])) if ranks is None else ranks
    got = per_rank(actions)
    assert sorted(got) == ranks
    for rank in ranks:
        per = Counter(got[rank])
        stages = placement[rank]
        want = Counter()
        for s in stages:
            for mb in range(m):
                want[(s, "F", mb)] = 1
                if schedule in SPLIT_BACKWARD:
                    want[(s, "I", mb)] = want[(s, "W", mb)] = 1
                elif schedule != "DualPipeV":
                    want[(s, "B", mb)] = 1
        if schedule == "DualPipeV":  # some backwards whole (B, inside OVERLAP_F_B), the others split (I, W)
            for s in stages:
                for mb in range(m):
                    assert per[(s, "B", mb)] + per[(s, "I", mb)] == 1, (rank, s, mb)
                    assert per[(s, "I", mb)] == per[(s, "W", mb)], (rank, s, mb)
            per = Counter({k: v for k, v in per.items() if k[1] not in ("B", "I", "W")})
        assert per == want, f"rank {rank}: {sorted(set(per.items()) ^ set(want.items()))[:6]}"


# ---------------------------------------------------------------------------------------------
# a log file of every schedule, at 2 and 4 ranks, on every torch of the range


def test_every_torch_of_the_range_has_a_log_file_of_every_schedule():
    assert {v.rsplit(".", 1)[0] for v in VERSIONS} >= set(RANGE), VERSIONS
    for v in VERSIONS:
        for s in SCHEDULES:
            for p, m in SHAPES:
                d = FIXTURES / v / f"default_{s}-p{p}-m{m}"
                assert d.is_dir(), f"capture it: python scripts/capture_fixtures.py --only {d.name} (torch {v})"
                log_file(d)


LOGS = [(v, s, p, m) for v in VERSIONS for s in SCHEDULES for p, m in SHAPES
        if (FIXTURES / v / f"default_{s}-p{p}-m{m}").is_dir()]


@pytest.mark.parametrize("version,schedule,p,m", LOGS, ids=[f"{v}-{s}-p{p}" for v, s, p, m in LOGS])
def test_the_default_source_reads_a_plain_torchrun_log_exactly(capsys, version, schedule, p, m):
    d = FIXTURES / version / f"default_{schedule}-p{p}-m{m}"
    r = json.loads((d / "result.json").read_text())
    assert (r["schedule"], r["pp_size"], r["n_microbatches"]) == (schedule, p, m)
    out = cli_json(capsys, str(log_file(d)))
    assert out["source"] == "logs" and out["meta"]["schedule"] == f"Schedule{schedule}"
    assert_planned(out["actions"], r)
    got = per_rank(out["actions"])
    if schedule in ("GPipe", "1F1B"):  # the loop's own order
        for rank in range(p):
            want = ([("F", i) for i in range(m)] + [("B", i) for i in range(m)] if schedule == "GPipe"
                    else _1f1b_order(rank, p, m))
            assert [(k, mb) for _, k, mb in got[rank]] == want, f"rank {rank}"
    elif schedule != "DualPipeV":  # which backwards DualPipeV splits varies from run to run
        kit = FIXTURES / version / f"{schedule}-p{p}-m{m}"  # the same plan, in the kit's per-rank files
        if kit.is_dir():
            assert got == per_rank(cli_json(capsys, str(kit), "--source", "logs")["actions"])


@pytest.mark.parametrize("name", ["default_tee_default_Interleaved1F1B-p2-m4", "default_tee_rank_1F1B-p2-m4"])
def test_torchrun_tee_prefixes(capsys, name):
    """`torchrun --tee 3` echoes each line with its own prefix in front of torch's (`[default0]:[rank0]:`)."""
    for v in VERSIONS:
        d = FIXTURES / v / name
        if d.is_dir():
            assert_planned(cli_json(capsys, str(log_file(d)))["actions"], json.loads((d / "result.json").read_text()))


def test_content_not_the_name_decides(tmp_path, capsys):
    """A log named like a trace, gzipped without .gz, or called anything at all is still a log."""
    d = FIXTURES / VERSIONS[-1] / "default_ZBVZeroBubble-p2-m4"
    r = json.loads((d / "result.json").read_text())
    text = gzip.open(log_file(d)).read() if log_file(d).suffix == ".gz" else log_file(d).read_bytes()
    (tmp_path / "trace.json").write_bytes(text)
    (tmp_path / "run.out").write_bytes(gzip.compress(text))
    (tmp_path / "printed.txt").write_bytes(b"{'lr': 0.1, 'steps': 1}\n" + text)  # a script printed a dict first
    for f in ("trace.json", "run.out", "printed.txt"):
        out = cli_json(capsys, str(tmp_path / f))
        assert out["source"] == "logs"
        assert_planned(out["actions"], r)


def test_per_rank_log_files_and_the_explicit_sources(capsys):
    d = FIXTURES / VERSIONS[-1] / "Interleaved1F1B-p2-m4"
    r = json.loads((d / "result.json").read_text())
    files = sorted(d.glob("logs/run/attempt_0/*/stderr.log*"))
    assert len(files) == 2
    both = cli_json(capsys, *map(str, files))
    assert both["source"] == "logs"
    assert_planned(both["actions"], r)
    one = cli_json(capsys, str(files[1]))  # one rank's file: that rank's actions (the rank from its path)
    assert_planned(one["actions"], r, ranks=[1])
    assert cli_json(capsys, str(files[1]), "--source", "logs")["actions"] == one["actions"]
    # --source profiler on a log: one error saying what it is, not a JSONDecodeError
    assert main(["timeline", str(files[1]), "--source", "profiler", "--json"]) == 2
    err = capsys.readouterr().err
    assert "is not a profiler trace: it is a PP log" in err and "--source auto" in err


# ---------------------------------------------------------------------------------------------
# directories


def test_a_run_directory_of_logs(capsys):
    d = FIXTURES / VERSIONS[-1] / "DualPipeV-p4-m8"
    out = cli_json(capsys, str(d))
    assert out["source"] == "logs"
    assert_planned(out["actions"], json.loads((d / "result.json").read_text()))


def test_a_cell_directory_of_logs(tmp_path, capsys):
    """A live-ranks cell keeps `cells/<n>/rank<r>.log` (the kit's format); without spans its logs are read."""
    d = FIXTURES / VERSIONS[-1] / "ZBVZeroBubble-p2-m4"
    cell = tmp_path / "cells" / "007"
    cell.mkdir(parents=True)
    for rank in (0, 1):
        src = next((d / "logs" / "run" / "attempt_0" / str(rank)).glob("stderr.log*"))
        (cell / f"rank{rank}.log").write_bytes(gzip.open(src).read() if src.suffix == ".gz" else src.read_bytes())
    out = cli_json(capsys, str(cell))
    assert out["source"] == "logs"
    assert_planned(out["actions"], json.loads((d / "result.json").read_text()))


def test_a_directory_with_nothing_to_read(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("nothing here\n")
    assert main(["timeline", str(tmp_path), "--json"]) == 2
    err = capsys.readouterr().err
    assert "no spans" in err and "no profiler traces" in err and "no logs" in err and "TORCH_LOGS=+pp" in err


# ---------------------------------------------------------------------------------------------
# profiler traces (torch.profiler's Chrome JSON, from `labkit run --profile`)


def trace_fixture() -> tuple[Path, dict]:
    d = TRACES / "GPipe-p2-m4"
    return d, json.loads((d / "result.json").read_text())


def test_a_profiler_trace_file(tmp_path, capsys):
    d, r = trace_fixture()
    traces = sorted(d.glob("rank*.json.gz"))
    assert [t.name for t in traces] == ["rank0.json.gz", "rank1.json.gz"]
    one = cli_json(capsys, str(traces[1]))  # rank from the name
    assert one["source"] == "profiler"
    assert_planned(one["actions"], r, ranks=[1])
    both = cli_json(capsys, *map(str, traces))
    assert both["source"] == "profiler"
    assert_planned(both["actions"], r)
    # the same trace, plain JSON under a name that says nothing
    (tmp_path / "whatever.txt").write_bytes(gzip.open(traces[0]).read())
    assert_planned(cli_json(capsys, str(tmp_path / "whatever.txt"))["actions"], r, ranks=[0])
    # --source logs on a trace: one error saying what it is, not an empty timeline
    assert main(["timeline", str(traces[0]), "--source", "logs", "--json"]) == 2
    err = capsys.readouterr().err
    assert "is a Chrome trace (JSON with traceEvents), not a PP log" in err and "Traceback" not in err


def test_a_run_directory_of_profiler_traces(tmp_path, capsys):
    """A run directory without spans but with traces (profile/rank<N>.json) gives the profiler's timeline."""
    d, r = trace_fixture()
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    shutil.copyfile(d / "result.json", run / "result.json")
    for t in d.glob("rank*.json.gz"):
        (run / "profile" / t.name[:-3]).write_bytes(gzip.open(t).read())
    out = cli_json(capsys, str(run))
    assert out["source"] == "profiler"
    assert_planned(out["actions"], r)


def test_a_log_and_a_trace_together_are_refused(capsys):
    d, _ = trace_fixture()
    log = log_file(FIXTURES / VERSIONS[-1] / "default_GPipe-p2-m4")
    assert main(["timeline", str(log), str(d / "rank0.json.gz"), "--json"]) == 2
    assert "different kinds" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# anything else: one clear error


BAD = {
    "notes.txt": (b"Just some notes about the run.\nloss went down\n", "without a single torch.distributed.pipelining"),
    "empty.log": (b"", "is empty"),
    "config.json": (b'{"schedule": "GPipe", "pp_size": 2}\n', "JSON without traceEvents"),
    "broken.json": (b'{"traceEvents": [', "not valid JSON"),
    "list.json": (b"[1, 2, 3]", "JSON without traceEvents"),
    "blob.bin": (bytes(range(256)) * 4, "binary"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_anything_else_gets_one_clear_error(tmp_path, capsys, name):
    data, says = BAD[name]
    f = tmp_path / name
    f.write_bytes(data)
    assert main(["timeline", str(f), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert says in captured.err and "Traceback" not in captured.err
    assert "a run or cell directory" in captured.err and "TORCH_LOGS=+pp" in captured.err  # what was expected
    from labkit.timeline.compare import load_timeline

    with pytest.raises(ConfigError, match=says):
        load_timeline(f)


def test_a_path_that_does_not_exist(tmp_path, capsys):
    assert main(["timeline", str(tmp_path / "nope.log")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the command as a user types it (a new process each: ~2 s)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(labkit_cli("timeline", *args), capture_output=True, text=True, timeout=120)


def test_cli_process_reads_a_log_file_and_a_trace():
    v = VERSIONS[-1]
    d = FIXTURES / v / "default_Interleaved1F1B-p4-m8"
    p = run_cli(str(log_file(d)), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["source"] == "logs"
    assert_planned(out["actions"], json.loads((d / "result.json").read_text()))
    d, r = trace_fixture()
    p = run_cli(*map(str, sorted(d.glob("rank*.json.gz"))), "--json")
    assert p.returncode == 0, p.stderr
    assert_planned(json.loads(p.stdout)["actions"], r)


def test_cli_process_refuses_an_unrelated_file(tmp_path):
    f = tmp_path / "results.json"
    f.write_text('{"loss": 0.5}\n')
    p = run_cli(str(f))
    assert p.returncode == 2 and p.stdout == ""
    assert "JSON without traceEvents" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1  # one error
