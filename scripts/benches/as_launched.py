"""What the kit's instruments cost as a user launches: a plain torchrun script of the user's shape (an 8-block
language model, labkit.models.small_lm, 2 ranks, Schedule1F1B, 4 microbatches, timing its own steps) run by
`labkit.launching.launch` in interleaved pairs of whole jobs: the pipelining logs on (`pp_logs=True`, the
default) against off, and span recording on (the default) against off (`LABKIT_SPANS=0`, logs off on both
sides). Each figure is the median over the pairs of (median step with / median step without), each pair's
order alternating; on a quiet machine and beside one busy process per core (a laptop that is never idle).
Also RESULTS.md's section for it."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

AS_LAUNCHED_HEADING = "Instruments' cost as a user launches (labkit launch, whole jobs, interleaved pairs)"
USER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from labkit.models import cut_small_lm, lm_loss, small_lm

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps, warm = int(sys.argv[1]), 3
    full = small_lm(8, dim=128)
    blocks = list(range(rank * 8 // world, (rank + 1) * 8 // world))
    stage = PipelineStage(cut_small_lm(full, blocks, rank == 0, rank == world - 1), rank, world, "cpu")
    schedule = Schedule1F1B(stage, 4, loss_fn=lm_loss)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 128, (16, 64), generator=g), torch.randint(0, 128, (16, 64), generator=g)
    times = []
    for i in range(warm + steps):
        dist.barrier()
        t = time.perf_counter()
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
        dist.barrier()
        times.append(time.perf_counter() - t)
    if rank == 0:
        print("STEPS " + json.dumps(times[warm:]), flush=True)
    dist.destroy_process_group()
""")


def _job(script: Path, steps: int, pp_logs: bool, spans: bool, runs: Path) -> float:
    """One launch of the user's script; its median step time."""
    from labkit.launching.launch import launch

    env = {} if spans else {"LABKIT_SPANS": "0"}
    r = launch(script, [str(steps)], nproc=2, runs_root=runs, progress=False, stream="none", pp_logs=pp_logs, env=env)
    line = next(line for line in r.log(0, "stdout").splitlines() if line.startswith("STEPS "))
    return statistics.median(json.loads(line[len("STEPS "):]))


def _pairs(on, off, n: int) -> list[float]:
    """n ratios on/off, each pair's order alternating."""
    out = []
    for i in range(n):
        a, b = (on(), off()) if i % 2 == 0 else tuple(reversed((off(), on())))
        out.append(a / b)
    return out


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def as_launched(pairs: int = 5, steps: int = 20) -> dict:
    """The pipelining logs' and the spans' cost, quiet and beside one busy process per core."""
    out = {"pairs": pairs, "steps": steps, "model": "small_lm, 8 blocks, dim 128, batch 16 x 64, 2 ranks, 1F1B"}
    with tempfile.TemporaryDirectory() as tmp:
        script, runs = Path(tmp) / "user_step.py", Path(tmp) / "runs"
        script.write_text(USER_SCRIPT)
        for condition in ("quiet", "loaded"):
            busy = _busy(os.cpu_count() or 1) if condition == "loaded" else []
            try:
                load = os.getloadavg()[0]
                logs = _pairs(lambda: _job(script, steps, True, True, runs),
                              lambda: _job(script, steps, False, True, runs), pairs)
                spans = _pairs(lambda: _job(script, steps, False, True, runs),
                               lambda: _job(script, steps, False, False, runs), pairs)
                out[condition] = {"pp_logs": _summary(logs), "spans": _summary(spans),
                                  "load": [round(load, 1), round(os.getloadavg()[0], 1)]}
            finally:
                for p in busy:
                    p.kill()
                    p.wait()
    return out


def _summary(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "slower_in": sum(r > 1 for r in ratios), "ratios": ratios}


def _as_launched_rows(al: dict | None) -> list[str]:
    """RESULTS.md's section: how, then a row per instrument and condition."""
    if not al:
        return []
    when = f"; measured {al['date']}, torch {al['torch']}" if al.get("date") else ""
    how = (f"A plain torchrun script of a user's shape ({al['model']}; it times its own steps between barriers, "
           f"{al['steps']} after 3 warm-up) launched by `labkit launch` as whole jobs, {al['pairs']} interleaved pairs "
           f"a row, each pair's order alternating{when}. The pipelining logs: `pp_logs=True` (the default: "
           "TORCH_LOGS=+pp to the rank's files) against off, spans on both sides. Spans: recorded (the default) "
           "against LABKIT_SPANS=0, the logs off on both sides. Loaded: one busy process per core beside both "
           "sides. Each ratio is the pair's median step with over without; the figure, their median.")
    rows = []
    for condition in ("quiet", "loaded"):
        c = al.get(condition)
        if not c:
            continue
        for name, label in (("pp_logs", "pipelining logs (+pp)"), ("spans", "span recording")):
            r = c[name]
            rows.append(f"| {label} | {condition} (load {c['load'][0]}-{c['load'][1]}) | {r['median']:.3f}x | "
                        f"{r['min']:.3f}-{r['max']:.3f}x | {r['slower_in']} of {len(r['ratios'])} |")
    return ["", f"## {AS_LAUNCHED_HEADING}", "", how, "",
            "| instrument | machine | median ratio | range | pairs slower with it |", "| --- | --- | --- | --- | --- |",
            *rows]
