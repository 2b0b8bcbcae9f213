"""Reference runs on live ranks: RunConfigs of the reference job (`labkit.jobs.train`) run on a pool's
warm ranks instead of a fresh torchrun job each.

    with labkit.Ranks(nproc=2) as pool:
        runs = run_configs(pool, {"gpipe": RunConfig(schedule="GPipe"), "1f1b": RunConfig(schedule="1F1B")}, "runs/cmp")
        runs["gpipe"]["reference_match"]

Each config runs as the job would run it (`labkit.jobs.train.run_items`: the same build, steps and
check against the unsplit model), one after the other on the pool's process group, and writes its
own run directory (`<out>/<i>/`: config.json, result.json, its spans). A fresh job costs a start-up
(torchrun's agent and every rank importing torch: ~6 s of CPU each on 2 cores); a warm pool, none.
What a config cannot show here: torchrun's own per-rank logs and the job's exit code (a fresh
`labkit run` has them). The test suite shares its pools this way (tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

RUN_TIMEOUT_S = 900.0  # a whole batch of configs is one cell


def run_configs(pool, cfgs: dict, out, job_args: dict | None = None, timeout: float = RUN_TIMEOUT_S) -> dict:
    """Run `cfgs` ({key: RunConfig}, every one needing the pool's world size) on `pool`, each into
    `<out>/<i>`. `job_args`: {key: the job's flags for that config, e.g. ["--accumulate-pitfall"]}.
    Returns {key: its result.json (None if it wrote none)}, plus "__dirs__" ({key: run directory})
    and "__codes__" ({key: the job's exit code for it: 0 ok, 3 check failed, 2 bad split})."""
    from ..core.errors import ConfigError

    out, job_args = Path(out), job_args or {}
    bad = [k for k, c in cfgs.items() if c.world_size != pool.nproc]
    if bad:
        raise ConfigError(f"{bad[0]!r} needs {cfgs[bad[0]].world_size} ranks; this pool has {pool.nproc}: "
                          f"use a pool of that size (labkit.Ranks(nproc={cfgs[bad[0]].world_size})).")
    dirs = {k: out / str(i) for i, k in enumerate(cfgs)}
    items = [{"config": c.to_dict(), "out": str(dirs[k]), **({"job_args": list(job_args[k])} if k in job_args else {})}
             for k, c in cfgs.items()]
    code = (f"__import__('labkit.jobs.train', fromlist=['run_here']).run_here("
            f"__import__('json').loads({json.dumps(items)!r}))")
    codes = pool.exec(code, timeout=timeout)[0]  # rank 0's list; every rank ran every item
    res = {}
    for k in cfgs:
        f = dirs[k] / "result.json"
        res[k] = json.loads(f.read_text()) if f.exists() else None
    res["__dirs__"] = dirs
    res["__codes__"] = dict(zip(cfgs, codes))
    return res
