"""Benchmarks of the kit itself: what it costs and whether its timelines tell the truth.

    python3 scripts/dev.py bench            # full run: bench/results.json + bench/RESULTS.md
    .venv/bin/python scripts/bench.py --quick   # a small, fast subset
    python3 scripts/dev.py bench --only check   # one section alone (here the check's cost), the rest kept

Dev tooling, not part of what a learner imports: it imports labkit, and finds the repository (its
fixtures, notebooks and scripts) from its own place in it, scripts/bench.py.

Every figure is a ratio or a fraction measured within one run, with A and B interleaved pair by
pair, because these machines are noisy: never compare absolute times across runs.
1. launch overhead: a short job through `labkit launch` vs plain `torchrun` (whole processes);
2. capture overhead: the reference job's step time with PP log capture (+pp, microsecond
   format, to files) vs without, step by step inside each job (with an A/A control), and between
   whole jobs; the profiler between jobs;
3. fidelity: measured vs ideal bubble on the controlled workload, GPipe and 1F1B, several shapes;
4. parser throughput at 10k, 100k, 1M lines (and whether time grows linearly), and the whole
   log -> timeline path beside it;
5. the notebook suite under nbval (wall time);
6. span recording (labkit.spans): step time with spans on vs off inside each job (A/A control);
7. the check's cost: check_step and check_stages beside the step they check, time and peak memory per rank;
8. GPU, when one is present: the tutorial-size preset on one GPU (world size 1, multi-stage schedules);
9. ranks started warm (labkit.launching.warm): a fresh 2- and 4-rank job's CPU and wall time by start method
   against plain torchrun, and a live pool's start, fork against spawn (`--only warm`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # this file is <repo>/scripts/bench.py
BENCH_DIR = REPO_ROOT / "bench"
SHORT_JOB = textwrap.dedent("""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
""")


def _wall(cmd: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return time.perf_counter() - t0


WARM_UP = True  # one unmeasured run of each side first; tests/test_bench.py (structure, never timings) skips it


def _pairs(a, b, n: int, warm_up: bool = True) -> tuple[list[float], list[float]]:
    """Run a() and b() alternately n times (after one warm-up each, with WARM_UP and warm_up); their results."""
    if WARM_UP and warm_up:
        a(), b()
    ra, rb = [], []
    for i in range(n):
        if i % 2:
            rb.append(b()), ra.append(a())
        else:
            ra.append(a()), rb.append(b())
    return ra, rb


def _spread(ratios: list[float]) -> dict:
    """Median of a list of pair ratios, with the ratios and their middle half."""
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "pair_ratios": ratios, "pair_ratio_iqr": [q[0], q[2]]}


def _ratio(ra: list[float], rb: list[float]) -> dict:
    return {**_spread([x / y for x, y in zip(ra, rb)]),
            "a_median_s": statistics.median(ra), "b_median_s": statistics.median(rb)}


def launch_overhead(n: int = 5, nproc: int = 2) -> dict:
    """`labkit launch` vs plain torchrun on the same short script, whole-process wall time.

    Beside the ratio (whose pairs scatter by several percent here: three processes import torch on
    two cores), the kit's own time outside torchrun, measured exactly: the CLI's wall time minus
    the torchrun wall time it records in run.json (interpreter start, imports, run directory).
    """
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "short_job.py"
        script.write_text(SHORT_JOB)
        # TMPDIR: plain torchrun (no --log-dir) leaves a torchelastic_* folder in the temp dir per run
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)
        count = iter(range(10_000))
        outside: list[float] = []

        def kit() -> float:
            out = Path(tmp) / f"run{next(count)}"
            wall = _wall([sys.executable, "-m", "labkit", "launch", "--nproc", str(nproc), "--quiet", "--stream",
                          "none", "--out", str(out), str(script)], env)
            outside.append(wall - json.loads((out / "run.json").read_text())["wall_time_s"])
            return wall

        plain = lambda: _wall([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), str(script)], env)
        res = _ratio(*_pairs(kit, plain, n))
        res["kit_outside_torchrun_s"] = statistics.median(outside)
        res["kit_outside_share"] = res["kit_outside_torchrun_s"] / res["b_median_s"]
        return res


def _cpu(cmd: list[str], env: dict) -> float:
    """CPU seconds (user + sys) of a command and every process under it that was waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def startup_cost(n: int = 5, kinds=("agent", "rank_imports", "job")) -> dict:
    """What pausing the collector during torch's imports saves (labkit.core.startup), in CPU seconds,
    paused / not paused (LABKIT_GC_PAUSE=0), interleaved pair by pair: torchrun's agent start-up, a
    rank's imports (torch's pipelining and the kit's job), and a whole 2-rank `labkit run` (the
    command, the agent and both ranks). CPU time, not wall: the saving is work the machine no longer
    does, which is what a suite of hundreds of processes on 2 cores waits for."""
    from labkit.spans.paths import BOOT_DIR

    boot = os.pathsep.join([str(BOOT_DIR), os.environ.get("PYTHONPATH", "")])
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        count = iter(range(10_000))
        commands = {
            "agent": lambda: [py, "-m", "torch.distributed.run", "--help"],
            "rank_imports": lambda: [py, "-c", "import torch.distributed.pipelining, labkit.jobs.train, os; os._exit(0)"],
            "job": lambda: [py, "-m", "labkit", "run", "--schedule", "1F1B", "--pp-size", "2", "--quiet", "--stream",
                            "none", "--out", str(Path(tmp) / f"run{next(count)}")],
        }
        res = {}
        for kind in kinds:
            cmd = commands[kind]
            env = lambda on: dict(os.environ, PYTHONPATH=boot, OMP_NUM_THREADS="1", TMPDIR=tmp,  # noqa: E731
                                  LABKIT_GC_PAUSE="1" if on else "0")
            res[kind] = _ratio(*_pairs(lambda: _cpu(cmd(), env(True)), lambda: _cpu(cmd(), env(False)), n))
        return res


def _startup_rows(st: dict | None) -> list[str]:
    if not st:
        return []
    names = {"agent": "torchrun's agent start-up", "rank_imports": "a rank's imports (pipelining, the kit's job)",
             "job": "a whole 2-rank `labkit run` (command, agent, ranks)"}
    when = (f"; measured {st['date']}" if st.get("date") else "") + (f", torch {st['torch']}" if st.get("torch") else "")
    return [f"| start-up CPU, collector paused / not ({names[k]}: {v['a_median_s']:.2f} s / {v['b_median_s']:.2f} s, "
            f"median of {len(v['pair_ratios'])} pairs{when}) | {v['ratio']:.2f}x | < 1 (reported) | "
            f"{'yes' if v['ratio'] < 1 else 'no'} |" for k, v in st.items() if k in names]


# Ranks started warm (labkit.launching.warm): a short job's whole process tree, fresh, through `labkit launch` with
# each start method against plain torchrun, and a live pool's start; the job is the probe.
WARM_HEADING = "labkit/launching/warm.py: ranks started warm"
WARM_JOB = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining  # noqa: F401
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
""")
START_METHODS = ("fork", "forkserver", "spawn")
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _tree_run(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a command and its whole process tree.

    RUSAGE_CHILDREN counts a process once someone waits for it, and nobody waits for a forkserver or
    multiprocessing's resource tracker once their agent has ended (they are orphans, and so are the ranks
    a forkserver had not reaped yet): this process becomes a subreaper for the run, orphans of the tree
    are reparented to it, and it waits for each before reading the counts."""
    import ctypes

    import psutil

    libc = ctypes.CDLL(None, use_errno=True)
    me = psutil.Process()
    before_kids = {c.pid for c in me.children()}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    try:
        wall = _wall(cmd, env)
        deadline = time.monotonic() + 60
        while orphans := [c.pid for c in me.children() if c.pid not in before_kids]:
            for pid in orphans:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"process {pid} of `{' '.join(cmd)}` outlived it by 60 s")
                    time.sleep(0.02)
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def _rounds(sides: dict, n: int, fewer: dict | None = None, warm_up=None) -> dict:
    """Every side run once per round, n rounds, the order reversed every other round (the pairs of
    `_pairs`, k sides at once: each side's i-th run is paired with the others' i-th, run in the same
    round); with WARM_UP, after one warm-up run of each side named in `warm_up` (None: every side).
    `fewer`: {side: rounds} for a side that runs only in the first rounds. {side: [result, ...]}."""
    if WARM_UP:
        for k in sides if warm_up is None else warm_up:
            sides[k]()
    out: dict = {k: [] for k in sides}
    for i in range(n):
        names = [k for k in sides if i < (fewer or {}).get(k, n)]
        for k in (names if i % 2 == 0 else reversed(names)):
            out[k].append(sides[k]())
    return out


def _wall_and_cpu(a: list[tuple], b: list[tuple]) -> dict:
    """{"cpu": _ratio, "wall": _ratio} of (wall, cpu) runs a over b, paired by round (b's first len(a))."""
    b = b[:len(a)]
    return {"wall": _ratio([x[0] for x in a], [x[0] for x in b]), "cpu": _ratio([x[1] for x in a], [x[1] for x in b])}


def _pool_start(nproc: int, method: str, runs_root: str) -> tuple[float, float]:
    """(wall, CPU) of a live pool's start with start method `method`: from `labkit.Ranks(...)` to its
    first cell's value back; CPU: the agent's and every rank's (psutil, before the pool is closed)."""
    import psutil

    from labkit.launching.warm import START_VAR
    from labkit.ranks import Ranks

    was = os.environ.get(START_VAR)
    os.environ[START_VAR] = method
    try:
        t = time.perf_counter()
        pool = Ranks(nproc=nproc, device="cpu", runs_root=runs_root, live="print")
        try:
            if sorted(pool.exec("rank").values()) != list(range(nproc)):
                raise RuntimeError(f"the {method} pool's first cell did not come back from every rank")
            wall = time.perf_counter() - t
            agent = psutil.Process(pool.agent_pid)
            cpu = 0.0
            for p in [agent, *agent.children(recursive=True)]:
                try:
                    c = p.cpu_times()
                except psutil.NoSuchProcess:
                    continue
                cpu += c.user + c.system + c.children_user + c.children_system
        finally:
            pool.close()
    finally:
        if was is None:
            os.environ.pop(START_VAR, None)
        else:
            os.environ[START_VAR] = was
    return wall, cpu


def warm_start(n: int = 5, nprocs=(2, 4), methods=START_METHODS, spawn_rounds: int | None = 3,
               pools=("fork", "spawn"), pool_pairs: int = 3) -> dict:
    """A fresh short job (WARM_JOB: gloo, one all-reduce, a barrier) through `labkit launch` started warm with
    each start method in `methods` ($LABKIT_START_METHOD) against plain torchrun, at each size in `nprocs`: wall
    time and CPU of the whole process tree (_tree_run), n rounds with every side once per round (_rounds; spawn,
    the slowest, in the first `spawn_rounds` only); then a live pool's start (_pool_start) with the methods in
    `pools`, the first against the second, `pool_pairs` pairs. Ratios are kit / plain torchrun and (pools) first /
    second method. The warm-up runs (WARM_UP) are at the first size only, plain torchrun and the kit's first method
    (the files every side reads, torch's among them, are in the page cache after them)."""
    from labkit.launching.warm import START_VAR

    py = sys.executable
    out: dict = {"jobs": {}, "pools": {}, "rounds": n, "spawn_rounds": min(spawn_rounds or n, n),
                 "pool_pairs": pool_pairs}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "probe_job.py"
        script.write_text(WARM_JOB)
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)  # TMPDIR: plain torchrun's torchelastic_* folders
        env.pop(START_VAR, None)
        count = iter(range(100_000))

        def kit(nproc: int, method: str):
            return lambda: _tree_run([py, "-m", "labkit", "launch", "--nproc", str(nproc), "--quiet", "--stream",
                                      "none", "--out", str(Path(tmp) / f"run{next(count)}"), str(script)],
                                     {**env, START_VAR: method})

        def plain(nproc: int):
            return lambda: _tree_run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                                      str(script)], env)

        for nproc in nprocs:
            runs = _rounds({"plain": plain(nproc), **{m: kit(nproc, m) for m in methods}}, n,
                           {"spawn": out["spawn_rounds"]}, warm_up=("plain", methods[0]) if nproc == nprocs[0] else ())
            out["jobs"][str(nproc)] = {m: _wall_and_cpu(runs[m], runs["plain"]) for m in methods}
        if pools:
            first, second = pools
            for nproc in nprocs:
                a, b = _pairs(lambda: _pool_start(nproc, first, tmp), lambda: _pool_start(nproc, second, tmp),
                              pool_pairs, warm_up=nproc == nprocs[0])
                out["pools"][str(nproc)] = {**_wall_and_cpu(a, b), "methods": list(pools)}
    return out


WARM_TARGET = {"cpu": 0.4, "wall": 0.6}  # issue 51: a fresh 4-rank job started warm (fork), against plain torchrun


def _warm_when(ws: dict) -> str:
    parts = [f"measured {ws['date']}"] if ws.get("date") else []
    parts += [f"torch {ws['torch']}"] if ws.get("torch") else []
    parts += [f"load average {ws['load'][0]} at the start, {ws['load'][1]} at the end on {os.cpu_count()} cores"] \
        if ws.get("load") else []
    return ", ".join(parts)


def _warm_rows(ws: dict | None) -> list[str]:
    """The main table's rows: a fresh 4-rank (else the largest) job started warm with fork, against the goal."""
    if not ws or not ws.get("jobs"):
        return []
    nproc = "4" if "4" in ws["jobs"] else max(ws["jobs"], key=int)
    fork = ws["jobs"][nproc].get("fork")
    if not fork:
        return []
    when = _warm_when(ws)
    target = lambda k: f"<= {WARM_TARGET[k]}x" if nproc == "4" else "(reported)"  # noqa: E731
    met = lambda k: ("yes" if fork[k]["ratio"] <= WARM_TARGET[k] else "no") if nproc == "4" else "-"  # noqa: E731
    return [f"| warm start: a fresh {nproc}-rank job, labkit launch (fork) / plain torchrun, {what} "
            f"({fork[k]['a_median_s']:.1f} s / {fork[k]['b_median_s']:.1f} s, median of {len(fork[k]['pair_ratios'])} "
            f"pairs{'; ' + when if when else ''}) | {fork[k]['ratio']:.2f}x | {target(k)} | {met(k)} |"
            for k, what in (("cpu", "CPU of the whole process tree"), ("wall", "wall time"))]


def _warm_section(ws: dict | None) -> list[str]:
    """RESULTS.md's section of the warm start: how, a reading, a row per size and start method, and the pools."""
    if not ws or not ws.get("jobs"):
        return []
    cell = lambda r: f"{r['a_median_s']:.1f} s / {r['b_median_s']:.1f} s = **{r['ratio']:.2f}x**"  # noqa: E731
    rows = []
    for nproc, per in ws["jobs"].items():
        for m, r in per.items():
            goal = nproc == "4" and m == "fork"
            met = " / ".join("yes" if r[k]["ratio"] <= WARM_TARGET[k] else "no" for k in ("cpu", "wall"))
            target = f"<= {WARM_TARGET['cpu']}x / <= {WARM_TARGET['wall']}x | {met} |" if goal else "(reported) | - |"
            rows.append(f"| {nproc}-rank job | labkit launch, {m} / plain torchrun | {cell(r['cpu'])} | "
                        f"{cell(r['wall'])} | {len(r['cpu']['pair_ratios'])} | {target}")
    for nproc, r in ws.get("pools", {}).items():
        a, b = r["methods"]
        rows.append(f"| {nproc}-rank live pool's start | {a} / {b} | {cell(r['cpu'])} | {cell(r['wall'])} "
                    f"| {len(r['cpu']['pair_ratios'])} | (reported) | - |")
    return ["", f"## {WARM_HEADING}", "", _warm_how(ws), "", _warm_reading(ws), "",
            "| what | A / B | CPU: A / B (medians), ratio | wall: A / B (medians), ratio | pairs | target (CPU / wall) "
            "| met |", "| --- | --- | --- | --- | --- | --- | --- |", *rows]


def _warm_how(ws: dict) -> str:
    when = _warm_when(ws)
    spawn = (f" ({ws['spawn_rounds']} for spawn)" if ws.get("spawn_rounds", ws["rounds"]) < ws["rounds"] else "")
    return ("A fresh job of the issue's probe (import torch.distributed.pipelining, init_process_group(\"gloo\"), one "
            "all-reduce, a barrier, destroy) through `labkit launch` started warm (`python -m labkit.launching.warm`), "
            "with each start method ($LABKIT_START_METHOD), against plain `torchrun --standalone` on the same script, "
            f"at {' and '.join(ws['jobs'])} ranks: {ws['rounds']} rounds{spawn}, each side once per round, the order "
            "reversed every other round, after a warm-up run of plain torchrun and of fork; a side's run is paired "
            "with plain torchrun's of the same round. "
            "Wall time is the whole command's; CPU is user + system of the whole process tree (RUSAGE_CHILDREN, "
            "this process a subreaper so that orphans, a forkserver among them, are waited for and counted): the "
            "`labkit launch` command, torchrun's agent, a forkserver, the ranks. A live pool's start: from "
            "`labkit.Ranks(nproc, device=\"cpu\")` to its first cell's value (`pool.exec(\"rank\")`) back, "
            "one start method against the other pair by pair; its CPU is the agent's and the ranks' (psutil, before "
            f"closing the pool), the notebook's own process not counted{'; ' + when if when else ''}.")


def _warm_reading(ws: dict) -> str:
    """The paragraph that reads the table: the goal at 4 ranks, the best start method, the pools."""
    jobs = ws["jobs"]
    sizes = sorted(jobs, key=int)
    methods = list(jobs[sizes[0]])
    fig = lambda nproc, m, k: f"{jobs[nproc][m][k]['ratio']:.2f}x"  # noqa: E731
    text = "Reading: against plain torchrun, " + "; ".join(
        f"a {nproc}-rank job started warm took " + ", ".join(
            f"{fig(nproc, m, 'cpu')} of its CPU and {fig(nproc, m, 'wall')} of its wall time with {m}" for m in methods)
        for nproc in sizes) + "."
    best = {k: {nproc: min(methods, key=lambda m: jobs[nproc][m][k]["ratio"]) for nproc in sizes}
            for k in ("cpu", "wall")}
    for k, word in (("cpu", "CPU"), ("wall", "wall time")):
        winners = set(best[k].values())
        text += (f" The least {word}: {winners.pop()} at every size." if len(winners) == 1 else
                 f" The least {word}: " + ", ".join(f"{best[k][n]} at {n} ranks" for n in sizes) + ".")
    overall = {m for per in best.values() for m in per.values()}
    if len(overall) == 1:
        text += f" The better start method: {overall.pop()}, on both counts at every size."
    if "4" in jobs and "fork" in jobs["4"]:
        f4 = jobs["4"]["fork"]
        met = [f4[k]["ratio"] <= WARM_TARGET[k] for k in ("cpu", "wall")]
        text += (f" The goal for 4 ranks with the default, fork (CPU <= {WARM_TARGET['cpu']}x, wall <= "
                 f"{WARM_TARGET['wall']}x), is {'met' if all(met) else 'missed'}: {f4['cpu']['ratio']:.2f}x and "
                 f"{f4['wall']['ratio']:.2f}x ({f4['cpu']['a_median_s']:.1f} s of CPU against "
                 f"{f4['cpu']['b_median_s']:.1f} s, {f4['wall']['a_median_s']:.1f} s of wall against "
                 f"{f4['wall']['b_median_s']:.1f} s; the worst of its {len(f4['cpu']['pair_ratios'])} pairs "
                 f"{max(f4['cpu']['pair_ratios']):.2f}x and {max(f4['wall']['pair_ratios']):.2f}x).")
    if "fork" in methods:
        cpu = lambda n, m: jobs[n][m]["cpu"]["a_median_s"]  # noqa: E731
        extra = lambda m: ", ".join(f"{cpu(n, m) - cpu(n, 'fork'):+.1f} s at {n} ranks" for n in sizes)  # noqa: E731
        if "forkserver" in methods:
            text += (" A forkserver imports torch once more than fork, in the server the agent starts and waits for: "
                     f"CPU against fork's {extra('forkserver')}.")
        if "spawn" in methods:
            text += (" With spawn every rank imports torch again, as under plain torchrun (its CPU below plain "
                     "torchrun's is of the size that pausing the collector during the imports saves, "
                     f"labkit.core.startup and the start-up rows above): CPU against fork's {extra('spawn')}.")
    for nproc, r in ws.get("pools", {}).items():
        a, b = r["methods"]
        text += (f" A {nproc}-rank live pool started with {a} in {r['wall']['a_median_s']:.1f} s against "
                 f"{r['wall']['b_median_s']:.1f} s with {b} ({r['wall']['ratio']:.2f}x), its processes' CPU "
                 f"{r['cpu']['a_median_s']:.1f} s against {r['cpu']['b_median_s']:.1f} s ({r['cpu']['ratio']:.2f}x).")
    return text


def _on_off_pairs(step_times: list[float], on: list[bool], skip: int = 2) -> list[float]:
    """Step-time ratios (logging step / silent step) of the step pairs (skip, skip+1), ... of one job."""
    ratios = []
    for i in range(skip, len(step_times) - 1, 2):
        if on[i] == on[i + 1]:
            raise ValueError(f"steps {i} and {i + 1} both have PP logs {'on' if on[i] else 'off'}: not an A/B pair")
        logging_step, silent_step = (i, i + 1) if on[i] else (i + 1, i)
        ratios.append(step_times[logging_step] / step_times[silent_step])
    return ratios


def _reference_launch(cfg, runs_root, job_args=(), **run_kw):
    """One quiet run of the kit's reference job (`labkit.run`) for `cfg`, whatever it ends with."""
    from labkit.launching.launch import run

    return run(cfg, job_args=job_args, runs_root=runs_root, **{"progress": False, "stream": "none", "check": False, **run_kw})


def _reference_job(cfg, pp_logs: bool, extra: list[str]) -> dict:
    """result.json of one run of the reference job (quiet, in a throw-away folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _reference_launch(cfg, tmp, extra, pp_logs=pp_logs).result


def _capture_config(preset: str, steps: int):
    """The capture and profiler benchmarks' job: 1F1B, 2 ranks, 4 microbatches."""
    from labkit.config.run import RunConfig

    return RunConfig(schedule="1F1B", pp_size=2, n_microbatches=4, preset=preset, steps=steps)


def capture_within_jobs(n: int = 3, steps: int = 80, preset: str = "small") -> dict:
    """PP log capture's cost step by step inside each job (1F1B, 2 ranks, 4 microbatches).

    Under TORCH_LOGS=+pp (the kit's microsecond format, to the rank's log files) the reference
    script's `--log-ab` turns the pipelining logger on and off between steps, in pairs
    (worker.pp_logs_on_step); `capture` is the median of (logging step / silent step) over every
    pair of n jobs. `control` runs the same jobs without TORCH_LOGS (an A/A test: the ratio that
    noise alone gives). Jobs of the two kinds alternate.
    """
    cfg = _capture_config(preset, steps)

    def in_job(pp_logs: bool) -> list[float]:
        r = _reference_job(cfg, pp_logs, ["--log-ab"])
        return _on_off_pairs(r["step_time_s"], r["step_pp_logs"])

    logged, control = _pairs(lambda: in_job(True), lambda: in_job(False), n)
    return {"capture": {**_spread([x for ps in logged for x in ps]), "method": "within jobs, step pairs",
                        "jobs": n, "steps": steps},
            "control": {**_spread([x for ps in control for x in ps]), "method": "same jobs without TORCH_LOGS (A/A)"}}


def spans_within_jobs(n: int = 3, steps: int = 80, preset: str = "small") -> dict:
    """Span recording's cost step by step inside each job (labkit.spans; 1F1B, 2 ranks, 4 microbatches).

    The reference job's `--spans-ab` turns recording on and off between steps in the same pairs as
    the capture A/B, without PP logs (spans alone); `spans` is the median of (recording step / silent
    step) over every pair of n jobs; `control` is the A/A test of the capture benchmark's kind (the
    same jobs, recording off on both sides of each pair)."""
    cfg = _capture_config(preset, steps)

    def in_job(ab: bool) -> list[float]:
        r = _reference_job(cfg, False, ["--spans-ab"] if ab else [])
        on = r.get("step_spans") or [worker_pairs(i) for i in range(len(r["step_time_s"]))]
        return _on_off_pairs(r["step_time_s"], on)

    rec, control = _pairs(lambda: in_job(True), lambda: in_job(False), n)
    return {"spans": {**_spread([x for ps in rec for x in ps]), "method": "within jobs, step pairs",
                      "jobs": n, "steps": steps},
            "control": {**_spread([x for ps in control for x in ps]), "method": "same jobs, no recording (A/A)"}}


def worker_pairs(step: int) -> bool:
    """The step pairing of the in-job A/B (labkit.worker.distributed.pp_logs_on_step), for the A/A control."""
    from labkit.worker.distributed import pp_logs_on_step

    return pp_logs_on_step(step)


def capture_overhead(n: int = 3, steps: int = 80, preset: str = "small", between_jobs: int = 3,
                     between_steps: int = 10) -> dict:
    """PP log capture's cost on the reference job's step time, and the profiler's.

    `capture` and `control` (the figure with the target, and its A/A test): capture_within_jobs.
    Steps of one job share the machine's mood; two jobs in a row do not (their median step times
    differ by up to +-10% here with nothing changed), so `between_jobs`, whole jobs with vs without
    capture pair by pair, is reported beside it and mostly measures that. profiler: between jobs.
    """
    within = capture_within_jobs(n, steps, preset)
    cfg = _capture_config(preset, between_steps)
    step_time = lambda pp_logs, profile=False: statistics.median(
        _reference_job(dataclasses.replace(cfg, profile=profile), pp_logs, [])["step_time_s"][1:])  # step 1 warms up
    logs, none_a = _pairs(lambda: step_time(True), lambda: step_time(False), between_jobs)
    prof, none_b = _pairs(lambda: step_time(False, True), lambda: step_time(False), between_jobs)
    return {**within,
            "between_jobs": {**_ratio(logs, none_a), "steps": between_steps},
            "profiler": {**_ratio(prof, none_b), "steps": between_steps}, "preset": preset}


def _readings(run_dir) -> dict:
    """One profiled run's last step read by every instrument: bubble fraction from spans, the profiler,
    and the three log readings (raw: waits folded into the next action; split; trimmed)."""
    from labkit.timeline.compare import load_timeline, one_step
    from labkit.logs import timeline_from_path

    spans = load_timeline(run_dir, "spans")
    steps = spans.meta["steps"]

    def last(tl):
        tl.meta["steps"] = steps  # every reading holds the same steps: keep the last
        return one_step(tl).metrics()["bubble_fraction"]

    out = {"spans": last(spans), "profiler": last(load_timeline(run_dir, "profiler")),
           "logs raw": last(timeline_from_path(run_dir, waits="fold")),
           "logs split": last(timeline_from_path(run_dir, waits="split")),
           "logs trimmed": last(timeline_from_path(run_dir, waits="trim"))}
    return {k: round(v, 4) for k, v in out.items()}


def instrument_fidelity(steps: int = 3) -> list[dict]:
    """The instruments on ms-scale real models (issue: exact timelines): the tiny tutorial Transformer
    (1F1B and Interleaved1F1B, `labkit run --profile`) and a learner-sized MLP (scripts/mlp_pipeline.py,
    hidden 256 and 4096, through `labkit launch`), each one profiled job: every reading of its last step."""
    from labkit import RunConfig
    from labkit.launching.launch import launch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in ("1F1B", "Interleaved1F1B"):
            cfg = RunConfig(schedule=schedule, preset="tiny", steps=steps, profile=True, device="cpu")
            r = _reference_launch(cfg, tmp)
            rows.append({"model": "tutorial Transformer (tiny)", "schedule": schedule, **_readings(r.run_dir)})
        for hidden in (256, 4096):
            r = launch(REPO_ROOT / "scripts" / "mlp_pipeline.py", ["--hidden", str(hidden), "--steps", str(steps),
                                                                  "--profile"],
                       nproc=2, runs_root=tmp, progress=False, stream="none")
            rows.append({"model": f"MLP 64-{hidden}-64", "schedule": "1F1B", **_readings(r.run_dir)})
    return rows


def _instrument_rows(rows: list[dict] | None) -> list[str]:
    if not rows:
        return []
    out = ["", "Instruments on ms-scale real models (last of 3 steps, one profiled job each; error = reading - "
           "spans):", "",
           "| model | schedule | spans | profiler (err) | logs raw (err) | logs split (err) | logs trimmed (err) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cell = lambda k: f"{r[k]:.3f} ({r[k] - r['spans']:+.3f})"  # noqa: E731
        out.append(f"| {r['model']} | {r['schedule']} | {r['spans']:.3f} | {cell('profiler')} | {cell('logs raw')} | "
                   f"{cell('logs split')} | {cell('logs trimmed')} |")
    return out


def fidelity(shapes=((2, 2), (2, 4), (2, 8), (4, 4), (4, 8)), schedules=("GPipe", "1F1B"),
             fwd_ms: float = 30, bwd_ms: float = 60) -> list[dict]:
    """Measured (spans, the kit's default reading) vs ideal (closed form) bubble on the controlled workload."""
    from labkit.timeline.compare import measured_vs_ideal
    from labkit.theory import closed_form_bubble
    from labkit.models.workload import WorkloadConfig
    from labkit.launching.controlled import run_controlled

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in schedules:
            for p, m in shapes:
                if schedule == "1F1B" and m < p:
                    continue  # torch refuses 1F1B with fewer microbatches than stages
                cfg = WorkloadConfig(schedule=schedule, pp_size=p, n_microbatches=m, fwd_ms=fwd_ms, bwd_ms=bwd_ms)
                r = run_controlled(cfg, runs_root=tmp, progress=False, stream="none")
                _, _, s = measured_vs_ideal(r.run_dir)
                rows.append({"schedule": schedule, "pp_size": p, "n_microbatches": m,
                             "measured_bubble": round(s["measured_bubble_fraction"], 4),
                             "ideal_bubble": round(closed_form_bubble(p, m), 4),
                             "fitted_ideal_bubble": round(s["ideal_bubble_fraction"], 4)})
    return rows


def _fixture_lines() -> list[str]:
    fx = sorted((REPO_ROOT / "tests" / "fixtures" / "pplogs").glob("*/ZBVZeroBubble-p4-m8/**/stderr.log"))
    if not fx:
        fx = sorted((REPO_ROOT / "tests" / "fixtures" / "pplogs").glob("**/stderr.log"))
    return fx[0].read_text().splitlines()


def parser_throughput(sizes=(10_000, 100_000, 1_000_000), repeats: int = 3) -> dict:
    """Lines per second of the parser (`parse_lines`) on a real log repeated (times shifted) to each
    size, and of the whole log -> timeline path (`parse_lines` + `to_timeline`) beside it.

    Best of `repeats` runs per size (as `timeit` does: on a shared machine noise only ever adds time).
    """
    import gc

    from labkit.logs import parse_lines, to_timeline

    base = [l for l in _fixture_lines() if l[:1].isdigit()]
    t0 = float(base[0].split(" ", 1)[0])
    span = float(base[-1].split(" ", 1)[0]) - t0 + 0.01
    out = {}
    for n in sizes:
        lines = []
        k = 0
        while len(lines) < n:
            shift = k * span
            lines += [f"{float(l.split(' ', 1)[0]) + shift:.6f} {l.split(' ', 1)[1]}\n" for l in base]
            k += 1
        lines = lines[:n]
        parse_s = total_s = float("inf")
        for _ in range(repeats):
            gc.collect()  # the previous repeat's events go before the clock starts
            t = time.perf_counter()
            events = parse_lines(lines, rank=0)
            t1 = time.perf_counter()
            tl = to_timeline(events)
            t2 = time.perf_counter()
            parse_s, total_s = min(parse_s, t1 - t), min(total_s, t2 - t)
            n_actions = len(tl.actions)
            events = tl = None
        out[str(n)] = {"lines_per_s": n / parse_s, "seconds": parse_s, "timeline_lines_per_s": n / total_s,
                       "timeline_seconds": total_s, "actions": n_actions, "repeats": repeats}
    sizes_sorted = sorted(out, key=int)
    small, big = out[sizes_sorted[0]], out[sizes_sorted[-1]]
    out["linearity"] = (big["seconds"] / int(sizes_sorted[-1])) / (small["seconds"] / int(sizes_sorted[0]))
    return out


# Live ranks: the same 1F1B step (tiny preset, 2 ranks) as a cell on a warm pool and as a fresh job.
LIVE_SETUP = textwrap.dedent("""
    from labkit.config.run import RunConfig
    from labkit.models.tutorial import build_model, make_batch, tokenwise_loss_fn
    from labkit.worker.stages import build_schedule, build_stages
    cfg = RunConfig(schedule="1F1B", pp_size=world_size, n_microbatches=4, preset="tiny")
    full = build_model(cfg)
    stages, _ = build_stages(cfg, full, rank, device)
    schedule = build_schedule(cfg, stages, tokenwise_loss_fn)
    x, y = make_batch(cfg, device)
""")
LIVE_STEP = textwrap.dedent("""
    losses = []
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
    print(f"rank {rank}: stepped, {len(losses)} losses")
""")
LIVE_JOB = ("import os, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "rank, world_size, device = dist.get_rank(), dist.get_world_size(), torch.device('cpu')\n"
            + LIVE_SETUP + LIVE_STEP + "dist.barrier()\ndist.destroy_process_group()\n")
NOTEBOOKS_BEFORE_LIVE_RANKS_S = 250.0  # the notebook suite in the bench of commit 740ea78 (before live ranks)


def live_ranks(n: int = 5, round_trips: int = 50) -> dict:
    """A 1F1B step sent as a cell to 2 warm ranks vs the same code as a fresh `labkit launch` job, end to
    end: from sending the code to having its output and its measured timeline back. Interleaved pair by
    pair. Also an empty cell's round trip."""
    from labkit.timeline.compare import load_timeline
    from labkit.launching.launch import launch
    from labkit.ranks import Ranks

    expected = {(s, k): 4 for s in (0, 1) for k in ("F", "B")}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "one_step.py"
        script.write_text(LIVE_JOB)
        with Ranks(nproc=2, device="cpu", runs_root=tmp, live="print") as pool:
            pool.exec(LIVE_SETUP)

            def cell() -> float:
                t = time.perf_counter()
                pool.exec(LIVE_STEP)
                assert pool.timeline().counts() == expected
                return time.perf_counter() - t

            def fresh() -> float:
                t = time.perf_counter()
                r = launch(script, nproc=2, runs_root=tmp, progress=False, stream="none")
                assert load_timeline(r.run_dir).counts() == expected
                return time.perf_counter() - t

            fresh_s, cell_s = _pairs(fresh, cell, n)
            pool.exec("pass")
            trips = []
            for _ in range(round_trips):
                t = time.perf_counter()
                pool.exec("pass")
                trips.append(time.perf_counter() - t)
    return {**_ratio(fresh_s, cell_s), "fresh_job_median_s": statistics.median(fresh_s),
            "cell_median_s": statistics.median(cell_s), "empty_cell_median_ms": 1000 * statistics.median(trips),
            "empty_cell_max_ms": 1000 * max(trips), "round_trips": round_trips}


# The check's cost: one 1F1B step on 2 CPU ranks, then check_step (the whole model on every rank) and check_stages
# (each rank's slices only) on it, each call's wall time, CPU time and peak memory per rank, on a warm pool.
CHECK_HEADING = "labkit/worker/stagewise.py and boundaries.py: the check's cost"
CHECK_MODELS = {"small_lm": {"dim": 256, "n_blocks": 8, "batch": 16, "seq": 64},
                "llama": {"dim": 256, "n_blocks": 8, "batch": 16, "seq": 64}}
CHECK_SETUP = textwrap.dedent("""
    import ctypes, dataclasses, gc, re, time
    import torch, torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    import labkit, labkit.worker

    M = 4  # microbatches
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())

    def rss():
        # (resident bytes, their high-water mark) of this process
        s = open("/proc/self/status").read()
        return tuple(int(re.search(k + r":\\s+(\\d+) kB", s).group(1)) * 1024 for k in ("VmRSS", "VmHWM"))

    def measured(fn):
        # fn()'s value, wall and CPU time (the rank's threads) and peak resident bytes above what the rank held
        # just before (what was free handed back to the system first, so that the call cannot reuse it unseen)
        gc.collect(); ctypes.CDLL(None).malloc_trim(0); dist.barrier()
        before = rss()[0]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the resident set now
        t, cpu = time.perf_counter(), time.process_time()
        out = fn()
        return out, {"s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu, "peak_bytes": rss()[1] - before}

    def small_lm_parts(dim, n_blocks, batch, seq):
        from labkit.models import cut_small_lm, lm_loss, small_lm
        blocks = list(range(rank * n_blocks // 2, (rank + 1) * n_blocks // 2))  # halves: stage = rank
        first, last = rank == 0, rank == 1
        full = small_lm(n_blocks, dim=dim)
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 128, (batch, seq), generator=g) for _ in range(2))
        return dict(full=full, stage=cut_small_lm(full, blocks, first, last), slice=small_lm(blocks=blocks, first=first,
                    last=last, dim=dim), x=x, y=y, kw={}, loss_fn=lm_loss, bug=f"blocks.{n_blocks - 1}.down")

    def llama_parts(dim, n_blocks, batch, seq):
        from labkit import PRESETS
        from labkit.models import hf
        pre = dataclasses.replace(PRESETS["small"], dim=dim, n_layers=n_blocks, batch_size=batch, seq_len=seq)
        bounds = [0, n_blocks // 2, n_blocks]
        x, y, kw = hf.make_batch("llama", pre, batch, 0)
        return dict(full=hf.meta_stage("llama", pre, 0, [0, n_blocks], device),
                    stage=hf.meta_stage("llama", pre, rank, bounds, device),
                    slice=hf.meta_stage("llama", pre, rank, bounds, device), x=x, y=y, kw=kw, loss_fn=hf.loss_fn,
                    bug=f"model.layers.{n_blocks - 1}.mlp.down_proj")

    def prepare(model, **sizes):
        # this rank's stage, its slice and the whole model; the bytes of parameters each holds
        global P, SCHED
        P = None; gc.collect()
        P = {"small_lm": small_lm_parts, "llama": llama_parts}[model](**sizes)
        P["pipe"] = PipelineStage(P["stage"], rank, 2, device)
        SCHED = Schedule1F1B(P["pipe"], M, loss_fn=P["loss_fn"])
        return {k: size(P[k]) for k in ("stage", "full", "slice")}

    def step():
        P["stage"].zero_grad(set_to_none=True)  # the step allocates its gradients, as after an optimizer's step
        losses = []
        SCHED.step(P["x"], **P["kw"]) if rank == 0 else SCHED.step(target=P["y"], losses=losses, **P["kw"])
        return losses

    def one_round(order, bug=False):
        # a step, then both checks of it in `order`; with `bug`, a 1% error in one module of the last stage
        hook = P["stage"].get_submodule(P["bug"]).register_forward_hook(lambda m, a, o: o * 1.01) \\
            if bug and rank == 1 else None
        out = {}
        losses, out["step"] = measured(step)
        args = ([P["pipe"]], P["x"], P["y"], losses, M, P["loss_fn"])
        checks = {"check_step": lambda: labkit.check_step(P["full"], *args, kwargs=P["kw"]),
                  "check_stages": lambda: labkit.worker.check_stages({rank: P["slice"]}, *args, kwargs=P["kw"])}
        for name in order:
            check, out[name] = measured(checks[name])
            out[name]["ok"] = check.ok
        if hook is not None:
            hook.remove()
        return out
""")
CHECKS = ("check_step", "check_stages")
CHECK_PHASES = ("step", *CHECKS)


def _medians(rounds: list[dict]) -> dict:
    """{phase: median seconds, CPU seconds and peak bytes over the rounds, and in how many the check passed}."""
    return {p: {**{k: statistics.median(r[p][k] for r in rounds) for k in ("s", "cpu_s", "peak_bytes")},
                **({"passed": sum(r[p]["ok"] for r in rounds)} if "ok" in rounds[0][p] else {})}
            for p in CHECK_PHASES if p in rounds[0]}


def check_cost(models: dict = CHECK_MODELS, repeats: int = 5, failing: int = 3) -> dict:
    """Per rank, the wall time and peak memory of one 1F1B step (2 CPU ranks, 4 microbatches) and of
    `check_step` and `check_stages` on it, medians of `repeats` rounds (the checks' order alternating),
    each model on the same warm pool; then `failing` rounds with a 1% error planted in one module of the
    last stage (the checks fail and replay each stage in float64, labkit.worker.boundaries)."""
    from labkit.ranks import Ranks

    orders = [("check_step", "check_stages"), ("check_stages", "check_step")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Ranks(nproc=2, device="cpu", runs_root=tmp, live="print") as pool:
        run = lambda call: pool.exec(call, timeout=600)  # noqa: E731
        microbatches = run(CHECK_SETUP + "M")[0]
        for model, sizes in models.items():
            held = run(f"prepare({model!r}, **{sizes!r})")
            if WARM_UP:
                run(f"one_round({orders[0]!r})")
            good = [run(f"one_round({orders[i % 2]!r})") for i in range(repeats)]
            bad = [run(f"one_round({orders[i % 2]!r}, bug=True)") for i in range(failing)]
            ranks = {str(r): {"held_bytes": held[r], **_medians([g[r] for g in good]),
                              **({"failing": _medians([b[r] for b in bad])} if bad else {})} for r in sorted(held)}
            wrong = [f"rank {r}: {p}" for r, v in ranks.items() for p in CHECKS
                     if v[p]["passed"] < repeats or v.get("failing", {}).get(p, {}).get("passed")]
            if wrong:
                raise RuntimeError(f"{model}: a check passed with the planted bug or failed without it: {wrong}")
            rows.append({"model": model, **sizes, "microbatches": microbatches, "ranks": ranks})
    return {"models": rows, "repeats": repeats, "failing": failing}


def _span(values, unit: str = "x") -> str:
    """'1.2-3.4x' (the smallest and largest of `values`), or '1.2x' when they read the same."""
    lo, hi = f"{min(values):.1f}", f"{max(values):.1f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def _check_cost_rows(cc: dict | None) -> list[str]:
    """RESULTS.md's section of the check's cost: how it was measured, a reading, a row per model and rank."""
    if not cc:
        return []
    ranks = [(m, r, v) for m in cc["models"] for r, v in m["ranks"].items()]
    return ["", f"## {CHECK_HEADING}", "", _check_cost_how(cc), "", _check_cost_reading(cc, [v for _, _, v in ranks]),
            "", "| model | rank | held: stage / whole model / slice | step: time, peak | check_step: time (x step), "
            "peak (x step) | check_stages: time (x step), peak (x step) | failing check_step: time above passing, peak "
            "| failing check_stages: time above passing, peak |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *(_check_cost_row(m["model"], r, v) for m, r, v in ranks)]


def _mb(n: float) -> str:
    return f"{n / 2 ** 20:.0f} MB"


def _check_cost_how(cc: dict) -> str:
    models = "; ".join(f"{m['model']} (dim {m['dim']}, {m['n_blocks']} blocks, batch {m['batch']} x seq {m['seq']}"
                       + (", every part materialised from meta" if m["model"] == "llama" else "") + ")"
                       for m in cc["models"])
    when = f"; measured {cc['date']}, torch {cc['torch']}" if cc.get("date") else ""
    if cc.get("load"):
        when += (f", load average {cc['load'][0]} at the start and {cc['load'][1]} at the end on {os.cpu_count()} "
                 "cores (other work shares them: wall times scatter, CPU times less)")
    return (f"One 1F1B step on 2 CPU ranks (gloo, {cc['models'][0]['microbatches']} microbatches, a warm "
            "`labkit.Ranks` pool), then `labkit.check_step` and `labkit.worker.check_stages` of it, per rank: wall "
            f"time, CPU time (the rank's threads) and peak memory, medians of {cc['repeats']} rounds (the checks' "
            f"order alternating){when}. Models: {models}. Peak memory is the rank process's resident set (RSS) "
            "high-water mark during the call minus its RSS just before (Linux VmHWM, reset through "
            "/proc/self/clear_refs, after gc.collect() and malloc_trim(0) handed back what was free): what the call "
            "adds to what the rank holds. The step's includes its gradients (set to None before it) and "
            "activations. 'held': the parameters' bytes of the rank's stage, of the whole model check_step needs on "
            "every rank, and of the slice check_stages needs instead; held before the call, so not in its peak.")


def _check_cost_reading(cc: dict, ranks: list[dict]) -> str:
    """The paragraph that reads the table, its figures the smallest and largest over models and ranks."""
    ratio = lambda a, b, k: _span([v[a][k] / v[b][k] for v in ranks])  # noqa: E731
    text = (f"Reading: check_step took {ratio('check_step', 'step', 's')} the step's wall time and "
            f"{ratio('check_step', 'step', 'peak_bytes')} its peak; check_stages {ratio('check_stages', 'step', 's')} "
            f"and {ratio('check_stages', 'step', 'peak_bytes')}. check_step runs the whole model on every rank three "
            "times on the whole batch (whole batch, microbatched, and a float64 copy); its peak is mostly those "
            "references' activations (the float64 run's at twice float32's bytes), far above the parameters' "
            "bytes. check_stages runs the same three references on each rank's slice only (a float64 copy of the "
            f"slice), chained along the pipeline: its peak was {ratio('check_stages', 'check_step', 'peak_bytes')} "
            f"of check_step's and its CPU time {ratio('check_stages', 'check_step', 'cpu_s')}, since it follows the "
            f"stage, not the model; its wall time {ratio('check_stages', 'check_step', 's')}, since a rank waits "
            "while the other runs its part of the chain, where check_step's ranks compute side by side.")
    if not cc.get("failing"):
        return text
    cpu = [_span([v["failing"][p]["cpu_s"] - v[p]["cpu_s"] for v in ranks], " s") + f" of CPU to {p}" for p in CHECKS]
    rounds = f"medians of {cc['failing']} rounds" if cc["failing"] > 1 else "one round"
    return text + (f" Failing ({rounds}, a 1% error planted in one module of the last stage "
                   "by a forward hook): the checks then replay each stage in float64, every module's input and output "
                   "held against the reference's (labkit.worker.boundaries, located), which added "
                   f"{' and '.join(cpu)}, at "
                   + " and ".join(_span([v["failing"][p]["peak_bytes"] / v[p]["peak_bytes"] for v in ranks])
                                  for p in CHECKS) + " their passing peaks.")


def _check_cost_row(model: str, rank: str, v: dict) -> str:
    held, step = v["held_bytes"], v["step"]
    check = lambda c: (f"{c['s']:.2f} s ({c['s'] / step['s']:.1f}x; CPU {c['cpu_s']:.2f} s), "  # noqa: E731
                       f"{_mb(c['peak_bytes'])} ({c['peak_bytes'] / step['peak_bytes']:.1f}x)")
    failed = lambda p, f: (f"+{f['s'] - v[p]['s']:.2f} s (CPU +{f['cpu_s'] - v[p]['cpu_s']:.2f} s), "  # noqa: E731
                           f"{_mb(f['peak_bytes'])}" if f else "-")
    return (f"| {model} | {rank} | {_mb(held['stage'])} / {_mb(held['full'])} / {_mb(held['slice'])} | "
            f"{step['s']:.2f} s (CPU {step['cpu_s']:.2f} s), {_mb(step['peak_bytes'])} | {check(v['check_step'])} | "
            f"{check(v['check_stages'])} | " + " | ".join(failed(p, v.get("failing", {}).get(p)) for p in CHECKS)
            + " |")


def notebook_suite() -> float:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
                        "--nbval-sanitize-with", str(REPO_ROOT / "notebooks" / "sanitize.cfg"),
                        str(REPO_ROOT / "notebooks")], cwd=REPO_ROOT, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError("notebook suite failed:\n" + p.stdout[-3000:])
    return time.perf_counter() - t


def gpu(schedules=("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"),
        steps: int = 5) -> dict | None:
    """The tutorial preset on one GPU: world size 1, all stages on it; step time per schedule."""
    import torch

    if not torch.cuda.is_available():
        return None
    from labkit.config.run import RunConfig
    from labkit.launching.launch import run

    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "schedules": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for s in schedules:
            cfg = RunConfig(schedule=s, pp_size=1, stages_per_rank=2 if s in ("ZBVZeroBubble", "DualPipeV") else 4,
                            n_microbatches=8, preset="tutorial", device="cuda", steps=steps)
            r = run(cfg, runs_root=tmp, progress=False, stream="none", check=False)
            res = r.result or {}
            out["schedules"][s] = {"status": r.status, "reference_match": res.get("reference_match"),
                                   "max_abs_diff": res.get("max_abs_diff"),
                                   "median_step_s": statistics.median(res["step_time_s"][1:]) if res.get("step_time_s") else None,
                                   "peak_memory_bytes": res.get("peak_memory_bytes")}
    if torch.cuda.device_count() >= 2:  # the tutorial's program as written: one GPU per rank
        out["tutorial_vs_kit"] = tutorial_vs_kit(sizes="tutorial", steps=steps, n=3, device="cuda")
    else:
        out["tutorial_vs_kit"] = {"ratio": None, "reason": (
            "the tutorial's program needs 2 GPUs as written (cuda:{rank}, NCCL refuses two ranks on one GPU); "
            f"this machine has {torch.cuda.device_count()}. The CPU ratio is `tutorial_vs_kit` at the top level.")}
    return out


TUTORIAL_SCRIPT = REPO_ROOT / "scripts" / "tutorial_as_written.py"


def tutorial_vs_kit(sizes: str = "small", steps: int = 10, n: int = 3, device: str = "cpu") -> dict:
    """Median step time of the kit's reference job over the official tutorial's program as written.

    Same work on both sides: 2 ranks, the manual split in halves, GPipe over 4 microbatches, the
    tutorial's layout and sizes (`sizes`: a preset name). Both go through `labkit.launching.launch` without
    PP log capture, so the ratio is the scripts' difference alone. Step 1 of each run is left out.
    device "cpu" hides GPUs from both (the tutorial picks `cuda:{rank}` whenever CUDA is there).
    """
    from labkit.config.run import RunConfig
    from labkit.launching.launch import launch

    cfg = RunConfig(schedule="GPipe", pp_size=2, n_microbatches=4, preset=sizes, layout="tutorial",
                    split="manual", steps=steps, device=device)
    quiet = {"pp_logs": False, "env": {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None, "check": False}

    def median_step(start) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            # check=False: with the tutorial's layout the kit's job reports the mismatch it is known for
            # (exit 3, notebook 03); its step times are still real. Anything else is a failure.
            r = start(tmp)
            known_mismatch = (r.result or {}).get("reference_match") is False and r.failed_rank is not None
            if not (r.ok or known_mismatch) or not (r.result or {}).get("step_time_s"):
                raise RuntimeError(f"benchmark job failed ({r.status}):\n{r.error}")
            return statistics.median(r.result["step_time_s"][1:])

    kit = lambda: median_step(lambda tmp: _reference_launch(cfg, tmp, **quiet))
    tutorial = lambda: median_step(lambda tmp: launch(TUTORIAL_SCRIPT, ["--sizes", sizes, "--steps", str(steps)],
                                                      nproc=2, runs_root=tmp, progress=False, stream="none", **quiet))
    return {**_ratio(*_pairs(kit, tutorial, n)), "sizes": sizes, "steps": steps, "device": device}


def paper_comparison(search_models=("1.5B", "6.2B", "14.6B", "28.3B"), search_max_m: int = 256,
                     time_limit: float = 0.0) -> dict:
    """The zero-bubble paper's bubble rates (arXiv:2401.10241v1 Table 5, from its Table 9 costs) beside the
    kit's: 1F1B, ZB-H1, ZB-H2 simulated at all 12 settings; the kit's search (memory limits p and 2p, the
    paper's ZB-1p / ZB-2p, with the paper's memory count R = 32h/(34h+5as); seeds and the authors'
    heuristic, then polished) at every setting by default, with the exact model for `time_limit` seconds per
    search when > 0 (needs OR-Tools). Each search's seconds, proven bound, whether it meets it (`optimal`)
    and whether it is at or below the printed rate unrounded are in its row's "searched"; the whole table's
    time in "seconds", and the counts in "at_or_below" / "optimal_above"."""
    from labkit.theory import paper

    chosen = [s for s in paper.SETTINGS if s.model in search_models and s.m <= search_max_m]
    t0 = time.monotonic()
    rows = paper.comparison(search_settings=chosen, time_limit=time_limit)
    found = [f for r in rows for f in r["searched"].values()]
    return {"citation": paper.CITATION, "time_limit": time_limit, "rows": rows,
            "seconds": round(time.monotonic() - t0, 1), "cpus": os.cpu_count(), "load": round(os.getloadavg()[0], 1),
            "searched": len(found), "at_or_below": sum(f["at_or_below_paper"] for f in found),
            "optimal_above": sum(f["optimal"] and not f["at_or_below_paper"] for f in found)}


def _paper_rows(pc: dict | None) -> list[str]:
    if not pc:
        return []
    cols = ("1F1B", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p")

    def cell(r, k):
        if k not in r["kit"]:
            return f"{r['paper'][k]:.4f} / -"
        if k not in r["searched"]:
            return f"{r['paper'][k]:.4f} / {r['kit'][k]:.4f}"
        f = r["searched"][k]
        mark = "<=" if f.get("at_or_below_paper") else ("optimal" if f.get("optimal") else "ABOVE")
        return f"{r['paper'][k]:.4f} / {r['kit'][k]:.6f} {mark} ({f['seconds']:.1f} s)"

    counts = (f" {pc['at_or_below']} of the {pc['searched']} searched rates are at or below the printed ones unrounded; "
              f"the other {pc['optimal_above']} are provably optimal (they meet the closed-form bound of "
              "`labkit.theory.bounds`, so no order does better) and equal print to its 4 decimals: the printed rate "
              "is that optimum rounded." if pc.get("searched") else "")
    lines = ["", f"Zero-bubble paper vs the kit: bubble rate = (longest stage - m(F+B+W)) / longest stage, paper / kit "
             f"({pc['citation']}{'; computed ' + pc['date'] if pc.get('date') else ''}). The kit simulates torch's 1F1B and "
             "the paper's handcrafted ZB-H1 / ZB-H2 orders with Table 9's costs; its ZB-1p / ZB-2p are `labkit.theory.search` "
             "at memory limits p / 2p microbatches with the paper's memory count (W holds R = 32h/(34h+5as) of a microbatch's "
             "activations after B; seeded with ZB-H1 / ZB-H2 and the authors' own heuristic, `labkit.theory.zbheuristic`, "
             "then polished, `labkit.theory.polish`: a forward or W pulled into a wait; CP-SAT too where a time limit is "
             f"given, here {pc.get('time_limit', 0):g} s; ranked by the same longest stage, so never above the seeds; "
             "'<=': at or below print unrounded, 'optimal': above print but meeting the proven bound; seconds per search; "
             "'-': not searched). 1F1B-I is not reproduced (per-chunk costs not in the paper)." + counts
             + (f" The whole table took {pc['seconds']} s ({pc['cpus']} CPUs, load average {pc['load']})." if "seconds" in pc else ""), "",
             "| model | p | m | " + " | ".join(cols) + " | 1F1B-I (paper) |", "| --- | --- | --- |" + " --- |" * (len(cols) + 1)]
    for r in pc["rows"]:
        lines.append(f"| {r['model']} | {r['p']} | {r['m']} | " + " | ".join(cell(r, k) for k in cols)
                     + f" | {r['paper']['1F1B-I']:.4f} |")
    return lines


def _torch() -> str:
    from importlib import metadata

    return metadata.version("torch")


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def run_all(quick: bool = False, notebooks: bool = True) -> dict:
    import torch

    say = lambda m: print(f"[bench] {m}", flush=True)
    res: dict = {"machine": machine()["platform"], "machine_detail": machine(), "torch": torch.__version__,
                 "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "quick": quick}
    say("launch overhead")
    lo = launch_overhead(n=1 if quick else 15)
    res["launch_overhead_ratio"], res["launch_overhead"] = lo["ratio"], lo
    say("capture and profiler overhead")
    co = capture_overhead(n=1 if quick else 3, steps=8 if quick else 80, preset="tiny" if quick else "small",
                          between_jobs=1 if quick else 3, between_steps=4 if quick else 10)
    res["capture_overhead_ratio"], res["profiler_overhead_ratio"] = co["capture"]["ratio"], co["profiler"]["ratio"]
    res["capture_overhead"] = co
    say("span recording overhead")
    so = spans_within_jobs(n=1 if quick else 3, steps=8 if quick else 80, preset="tiny" if quick else "small")
    res["spans_overhead_ratio"], res["spans_overhead"] = so["spans"]["ratio"], so
    say("instruments on real models (spans, profiler, logs)")
    res["instrument_fidelity"] = instrument_fidelity()
    say("start-up CPU with the collector paused during torch's imports, and without")
    res["startup"] = {**startup_cost(n=1 if quick else 5), "torch": torch.__version__}
    say("fidelity")
    res["fidelity"] = fidelity(shapes=((2, 4),) if quick else ((2, 2), (2, 4), (2, 8), (4, 4), (4, 8)),
                               fwd_ms=20 if quick else 30, bwd_ms=40 if quick else 60)
    say("parser throughput")
    pt = parser_throughput((1_000, 10_000) if quick else (10_000, 100_000, 1_000_000))
    res["parser_linearity"] = pt.pop("linearity")
    res["parser_lines_per_s"] = {k: v["lines_per_s"] for k, v in pt.items()}
    res["log_to_timeline_lines_per_s"] = {k: v["timeline_lines_per_s"] for k, v in pt.items()}
    res["parser_detail"] = pt
    if notebooks and not quick:
        say("notebook suite under nbval")
        res["notebook_suite_s"] = notebook_suite()
    else:
        res["notebook_suite_s"] = None
    say("live ranks: a step cell on warm ranks vs a fresh job; an empty cell's round trip")
    res["live_ranks"] = live_ranks(n=2 if quick else 5, round_trips=10 if quick else 50)
    say("kit's reference job vs the tutorial's program as written (CPU)")
    tk = tutorial_vs_kit(sizes="tiny" if quick else "small", steps=4 if quick else 10, n=1 if quick else 3)
    res["tutorial_vs_kit_ratio"], res["tutorial_vs_kit"] = tk["ratio"], tk
    say("zero-bubble paper's bubble rates vs the kit's simulator and search")
    res["paper_comparison"] = paper_comparison(search_max_m=0 if quick else 32)
    say("the check's cost: check_step and check_stages vs the step, per rank")
    res["check_cost"] = check_cost({"small_lm": {"dim": 64, "n_blocks": 4, "batch": 8, "seq": 16}}, 1, 1) \
        if quick else check_cost()
    say("ranks started warm: fresh jobs by start method vs plain torchrun; a live pool's start")
    load = os.getloadavg()[0]
    ws = warm_start(n=1 if quick else 5, nprocs=(2,) if quick else (2, 4), pool_pairs=1 if quick else 3)
    res["warm_start"] = {**ws, "torch": torch.__version__, "load": [round(load, 1), round(os.getloadavg()[0], 1)]}
    say("gpu")
    g = gpu() if not quick else None
    res["gpu"] = g if g is not None else {"available": False, "reason": "no CUDA device on this machine"}
    return res


def _launch_when(lo: dict) -> str:
    """'; median of N pairs, measured <date>, torch <v>' for a row updated with --only launch."""
    parts = [f"median of {len(lo['pair_ratios'])} pairs"] if lo.get("pair_ratios") else []
    parts += [f"measured {lo['date']}"] if lo.get("date") else []
    parts += [f"torch {lo['torch']}"] if lo.get("torch") else []
    parts += [f"load average {lo['load'][0]} at the start, {lo['load'][1]} at the end on {os.cpu_count()} cores"] \
        if lo.get("load") else []
    return "; " + ", ".join(parts) if parts else ""


def _launch_detail_rows(lo: dict) -> list[str]:
    rows = []
    if "pair_ratio_iqr" in lo:
        lo_q, hi_q = lo["pair_ratio_iqr"]
        rows.append(f"| launch overhead: middle half of the {len(lo['pair_ratios'])} pair ratios | {lo_q:.3f}x - {hi_q:.3f}x "
                    f"| (spread) | - |")
    if "kit_outside_torchrun_s" in lo:
        rows.append(f"| launch: the kit's own time outside torchrun (start-up, run directory), share of a plain run "
                    f"| {lo['kit_outside_torchrun_s']:.3f} s ({lo['kit_outside_share']:.1%}) | <= 5% | "
                    f"{'yes' if lo['kit_outside_share'] <= 0.05 else 'no'} |")
    return rows


def _capture_detail_rows(co: dict) -> list[str]:
    if "control" not in co:
        return []
    c, aa, bj = co["capture"], co["control"], co["between_jobs"]
    span = lambda r: f"{r['pair_ratio_iqr'][0]:.3f}x - {r['pair_ratio_iqr'][1]:.3f}x"
    return [
        f"| capture: how | within {c['jobs']} jobs of {c['steps']} steps, logger on/off step by step; median of "
        f"{len(c['pair_ratios'])} step pairs (middle half {span(c)}) | - | - |",
        f"| capture: A/A control (same jobs without TORCH_LOGS: what noise alone gives) | {aa['ratio']:.3f}x "
        f"(middle half {span(aa)}) | ~1 | - |",
        f"| capture between whole jobs (median step, {len(bj['pair_ratios'])} job pairs; mostly job-to-job noise) "
        f"| {bj['ratio']:.3f}x (pairs {min(bj['pair_ratios']):.3f}x - {max(bj['pair_ratios']):.3f}x) | (reported) | - |",
    ]


def _spans_rows(so: dict | None) -> list[str]:
    if not so:
        return []
    r, aa = so["spans"], so["control"]
    return [f"| span recording overhead (step time, spans on / off, within {r['jobs']} jobs of {r['steps']} steps; "
            f"median of {len(r['pair_ratios'])} step pairs{', measured ' + so['date'] if so.get('date') else ''}) | "
            f"{r['ratio']:.3f}x | <= 1.03x | "
            f"{'yes' if r['ratio'] <= 1.03 else 'no'} |",
            f"| span recording: A/A control (same jobs, no recording) | {aa['ratio']:.3f}x | ~1 | - |"]


# RESULTS.md from this heading on is kept by hand (figures the modules' docstrings used to carry, each under its
# module's name, with its date); a run of this script rewrites the tables above it and keeps that part as it is.
KEPT_HEADING = "## Figures behind the modules"


def kept_notes(path) -> str:
    """The hand-kept tail of an existing RESULTS.md (from KEPT_HEADING on), "" where there is none."""
    text = path.read_text() if path.exists() else ""
    i = text.find(KEPT_HEADING)
    return "\n" + text[i:] if i >= 0 else ""


def markdown(res: dict) -> str:
    f = res["fidelity"]
    worst = max(abs(r["measured_bubble"] - r["ideal_bubble"]) for r in f) if f else float("nan")
    lines = [
        "# PP Lab benchmark results", "",
        f"Machine: {res['machine']} ({res['machine_detail']['cpus']} CPUs), torch {res['torch']}, {res['date']}.",
        "Every figure is a ratio or fraction measured within this run (A/B interleaved pair by pair); rows that "
        "say 'measured <date>' were updated later with `scripts/bench.py --only`.", "",
        "| measure | result | target | met |", "| --- | --- | --- | --- |",
        f"| launch overhead (labkit launch / plain torchrun, whole process{_launch_when(res.get('launch_overhead') or {})}) "
        f"| {res['launch_overhead_ratio']:.3f}x | <= 1.03x | {'yes' if res['launch_overhead_ratio'] <= 1.03 else 'no'} |",
        *_launch_detail_rows(res.get("launch_overhead") or {}),
        *_warm_rows(res.get("warm_start")),
        f"| PP log capture overhead (step time, +pp to files / none) | {res['capture_overhead_ratio']:.3f}x | <= 1.05x | {'yes' if res['capture_overhead_ratio'] <= 1.05 else 'no'} |",
        *_capture_detail_rows(res.get("capture_overhead") or {}),
        *_spans_rows(res.get("spans_overhead")),
        *_startup_rows(res.get("startup")),
        f"| profiler overhead (step time, profiler / none) | {res['profiler_overhead_ratio']:.3f}x | (reported) | - |",
        f"| fidelity: worst abs(measured - ideal) bubble, {len(f)} shapes | {worst:.3f} | <= 0.05 | {'yes' if worst <= 0.05 else 'no'} |",
    ]
    for n, v in res["parser_lines_per_s"].items():
        lines.append(f"| parser throughput (parse_lines) at {int(n):,} lines | {v:,.0f} lines/s | >= 500k | {'yes' if v >= 5e5 else 'no'} |")
    for n, v in (res.get("log_to_timeline_lines_per_s") or {}).items():
        lines.append(f"| log -> timeline (parser + to_timeline) at {int(n):,} lines | {v:,.0f} lines/s | (reported) | - |")
    lines.append(f"| parser time per line, largest / smallest size | {res['parser_linearity']:.2f} | ~1 (linear) | {'yes' if res['parser_linearity'] < 1.5 else 'no'} |")
    lr = res.get("live_ranks")
    if lr:
        lines += [
            f"| live ranks: fresh 2-rank job / a cell on 2 warm ranks (one 1F1B step, tiny preset, output and "
            f"timeline back; medians {lr['fresh_job_median_s']:.2f} s / {lr['cell_median_s'] * 1000:.0f} ms"
            + (f"; measured {lr['date']}" if lr.get("date") else "") + ") "
            f"| {lr['ratio']:.1f}x faster | >= 20x | {'yes' if lr['ratio'] >= 20 else 'no'} |",
            f"| live ranks: an empty cell's round trip (median of {lr['round_trips']}, max {lr['empty_cell_max_ms']:.1f} ms) "
            f"| {lr['empty_cell_median_ms']:.2f} ms | <= 50 ms | {'yes' if lr['empty_cell_median_ms'] <= 50 else 'no'} |",
        ]
    nb = res.get("notebook_suite_s")
    when = f" (measured {res['notebook_suite_date']})" if res.get("notebook_suite_date") else ""
    lines.append(f"| notebook suite under nbval{when} | {nb:.0f} s | <= 600 s | {'yes' if nb <= 600 else 'no'} |" if nb else
                 "| notebook suite under nbval | not measured | <= 600 s | - |")
    if nb:
        speed = NOTEBOOKS_BEFORE_LIVE_RANKS_S / nb
        lines.append(f"| notebook suite: before live ranks ({NOTEBOOKS_BEFORE_LIVE_RANKS_S:.0f} s, bench of 740ea78) / now "
                     f"(across runs: noisy) | {speed:.2f}x faster | >= 1.5x | {'yes' if speed >= 1.5 else 'no'} |")
    tk = res.get("tutorial_vs_kit")
    if tk:
        lines.append(f"| kit's reference job / the tutorial's program as written (step time, {tk['sizes']} sizes, "
                     f"{tk['device']}) | {tk['ratio']:.3f}x | ~1 (reported) | - |")
    g = res["gpu"]
    if g.get("available") is False:
        lines.append(f"| GPU (tutorial preset, one GPU) | not measured: {g['reason']} | - | - |")
    else:
        for s, v in g["schedules"].items():
            lines.append(f"| GPU {g['device']}: {s} median step | {v['median_step_s']} s, match {v['reference_match']} | - | - |")
        t = g.get("tutorial_vs_kit") or {}
        lines.append(f"| GPU: kit's script / the tutorial's program as written | "
                     + (f"{t['ratio']:.3f}x |" if t.get("ratio") else f"not measured: {t.get('reason')} |") + " - | - |")
    lines += ["", "## Fidelity (bubble fraction = idle share of wall time)", "",
              "| schedule | pp_size | n_microbatches | measured | ideal (p-1)/(m+p-1) |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['schedule']} | {r['pp_size']} | {r['n_microbatches']} | {r['measured_bubble']:.3f} | {r['ideal_bubble']:.3f} |" for r in f]
    lines += _instrument_rows(res.get("instrument_fidelity"))
    lines += _paper_rows(res.get("paper_comparison"))
    lines += _check_cost_rows(res.get("check_cost"))
    lines += _warm_section(res.get("warm_start"))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small, fast subset (smoke test)")
    ap.add_argument("--no-notebooks", action="store_true")
    ap.add_argument("--out", default=str(BENCH_DIR))
    ap.add_argument("--pairs", type=int, default=15, help="--only launch: how many interleaved pairs (>= 7)")
    ap.add_argument("--only", default=None, choices=["live_ranks", "notebooks", "live_ranks,notebooks", "spans",
                                                      "instruments", "paper", "launch", "startup", "check", "warm"],
                    help="measure only these and update them in the existing results (each keeps its own date)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.only:
        res = json.loads((out / "results.json").read_text())
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        if "live_ranks" in a.only:
            res["live_ranks"] = {**live_ranks(), "date": stamp}
        if a.only == "launch":
            load = os.getloadavg()[0]
            lo = launch_overhead(n=a.pairs)
            res["launch_overhead_ratio"], res["launch_overhead"] = lo["ratio"], {
                **lo, "date": stamp, "torch": _torch(), "load": [round(load, 1), round(os.getloadavg()[0], 1)]}
        if a.only == "startup":
            res["startup"] = {**startup_cost(n=a.pairs), "date": stamp, "torch": _torch()}
        if "instruments" in a.only:
            res["instrument_fidelity"], res["instrument_fidelity_date"] = instrument_fidelity(), stamp
        if "spans" in a.only:
            so = spans_within_jobs()
            res["spans_overhead_ratio"], res["spans_overhead"] = so["spans"]["ratio"], {**so, "date": stamp}
        if a.only == "check":
            load = os.getloadavg()[0]
            res["check_cost"] = {**check_cost(), "date": stamp, "torch": _torch(),
                                 "load": [round(load, 1), round(os.getloadavg()[0], 1)]}
        if a.only == "warm":
            load = os.getloadavg()[0]
            res["warm_start"] = {**warm_start(), "date": stamp, "torch": _torch(),
                                 "load": [round(load, 1), round(os.getloadavg()[0], 1)]}
        if "paper" in a.only:
            res["paper_comparison"] = {**paper_comparison(), "date": stamp}
        if "notebooks" in a.only:
            res["notebook_suite_s"], res["notebook_suite_date"] = notebook_suite(), stamp
    else:
        res = run_all(quick=a.quick, notebooks=not a.no_notebooks)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    (out / "RESULTS.md").write_text(markdown(res) + kept_notes(out / "RESULTS.md"))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
