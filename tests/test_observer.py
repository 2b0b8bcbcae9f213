"""The kit is a transparent observer (issue 63): the same user script (scripts/gpu_checks/observed.py: its
own stages, optionally compiled, its own schedule and loop) run under plain torchrun and under the kit
(`labkit launch`, and a live-ranks cell) gives the same dynamo graphs, recompiles and fall-backs, and
the same losses, gradients and weights bit for bit, eager, compiled and under bf16 autocast; and a
user's TORCH_LOGS reaches the ranks, merged with what the kit needs, while command.txt says exactly
what differs from the plain command. Counts and bit-for-bit equalities: asserted always (no timing here;
the speed is measured in bench, `scripts/benches/observer.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest.mock as mock
from pathlib import Path

import pytest

from conftest import labkit_cli, module_pool

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_checks" / "observed.py"

pytestmark = pytest.mark.launches

# (how the user compiles, schedule, microbatches, autocast): every way of compiling, every kind of
# schedule (one stage a rank, looped, V-shaped), 4 to 32 microbatches, eager and bf16 autocast
CASES = [
    ("module", "1F1B", 8, False),          # the report: module.compile() at 8 microbatches (17 graphs before)
    ("module", "1F1B", 32, False),
    ("torch", "Interleaved1F1B", 4, False),
    ("blocks", "ZBVZeroBubble", 8, False),
    ("module", "Interleaved1F1B", 16, True),
    ("none", "1F1B", 8, True),
    ("none", "ZBVZeroBubble", 4, False),
]


def _records(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


def _plain(out: Path, args: list[str], env: dict | None = None) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(SCRIPT), str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    return _records(out)


def _kit(runs: Path, out: Path, args: list[str], env: dict | None = None) -> tuple[dict[int, dict], Path]:
    run_dir = runs / out.name
    p = subprocess.run(labkit_cli("launch", "--nproc", "2", "--quiet", "--out", str(run_dir), str(SCRIPT),
                                  str(out), *args),
                       capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    return _records(out), run_dir


def _args(compile_how: str, schedule: str, m: int, autocast: bool) -> list[str]:
    return ["--compile", compile_how, "--schedule", schedule, "--microbatches", str(m), "--steps", "3",
            *(["--autocast"] if autocast else [])]


def _same_as_plain(plain: dict[int, dict], kit: dict[int, dict], where: str) -> None:
    assert sorted(plain) == sorted(kit) == [0, 1]
    for r in plain:
        assert kit[r]["dynamo"] == plain[r]["dynamo"], f"rank {r} {where}: dynamo's counts differ"
        assert kit[r]["losses"] == plain[r]["losses"], f"rank {r} {where}: losses differ"
        assert kit[r]["digests"] == plain[r]["digests"], f"rank {r} {where}: gradients or weights differ"


@pytest.mark.parametrize("compile_how,schedule,m,autocast", CASES)
def test_under_the_kit_a_script_compiles_and_computes_as_under_plain_torchrun(runs, tmp_path, compile_how,
                                                                              schedule, m, autocast):
    args = _args(compile_how, schedule, m, autocast)
    plain = _plain(tmp_path / "plain", args)
    kit, run_dir = _kit(runs, tmp_path / "kit", args)
    _same_as_plain(plain, kit, f"({' '.join(args)})")
    if compile_how != "none":
        for r in plain:  # the user's stages really compiled, and never met a recompile limit
            assert plain[r]["dynamo"]["graphs"] >= 1 and plain[r]["dynamo"]["limit_hits"] == 0
    # and the kit recorded the step as it does (spans of every rank, the inputs for the check)
    assert sorted(p.name for p in (run_dir / "spans").glob("rank*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]


def test_the_kits_memory_tracker_stays_out_of_a_compiled_stage(runs, tmp_path):
    """The activation-memory tracker (saved-tensor hooks) goes around the stage's call of its module, never
    inside a module compiled in place (there dynamo broke its graph at the hooks: 2 more frames a rank):
    the same dynamo counts and numbers as plain torchrun without it, and it still counts."""
    args = _args("module", "1F1B", 8, False)
    plain = _plain(tmp_path / "plain", args)
    kit, _ = _kit(runs, tmp_path / "kit", [*args, "--tracker"])
    _same_as_plain(plain, kit, "(with the kit's memory tracker)")
    assert all(kit[r]["tracker_peak"] > 0 for r in kit)


def test_a_users_torch_logs_reach_the_ranks_merged_and_command_txt_says_what_differs(runs, tmp_path):
    env = {"TORCH_LOGS": "recompiles"}
    kit, run_dir = _kit(runs, tmp_path / "kit", _args("none", "1F1B", 4, False), env)
    assert {kit[r]["env"]["TORCH_LOGS"] for r in kit} == {"recompiles,+pp"}
    text = (run_dir / "command.txt").read_text()
    lines = text.splitlines()
    assert lines[-1].startswith(sys.executable) and "-m torch.distributed.run" in lines[-1]
    assert "#   env: TORCH_LOGS=recompiles,+pp (was: recompiles)" in lines
    assert any(line.startswith("#   launcher: python -m labkit.launching.warm") for line in lines)
    # what the boot folder's sitecustomize does in each rank is said too (instruments, the collector's pause)
    assert any(line.startswith("#   in each rank: the kit's sitecustomize") and "LABKIT_GC_PAUSE=0" in line
               for line in lines)
    # every variable the kit's ranks saw that plain torchrun's did not, or saw with another value, is
    # named in command.txt
    plain = _plain(tmp_path / "plain", _args("none", "1F1B", 4, False), env)
    named = {line.split("=")[0].removeprefix("#   env: ") for line in lines if line.startswith("#   env: ")}
    added = set(kit[0]["env"]["names"]) - set(plain[0]["env"]["names"])
    assert added <= named, f"set in the ranks but not said in command.txt: {added - named}"
    assert plain[0]["env"]["TORCH_LOGS"] == "recompiles"


def test_merging_torch_logs_keeps_the_users_own_setting():
    from labkit.launching.command import job_env, kit_changes, merge_torch_logs

    assert merge_torch_logs(None) == "+pp" and merge_torch_logs("") == "+pp"
    assert merge_torch_logs("recompiles") == "recompiles,+pp"
    assert merge_torch_logs("+dynamo, graph_breaks") == "+dynamo,graph_breaks,+pp"
    assert merge_torch_logs("-pp") == "-pp" and merge_torch_logs("recompiles,pp") == "recompiles,pp"
    # torchrun sets OMP_NUM_THREADS=1 only for several ranks a node: one rank keeps torch's own thread count
    # (found by the GPU check's rehearsal: a 1-rank job's numbers differed from plain torchrun's)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with mock.patch.dict(os.environ, env, clear=True):
        assert "OMP_NUM_THREADS" not in job_env(Path("/tmp/x"), nproc=1)
        assert job_env(Path("/tmp/x"), nproc=2)["OMP_NUM_THREADS"] == "1"
    assert kit_changes({"A": "1", "B": "2", "LABKIT_RANKS_SECRET": "s"}, {"A": "1", "B": "3"}) == [
        "B=2 (was: 3)", "LABKIT_RANKS_SECRET=<secret>"]


pool = module_pool(2)


def test_in_live_ranks_a_script_compiles_and_computes_as_under_plain_torchrun(pool, tmp_path):
    """Warm ranks: the same script run in a cell (its own stages and schedule, on the pool's process
    group) against plain torchrun: the same dynamo counts over the cell, the same numbers."""
    args = _args("module", "1F1B", 8, False)
    plain = _plain(tmp_path / "plain", args)
    out = tmp_path / "warm"
    pool.exec(f"import runpy, sys, torch._dynamo\n"
              f"sys.argv = [{str(SCRIPT)!r}, {str(out)!r}, *{args!r}]\n"
              f"with torch._dynamo.config.patch(recompile_limit=8):\n"
              f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    _same_as_plain(plain, _records(out), "(live ranks)")
