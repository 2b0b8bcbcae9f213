"""Two runs' numbers, bit for bit (issue 64 item 5): every rank the kit starts records each step's losses
and each stage's gradient norm on its `end_step` line (labkit.spans.record), and `labkit timeline --compare
A B --numbers` (labkit.timeline.runs_compare) says how many steps were compared, the first step that
differs and in what, and the largest difference. The comparison on synthetic records; then a user's own
script (tests/fixtures/two_runs.py) launched three times: the same seed twice (bitwise equal), and once with
its input nudged at step 3 (the command names step 3), its records held against the script's own numbers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import labkit_cli
from labkit.cli import main
from labkit.core.errors import ConfigError
from labkit.timeline.runs_compare import compare_numbers, describe, recorded_numbers

SCRIPT = Path(__file__).parent / "fixtures" / "two_runs.py"


def _run(tmp_path: Path, name: str, steps: list[dict]) -> Path:
    """A run directory whose ranks' spans files hold only `end_step` lines: steps[k] = {rank: numbers}."""
    d = tmp_path / name / "spans"
    d.mkdir(parents=True)
    lines: dict[int, list[str]] = {}
    for k, per_rank in enumerate(steps):
        for rank, numbers in per_rank.items():
            lines.setdefault(rank, [json.dumps({"meta": {"rank": rank}})]).append(
                json.dumps({"end_step": k, "wall": 0.01, "kit": 0.0, **numbers}))
    for rank, rows in lines.items():
        (d / f"rank{rank}.jsonl").write_text("\n".join(rows) + "\n")
    return d.parent


def _steps(n: int, nudge_at: int = -1, by: float = 0.0) -> list[dict]:
    out = []
    for k in range(n):
        dk = by if k >= nudge_at >= 0 else 0.0
        out.append({0: {"grad_norms": {"0": 1.5 + k + dk}},
                    1: {"losses": [0.25 + k, 0.5 + k + dk], "grad_norms": {"1": 2.0 + k}}})
    return out


def test_the_same_numbers_are_bitwise_equal_over_every_step(tmp_path):
    a, b = _run(tmp_path, "a", _steps(4)), _run(tmp_path, "b", _steps(4))
    d = compare_numbers(a, b)
    assert d.equal and d.steps == 4 and d.per_step == 4
    assert d.text().startswith("Bitwise equal over 4 steps (0 to 3)")


def test_the_first_differing_step_and_the_largest_difference_are_named(tmp_path):
    a = _run(tmp_path, "a", _steps(5))
    b = _run(tmp_path, "b", _steps(5, nudge_at=2, by=1e-12))
    b2 = _run(tmp_path, "b2", [s if k < 4 else {0: {"grad_norms": {"0": 100.0}}, 1: s[1]}
                               for k, s in enumerate(_steps(5, nudge_at=2, by=1e-12))])
    d = compare_numbers(a, b)
    assert not d.equal and d.steps == 5 and d.first == 2 and d.differing_steps == 3
    assert d.first_keys == (("loss", 1, 1), ("grad_norm", 0, 0))  # the losses first
    assert "first differ at step 2" in d.text()
    assert "the loss of microbatch 1 (rank 1) and the gradient norm of stage 0 (rank 0)" in d.text()
    d2 = compare_numbers(a, b2)
    assert (d2.largest.step, d2.largest.key) == (4, ("grad_norm", 0, 0))
    assert d2.largest.size == pytest.approx(100.0 - 5.5) and d2.largest.relative == pytest.approx(94.5 / 100)
    assert "Largest difference: 94.5 at step 4, stage 0's gradient norm (rank 0): 5.5 against 100.0" in d2.text()


def test_a_one_ulp_change_is_a_difference_and_a_number_in_one_run_only_too(tmp_path):
    import math

    base = _steps(3)
    ulp = [dict(s) for s in base]
    ulp[1] = {0: base[1][0], 1: {**base[1][1], "losses": [math.nextafter(1.25, 2.0), 1.5]}}
    d = compare_numbers(_run(tmp_path, "a", base), _run(tmp_path, "b", ulp))
    assert d.first == 1 and d.first_keys == (("loss", 0, 1),)
    assert d.largest.size == math.ulp(1.25)
    fewer = [s if k != 2 else {0: s[0], 1: {"grad_norms": s[1]["grad_norms"]}} for k, s in enumerate(base)]
    d = compare_numbers(_run(tmp_path, "c", base), _run(tmp_path, "d", fewer))
    assert d.first == 2 and "not recorded" in d.text() and d.largest is None


def test_unpaired_steps_missing_losses_and_no_numbers_are_said(tmp_path):
    no_losses = [{r: {"grad_norms": v["grad_norms"]} for r, v in s.items()} for s in _steps(3)]
    d = compare_numbers(_run(tmp_path, "a", no_losses), _run(tmp_path, "b", no_losses[:2]))
    assert d.equal and d.steps == 2 and d.extra == (1, 0)
    assert "recorded 1 more step, not compared" in d.text() and "No losses were recorded" in d.text()
    empty = _run(tmp_path, "e", [{0: {}}])
    with pytest.raises(ConfigError, match="recorded no losses and no gradient norms"):
        compare_numbers(empty, empty)
    with pytest.raises(ConfigError, match="No spans"):
        recorded_numbers(tmp_path)
    assert describe([("grad_norm", 1, 1), ("grad_norm", 0, 1)]) == "the gradient norms of stages 0, 1 (rank 1)"


def test_the_cli_prints_the_comparison_and_exits_1_when_the_runs_differ(tmp_path, capsys):
    a, b = _run(tmp_path, "a", _steps(3)), _run(tmp_path, "b", _steps(3, nudge_at=1, by=0.5))
    assert main(["timeline", "--compare", str(a), str(a), "--numbers"]) == 0
    assert "Bitwise equal over 3 steps" in capsys.readouterr().out
    assert main(["timeline", "--compare", str(a), str(b), "--numbers"]) == 1
    assert "first differ at step 1" in capsys.readouterr().out
    assert main(["timeline", str(a), "--numbers"]) == 2
    assert "--compare takes two runs" in capsys.readouterr().err


def _records(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


@pytest.mark.launches
def test_two_launches_of_one_script_are_bitwise_equal_and_a_nudge_at_step_3_is_named(runs, tmp_path, capsys):
    from labkit.launching.launch import launch

    def job(name: str, *extra: str):
        out = tmp_path / name
        run = launch(SCRIPT, [str(out), "--steps", "5", *extra], nproc=2, runs_root=runs, name=name,
                     progress=False, stream="none", timeout=300)
        return run.run_dir, _records(out)

    (a, mine), (b, _), (c, _) = job("a"), job("b"), job("c", "--perturb-at", "3")
    recorded = recorded_numbers(a)
    assert sorted(recorded.steps) == [0, 1, 2, 3, 4] and not recorded.local
    for k, numbers in recorded.steps.items():  # the kit's record is the script's own numbers
        assert [float.hex(numbers[("loss", mb, 1)]) for mb in range(4)] == mine[1]["losses"][k]
        for rank in (0, 1):
            assert numbers[("grad_norm", rank, rank)] == pytest.approx(mine[rank]["grad_norms"][k], rel=1e-12)
    assert main(["timeline", "--compare", str(a), str(b), "--numbers"]) == 0
    assert capsys.readouterr().out.startswith("Bitwise equal over 5 steps (0 to 4): 6 numbers a step")
    p = subprocess.run(labkit_cli("timeline", "--compare", str(a), str(c), "--numbers"), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "Compared 5 steps: the runs first differ at step 3 (3 steps before it bitwise equal; 2 of 5" in p.stdout
    assert "the losses of microbatches 0, 1, 2, 3 (rank 1)" in p.stdout and "Largest difference:" in p.stdout
