"""The kit as a transparent observer, measured as users launch (issue 63): the same user script (an 8-block
language model, labkit.models.small_lm, 2 ranks, Schedule1F1B, 4 microbatches, timing its own steps between
barriers) run by plain torchrun and by the kit, in interleaved pairs, each pair's order alternating:

- `labkit launch` (every instrument at its default: spans, input fingerprints, the pipelining logs) against
  `python -m torch.distributed.run --standalone`, eager and with the stage compiled (`module.compile()`,
  inductor); the compiled jobs' first steps compile and are left out with the warm-up;
- live ranks (`labkit.Ranks`, the script run in a cell) against the same plain torchrun job, eager;
- and, quiet, plain torchrun against itself: how far two whole jobs of one script part with no kit at all;

each quiet and beside one busy process per core. Per pair: the kit's median warm step over plain
torchrun's, and the kit's peak resident memory per rank (ru_maxrss, the larger rank) over plain
torchrun's. The figure of a row is the median over its pairs, with a bootstrap 95% interval of that median
(`median_interval`): whole jobs of one script scatter by several per cent, so a bound is met only where the
interval's top is under it. Also RESULTS.md's section for it."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

OBSERVER_HEADING = "The kit against plain torchrun: the same script's step time and peak memory"
AA = "plain torchrun against itself"  # the quiet row that says how far two whole jobs of one script part anyway
_SETUP = """    rank, world = dist.get_rank(), dist.get_world_size()
    n, compiled = int(sys.argv[1]), sys.argv[2] == "compiled"
    torch.manual_seed(0)
    full = small_lm(8, dim=128)
    blocks = list(range(rank * 8 // world, (rank + 1) * 8 // world))
    module = cut_small_lm(full, blocks, rank == 0, rank == world - 1)
    if compiled:
        module.compile()
    stage = PipelineStage(module, rank, world, "cpu")
    schedule = Schedule1F1B(stage, 4, loss_fn=lm_loss)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 128, (16, 64), generator=g), torch.randint(0, 128, (16, 64), generator=g)
"""  # each script's model, stage, schedule and batch: n and compiled from its arguments

USER_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from labkit.models import cut_small_lm, lm_loss, small_lm

    own = not dist.is_initialized()  # a live rank's cell: the pool's process group
    if own:
        dist.init_process_group("gloo")
""" + _SETUP + """    steps, warm = n, 3
    times, cpu = [], []
    for i in range(warm + steps):
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
        cpu.append(time.thread_time() - c)
        dist.barrier()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    OBSERVED = {"steps": times[warm:], "cpu": cpu[warm:], "peak": peak}
    print(f"OBSERVED {rank} " + json.dumps(OBSERVED), flush=True)
    if own:
        dist.destroy_process_group()
""")


WITHIN_SCRIPT = textwrap.dedent("""
    import json, logging, statistics, sys, time
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from labkit.models import cut_small_lm, lm_loss, small_lm
    from labkit.spans import received, record

    own = not dist.is_initialized()  # a live rank's cell: the pool's process group
    if own:
        dist.init_process_group("gloo")
""" + _SETUP + """    pairs = n
    pp, real = logging.getLogger("torch.distributed.pipelining"), (received.before, received.after)
    level = pp.level

    def instruments(on):  # every instrument of the kit's in this rank on, or every one off
        pp.setLevel(level if on else logging.INFO)
        record.RECORDER.enabled = on
        received.before, received.after = real if on else ((lambda *a: None), (lambda *a: None))

    def step(on):
        instruments(on)
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=[])
        c = time.thread_time() - c
        dist.barrier()
        return time.perf_counter() - t, c

    for _ in range(3):
        step(True)
    wall, cpu, base = [], [], []
    for i in range(pairs):  # each pair's order alternating: on-off, off-on
        a, b = (step(True), step(False)) if i % 2 == 0 else reversed((step(False), step(True)))
        wall.append(a[0] - b[0])
        cpu.append(a[1] - b[1])
        base.append(b)
    instruments(True)
    WITHIN = {"wall": wall, "cpu": cpu, "off_wall": statistics.median(w for w, _ in base),
              "off_cpu": statistics.median(c for _, c in base)}
    print(f"WITHIN {rank} " + json.dumps(WITHIN), flush=True)
    if own:
        dist.destroy_process_group()
""")


def _within_figures(got: dict) -> dict:
    """Rank 0's step time (the barriers make both ranks' alike) and the ranks' CPU a step: the median of the
    pairs' differences (instruments on minus off), over the median step with them off."""
    r0 = got[0]
    cpu = [sum(g["cpu"][i] for g in got.values()) for i in range(len(r0["cpu"]))]
    lo, hi = median_interval(r0["wall"])
    return {"step": 1 + statistics.median(r0["wall"]) / r0["off_wall"],
            "step_ci95": [1 + lo / r0["off_wall"], 1 + hi / r0["off_wall"]],
            "cpu": 1 + statistics.median(cpu) / sum(g["off_cpu"] for g in got.values()),
            "pairs": len(r0["wall"]), "off_step_s": r0["off_wall"]}


def within(pairs: int = 400) -> dict:
    """The kit's instruments' own cost inside one job: steps in pairs, every instrument on against every one
    off (the pipelining logs' level, the spans recorder, the input fingerprints), each pair's order
    alternating; launched eager and compiled (`labkit launch`), and in a live-ranks cell."""
    import labkit
    from labkit.launching.launch import launch

    out = {"pairs": pairs}
    with tempfile.TemporaryDirectory() as tmp:
        script, runs = Path(tmp) / "within.py", Path(tmp) / "runs"
        script.write_text(WITHIN_SCRIPT)
        for how in ("eager", "compiled"):
            r = launch(script, [str(pairs), how], nproc=2, runs_root=runs, progress=False, stream="none")
            text = r.log(0, "stdout") + "\n" + r.log(1, "stdout")
            got = {int(k): json.loads(v) for k, v in re.findall(r"WITHIN (\d+) (\{[^{}]*\})", text)}
            if sorted(got) != [0, 1]:
                raise RuntimeError(f"the within-job script printed no figures:\n{text[-2000:]}")
            out[f"launch {how}"] = _within_figures(got)
        pool = labkit.Ranks(nproc=2, device="cpu", runs_root=runs, live="none")
        try:
            got = pool.exec(f"import runpy, sys\nsys.argv = [{str(script)!r}, '{pairs}', 'eager']\n"
                            f"runpy.run_path({str(script)!r}, run_name='__main__')['WITHIN']\n")
        finally:
            pool.close()
        out["live ranks eager"] = _within_figures({int(k): v for k, v in got.items()})
    out["load"] = round(os.getloadavg()[0], 1)
    return out


def _read(text: str) -> tuple[float, int, float]:
    """The median warm step (rank 0's; the barriers make both ranks' alike) and the larger rank's peak."""
    # both ranks of plain torchrun write to one pipe: their lines may run into each other
    got = {int(rank): json.loads(data) for rank, data in re.findall(r"OBSERVED (\d+) (\{[^{}]*\})", text)}
    if sorted(got) != [0, 1]:
        raise RuntimeError(f"the script's figures were not printed by both ranks:\n{text[-2000:]}")
    return _figures(got)


def _figures(got: dict) -> tuple[float, int, float]:
    """The median warm step (rank 0's), the larger rank's peak, and the ranks' summed median CPU a step."""
    return (statistics.median(got[0]["steps"]), max(g["peak"] for g in got.values()),
            sum(statistics.median(g["cpu"]) for g in got.values()))


def _plain(script: Path, steps: int, how: str) -> tuple[float, int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(steps), how]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(f"plain torchrun failed: {p.stderr[-2000:]}")
    return _read(p.stdout)


def _kit(script: Path, steps: int, how: str, runs: Path) -> tuple[float, int, float]:
    from labkit.launching.launch import launch

    r = launch(script, [str(steps), how], nproc=2, runs_root=runs, progress=False, stream="none")
    return _read(r.log(0, "stdout") + "\n" + r.log(1, "stdout"))


def _warm(pool, script: Path, steps: int) -> tuple[float, int, float]:
    got = pool.exec(f"import runpy, sys\nsys.argv = [{str(script)!r}, '{steps}', 'eager']\n"
                    f"runpy.run_path({str(script)!r}, run_name='__main__')['OBSERVED']\n")
    return _figures({int(r): v for r, v in got.items()})


def _pairs(kit, plain, n: int) -> dict:
    """n pairs, each pair's order alternating: the kit's step and peak over plain torchrun's."""
    steps, peaks, cpus = [], [], []
    for i in range(n):
        if i % 2 == 0:
            k, p = kit(), plain()
        else:
            p, k = plain(), kit()
        steps.append(k[0] / p[0])
        peaks.append(k[1] / p[1])
        cpus.append(k[2] / p[2])
    return {"step": _summary(steps), "peak": _summary(peaks), "cpu": _summary(cpus)}


def _summary(ratios: list[float]) -> dict:
    lo, hi = median_interval(ratios)
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "ratios": ratios,
            "ci95": [lo, hi]}


def median_interval(values: list[float], level: float = 0.95, draws: int = 4000) -> tuple[float, float]:
    """A bootstrap interval for the median of `values` (percentile method, `draws` resamples, a fixed seed: the
    same values give the same interval): where the median of such pairs would fall, at `level`. With a few
    pairs it is wide, and it says so: a bound is met only where the interval's top is under it."""
    import random

    rng = random.Random(0)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return meds[cut], meds[draws - 1 - cut]


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def observer(pairs: int = 8, compiled_pairs: int = 8, steps: int = 20, conditions=("quiet", "loaded")) -> dict:
    """The kit's step and peak memory over plain torchrun's: launched eager and compiled, live ranks eager."""
    import labkit

    out = {"pairs": pairs, "compiled_pairs": compiled_pairs, "steps": steps,
           "model": "small_lm, 8 blocks, dim 128, batch 16 x 64, 2 ranks, 1F1B, 4 microbatches"}
    with tempfile.TemporaryDirectory() as tmp:
        script, runs = Path(tmp) / "user_step.py", Path(tmp) / "runs"
        script.write_text(USER_SCRIPT)
        pool = labkit.Ranks(nproc=2, device="cpu", runs_root=runs, live="none")
        try:
            for condition in conditions:
                busy = _busy(os.cpu_count() or 1) if condition == "loaded" else []
                try:
                    load = os.getloadavg()[0]
                    row = {
                        "launch eager": _pairs(lambda: _kit(script, steps, "eager", runs),
                                               lambda: _plain(script, steps, "eager"), pairs),
                        "launch compiled": _pairs(lambda: _kit(script, steps, "compiled", runs),
                                                  lambda: _plain(script, steps, "compiled"), compiled_pairs),
                        "live ranks eager": _pairs(lambda: _warm(pool, script, steps),
                                                   lambda: _plain(script, steps, "eager"), pairs),
                    }
                    if condition == "quiet":  # the floor of any whole-job ratio: plain torchrun against itself
                        row[AA] = _pairs(lambda: _plain(script, steps, "eager"),
                                         lambda: _plain(script, steps, "eager"), pairs)
                    out[condition] = {**row, "load": [round(load, 1), round(os.getloadavg()[0], 1)]}
                finally:
                    for p in busy:
                        p.kill()
                        p.wait()
        finally:
            pool.close()
    return out


def _observer_rows(ob: dict | None) -> list[str]:
    """RESULTS.md's section: how, then a row per way of running and condition."""
    if not ob:
        return []
    when = f"; measured {ob['date']}, torch {ob['torch']}" if ob.get("date") else ""
    how = (f"One user script ({ob['model']}; it times its own steps between barriers, {ob['steps']} after 3 "
           f"warm-up, which hold a compiled stage's compile) run by the kit and by plain `torchrun --standalone`, "
           f"interleaved pairs, each pair's order alternating ({ob['pairs']} pairs a row, {ob['compiled_pairs']} "
           f"compiled){when}. The kit: `labkit launch` with every instrument at its default (spans, the input "
           "fingerprints, the pipelining logs), and live ranks (the script run in a cell). Loaded: one busy "
           "process per core beside both sides (\"no busy loop\" is only as quiet as its load says). Step: the kit's median warm step over plain torchrun's; "
           "CPU: the ranks' CPU seconds in a step (each rank thread's, summed), the kit's over plain torchrun's "
           "(what the instruments add, barely moved by the machine's load); peak: the larger rank's peak "
           "resident memory (ru_maxrss), the kit's over plain torchrun's. The last quiet row, plain torchrun "
           "against itself (the same pairs with plain torchrun on both sides), is how far two whole jobs of one "
           "script part anyway: a bound on whole jobs means nothing inside its interval.")
    rows = []
    for condition, label in (("quiet", "no busy loop"), ("loaded", "a busy loop a core")):
        c = ob.get(condition)
        if not c:
            continue
        for way in (w for w in ("launch eager", "launch compiled", "live ranks eager", AA) if w in c):
            s, p, u = c[way]["step"], c[way]["peak"], c[way].get("cpu")
            cpu = f"{u['median']:.3f}x ({u['min']:.3f}-{u['max']:.3f})" if u else "-"
            ci = _interval_text(s.get("ci95"))
            rows.append(f"| {way} | {label} (load {c['load'][0]}-{c['load'][1]}) | {s['median']:.3f}x "
                        f"({s['min']:.3f}-{s['max']:.3f}) | {ci} | {cpu} | {p['median']:.3f}x "
                        f"({p['min']:.3f}-{p['max']:.3f}) |")
    return ["", f"## {OBSERVER_HEADING}", "", how, "",
            "| the kit | machine | step, median (range) | step, 95% interval of the median | CPU a step, median (range) "
            "| peak memory, median (range) |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows, *_within_rows(ob.get("within"))]


def _interval_text(pair) -> str:
    """A `median_interval` as a table cell ("1.017-1.044"); "-" for a figure measured without one."""
    return f"{pair[0]:.3f}-{pair[1]:.3f}" if pair else "-"


def _within_rows(w: dict | None) -> list[str]:
    """The instruments' own cost inside one job (`within`), under the section's table."""
    if not w:
        return []
    when = f", measured {w['date']}" if w.get("date") else ""
    rows = [f"| {way} | {w[way]['step']:.3f}x | {_interval_text(w[way].get('step_ci95'))} | {w[way]['cpu']:.3f}x | "
            f"{w[way]['off_step_s'] * 1e3:.0f} ms |" for way in ("launch eager", "launch compiled", "live ranks eager")
            if way in w]
    return ["", f"The instruments' own cost inside one job (the same model and schedule; {w['pairs']} pairs of steps, "
            "every instrument on against every one off: the pipelining logs, the spans recorder, the input "
            f"fingerprints; each pair's order alternating; load {w['load']} at the end{when}): the median of the "
            "pairs' differences over the step with them off. Whole jobs scatter by more than this; pairs of steps "
            "inside one job share the machine's state.", "",
            "| the kit | step | step, 95% interval of the median | CPU a step | step, instruments off |",
            "| --- | --- | --- | --- | --- |", *rows]
