"""Part 6 of the GPU check: the kit as a transparent observer on the machine's device (issue 63, points 1, 3
and 4 on nccl): one user script (observed.py beside this file: two stages compiled in place with
`module.compile()`, Interleaved1F1B, 8 microbatches, on one rank) run by plain torchrun and by the kit
(`labkit.launching.launch`). Pass: the same dynamo counts (frames, graphs, compile attempts per frame,
recompile limits met) and the same losses, gradients and weights bit for bit. Reported, not judged (one
pair is not a benchmark): each side's median warm step and, on a GPU, `torch.cuda.max_memory_allocated`."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import FAIL, MIN_JOB_S, PASS, Check, first_line

SCRIPT = Path(__file__).resolve().parent / "observed.py"
KEY = "6_observer"


def observed_args(device: str) -> list[str]:
    return ["--compile", "module", "--schedule", "Interleaved1F1B", "--microbatches", "8", "--steps", "4",
            "--device", device]


def _records(folder: Path) -> dict:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))}


def _plain(check: Check, out: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(SCRIPT),
           str(out), *observed_args(check.device)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    check.jobs.append({"what": "plain torchrun (part 6)", "status": "ok" if p.returncode == 0 else "failed",
                       "seconds": round(time.monotonic() - t0, 1), "processes": 2})
    if p.returncode:
        raise RuntimeError(f"plain torchrun exited {p.returncode}: {p.stderr[-1500:]}")
    return _records(out)


def _kit(check: Check, out: Path, timeout: float) -> dict:
    from labkit.launching.launch import launch

    t0 = time.monotonic()
    run = launch(SCRIPT, [str(out), *observed_args(check.device)], nproc=1, out=check.out / "observer-run",
                 progress=False, stream="none", timeout=timeout)
    check.jobs.append({"what": "labkit launch (part 6)", "run_dir": str(run.run_dir), "status": run.status,
                       "seconds": round(time.monotonic() - t0, 1), "processes": 2})
    return _records(out)


def differences(plain: dict, kit: dict) -> list[str]:
    """What differs between the two sides' records, in words ([] when the kit observed without changing)."""
    if sorted(plain) != sorted(kit) or not plain:
        return [f"ranks recorded: plain {sorted(plain)}, kit {sorted(kit)}"]
    out = []
    for r in plain:
        for key, what in (("dynamo", "dynamo's counts"), ("losses", "losses"), ("digests", "gradients or weights")):
            if plain[r][key] != kit[r][key]:
                out.append(f"rank {r}: {what} differ ({plain[r][key]!r} against the kit's {kit[r][key]!r})"[:300])
    return out


def run_observer(check: Check) -> None:
    """Part 6: the same script under plain torchrun and under the kit; concludes the part."""
    t0 = time.monotonic()
    deadline = check.parts[KEY].deadline_s
    if check.left() < 2 * MIN_JOB_S:
        check.not_run([KEY], "the check's time budget was spent")
        return
    try:
        half = max(MIN_JOB_S, min(deadline, check.left()) / 2)
        plain = _plain(check, check.out / "observer" / "plain", half)
        kit = _kit(check, check.out / "observer" / "kit", max(MIN_JOB_S, min(deadline - (time.monotonic() - t0),
                                                                               check.left())))
    except Exception as e:  # a failed or hung side: the part fails, saying which and why
        check.conclude(KEY, FAIL, first_line(e), time.monotonic() - t0, error=str(e)[-3000:])
        return
    warm = {side: statistics.median(rec[0]["step_s"][1:]) for side, rec in (("plain", plain), ("kit", kit))}
    figures = {"dynamo": plain[0]["dynamo"], "warm_step_s": warm, "step_ratio": warm["kit"] / warm["plain"],
               "peak_bytes": {"plain": plain[0].get("peak_bytes"), "kit": kit[0].get("peak_bytes")}}
    if figures["peak_bytes"]["plain"]:
        figures["peak_ratio"] = figures["peak_bytes"]["kit"] / figures["peak_bytes"]["plain"]
    found = differences(plain, kit)
    if found:
        check.conclude(KEY, FAIL, "; ".join(found)[:400], time.monotonic() - t0, **figures)
    else:
        check.conclude(KEY, PASS, f"the same dynamo counts ({plain[0]['dynamo']['graphs']} graphs, no recompile limit "
                       f"met) and the same numbers bit for bit under the kit as under plain torchrun; warm step "
                       f"{figures['step_ratio']:.3f}x plain's (one pair, reported)", time.monotonic() - t0, **figures)
