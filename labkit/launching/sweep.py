"""Running many configs with one progress bar (bubble vs microbatches, schedule comparisons).

    runs = sweep([RunConfig(schedule="GPipe", n_microbatches=m) for m in (1, 2, 4, 8)])

RunConfigs that need the same ranks (world size and device) run in ONE torchrun job, one after the
other on the same ranks (the reference job's `--suite` mode): a sweep pays one start-up (torchrun's
agent and every rank importing torch: ~6 s on 2 cores), not one per point. Each point still gets its
own run directory (`points/<i>-<name>/`: config.json, result.json, its spans) and its own `Run`; the
PP logs and torchrun's per-rank logs are the job's (`job/`, named in each point's `point.json`).
Other configs (a `runner=`, a WorkloadConfig, a multi-node launch) run one job each, as before.
The bar counts points. Notebook 07 uses it.
"""

from __future__ import annotations

import json
import threading
from typing import Callable, Iterable

from ..core.progress import Progress
from .command import DEFAULT_TIMEOUT_S

ONE_JOB_KW = {"runs_root", "timeout", "env", "check"}  # launch options a one-job sweep understands


def sweep(configs: Iterable, runner: Callable | None = None, title: str = "sweep", stream: str = "none",
          progress: bool = True, **launch_kw) -> list:
    """Run each config (default runner: `labkit.run` for RunConfig, `run_controlled` for WorkloadConfig);
    consecutive RunConfigs of the same world size and device share one job. Returns a Run per config."""
    from ..config.run import RunConfig
    from ..models.workload import WorkloadConfig
    from .controlled import run_controlled
    from .launch import run

    configs = list(configs)
    one_job = runner is None and set(launch_kw) <= ONE_JOB_KW
    runs: list = []
    with Progress(title, total=len(configs), enabled=progress) as bar:
        for group in _groups(configs) if one_job else [[c] for c in configs]:
            if len(group) > 1 and all(isinstance(c, RunConfig) for c in group):
                runs += run_points(group, title=title, stream=stream,
                                   on_point=lambda k, n0=len(runs): bar.update(n0 + k), **launch_kw)
            else:
                cfg = group[0]
                go = runner or (run_controlled if isinstance(cfg, WorkloadConfig) else run)
                runs.append(go(cfg, stream=stream, progress=False, **launch_kw))
            bar.update(len(runs))
    return runs


def _groups(configs: list) -> list[list]:
    """Consecutive RunConfigs that can share ranks (same world size and device); anything else alone."""
    from ..config.run import RunConfig

    groups: list[list] = []
    for c in configs:
        key = (c.world_size, c.device) if isinstance(c, RunConfig) else None
        last = groups[-1] if groups else None
        if key is not None and last and isinstance(last[0], RunConfig) and (last[0].world_size, last[0].device) == key:
            last.append(c)
        else:
            groups.append([c])
    return groups


def run_points(cfgs: list, *, title: str = "sweep", runs_root=None, stream: str = "none", check: bool = True,
               on_point: Callable[[int], None] | None = None, timeout=DEFAULT_TIMEOUT_S,
               env: dict | None = None) -> list:
    """RunConfigs of one world size in ONE job of the reference job (`--suite`); a `Run` per config,
    whose run_dir holds that config's config.json, result.json and spans. `check`: raise LaunchError
    when the job fails or a point's step does not match the unsplit model, as `labkit.run` does."""
    from ..core.errors import ConfigError
    from .diagnose import error_message
    from .launch import REFERENCE_JOB, launch, preflight_device, preflight_torch
    from .rundir import LaunchError
    from .rundir import Run, new_run_dir

    sizes = {(c.world_size, c.device) for c in cfgs}
    if len(sizes) != 1:
        raise ConfigError(f"one job runs configs of one world size and device; got {sorted(map(str, sizes))}")
    preflight_device(cfgs[0].device, cfgs[0].world_size)
    preflight_torch()
    base = new_run_dir(name=f"sweep-{title}", runs_root=runs_root)
    points = [base / "points" / f"{i}-{c.schedule}-m{c.n_microbatches}" for i, c in enumerate(cfgs)]
    spec = base / "suite.json"
    spec.write_text(json.dumps([{"config": c.to_dict(), "out": str(p)} for c, p in zip(cfgs, points)]))
    done = threading.Event()

    def watch() -> None:  # the bar counts points as their result.json appears
        seen = 0
        while not done.wait(0.5):
            now = sum((p / "result.json").exists() for p in points)
            if now != seen and on_point is not None:
                seen = now
                on_point(now)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        job = launch(REFERENCE_JOB, ["--suite", str(spec)], nproc=cfgs[0].world_size, out=base / "job", module=True,
                     name=f"sweep-{title}", env=env, timeout=timeout,
                     stream=stream, progress=False, check=False)
    finally:
        done.set()
        watcher.join()
    runs = []
    for c, p in zip(cfgs, points):
        res = json.loads((p / "result.json").read_text()) if (p / "result.json").exists() else None
        ok = res is not None and res.get("status") == "ok"
        (p / "point.json").write_text(json.dumps({"job": str(job.run_dir), "suite": str(spec)}))
        runs.append(Run(run_dir=p, command=job.command, nproc=job.nproc, status="ok" if ok else "failed",
                        returncode=0 if ok else (job.returncode or 1), wall_time_s=(res or {}).get("wall_time_s", 0.0),
                        result=res, error=None if ok else (res or {}).get("failure") or job.error))
    if check:
        if not job.ok and job.status != "interrupted" and not any(r.result for r in runs):
            raise LaunchError(error_message(job, job.error or "the sweep's job failed"), job)
        bad = [(c, r) for c, r in zip(cfgs, runs) if not r.ok]
        if bad:
            c, r = bad[0]
            raise LaunchError(error_message(job, f"{len(bad)} of {len(cfgs)} points failed; the first, {c.schedule} "
                                                 f"m={c.n_microbatches}: {r.error}"), job)
    return runs
