"""Ranks started warm (labkit.launching.warm): a fresh short job's whole process tree (wall time and CPU,
common._tree_run) through `labkit launch` with each start method against plain torchrun, every side once a
round (common._rounds), and a live pool's start, one start method against another pair by pair; the job
(WARM_JOB) is the issue's probe. Also
RESULTS.md's rows for it (the goal at 4 ranks, `_warm_rows`) and its section (how, a reading, the table)."""

from __future__ import annotations

import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from .common import _pairs, _rounds, _tree_run, _wall_and_cpu

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
