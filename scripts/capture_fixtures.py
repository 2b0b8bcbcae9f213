"""Capture REAL pipelining logs (TORCH_LOGS=+pp) as test fixtures for labkit.logs.

    python scripts/capture_fixtures.py                       # everything (a few minutes on 2 cores)
    python scripts/capture_fixtures.py --only GPipe-p2-m4     # one fixture
    python scripts/capture_fixtures.py --list

Two kinds of capture, one job at a time (a 2-core laptop runs 4 ranks slowly but fine):

- `labkit` format: the kit's own launcher (`labkit.launching.launch.run`, i.e. `labkit run ...`), which sets
  TORCH_LOGS=+pp and TORCH_LOGS_FORMAT=labkit.launching.launch.PP_LOG_FORMAT and has torchrun write one
  stderr.log per rank. We keep torchrun's layout, with the random run id renamed `run`:
  `<name>/logs/run/attempt_0/<rank>/stderr.log`, so `labkit.logs.parse_run_dir(<name>)` reads a fixture
  exactly as it reads a real run directory.
- `default` format: plain torchrun with TORCH_LOGS=+pp and NO TORCH_LOGS_FORMAT, all ranks
  interleaved in one captured stream (stdout+stderr) in `<name>/combined.log`: torch's glog-style
  lines, `[rank0]:V1122 01:49:18.636000 7438 torch/distributed/pipelining/schedules.py:2614] msg`.
  Two of them go through torchrun's `--tee 3` echo, which adds its own per-line prefix in front of
  torch's (`[default0]:[rank0]:V...`, or `[rank0]:[rank0]:V...` with
  TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE), the doubled prefixes users meet in practice.

Fixture names are `[<variant>_]<Schedule>-p<ranks>-m<microbatches>`: a plain name is one training
step in the kit's format; variants (`default_`, `default_tee_..._`, `steps2_`, `inference_`) keep
exactly two dashes, so `name.split("-")` always gives (schedule part, pN, mM).

Each fixture also keeps the script's `result.json` (the planned n_stages / n_microbatches / steps)
and a `capture.json` (command, format, date, torch version); the version folder's README.md is
regenerated from those. Fixtures live in `tests/fixtures/pplogs/<torch version>/<name>/`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from labkit.config.run import RunConfig  # noqa: E402

GZIP_ABOVE = 16_000  # bytes: bigger logs are stored gzipped (labkit.logs reads .gz); fixtures stay < 5 MB


@dataclass(frozen=True)
class Capture:
    name: str
    schedule: str
    nproc: int
    microbatches: int
    fmt: str = "labkit"  # labkit | default
    steps: int = 1
    inference: bool = False
    tee: str | None = None  # default format only: None | "default" ([default0]:) | "rank" ([rank0]:)


def plan() -> list[Capture]:
    multi = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    single = ("GPipe", "1F1B")
    caps = []
    for nproc, m in ((2, 4), (4, 8)):
        for s in single + multi:
            caps.append(Capture(f"{s}-p{nproc}-m{m}", s, nproc, m))
    # several steps: the parser must split steps (and count actions steps times)
    caps.append(Capture("steps2_GPipe-p2-m4", "GPipe", 2, 4, steps=2))
    caps.append(Capture("steps2_ZBVZeroBubble-p2-m4", "ZBVZeroBubble", 2, 4, steps=2))
    # forward only (loss_fn=None): GPipe still logs "Backwarded microbatch" lines for backwards that never ran
    caps.append(Capture("inference_GPipe-p2-m4", "GPipe", 2, 4, inference=True))
    caps.append(Capture("inference_Interleaved1F1B-p2-m4", "Interleaved1F1B", 2, 4, inference=True))
    # torch's default format, one interleaved stream: what a plain `torchrun` run leaves in one file,
    # for every schedule at 2 and 4 ranks (`labkit timeline FILE` must read each by its content)
    for nproc, m in ((2, 4), (4, 8)):
        for s in single + multi:
            caps.append(Capture(f"default_{s}-p{nproc}-m{m}", s, nproc, m, fmt="default"))
    caps.append(Capture("default_tee_rank_1F1B-p2-m4", "1F1B", 2, 4, fmt="default", tee="rank"))
    caps.append(Capture("default_tee_default_Interleaved1F1B-p2-m4", "Interleaved1F1B", 2, 4, fmt="default",
                        tee="default"))
    return caps


def torch_version() -> str:
    import torch

    return torch.__version__


def _store(src: Path, dst: Path) -> Path:
    """Copy a log; gzip it when it is big (keeps the fixture tree at a few hundred kB)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.stat().st_size > GZIP_ABOVE:
        dst = dst.with_name(dst.name + ".gz")
        with open(src, "rb") as f, gzip.GzipFile(dst, "wb", compresslevel=9, mtime=0) as g:  # mtime 0: reproducible bytes
            shutil.copyfileobj(f, g)
    else:
        shutil.copyfile(src, dst)
    return dst


def capture_labkit(c: Capture, dest: Path) -> dict:
    from labkit.launching.launch import run

    cfg = RunConfig(schedule=c.schedule, pp_size=c.nproc, n_microbatches=c.microbatches, split="manual",
                    preset="tiny", steps=c.steps, inference=c.inference)
    with tempfile.TemporaryDirectory(prefix="pplog-capture-") as tmp:
        r = run(cfg, out=Path(tmp) / "run", stream="none", progress=False, timeout=600)
        for rank in range(c.nproc):
            p = r.log_path(rank, "stderr")
            attempt = p.parent.parent.name
            _store(p, dest / "logs" / "run" / attempt / str(rank) / "stderr.log")
        shutil.copyfile(r.run_dir / "result.json", dest / "result.json")
        flags = f"--schedule {c.schedule} --nproc {c.nproc} --microbatches {c.microbatches} --split manual " \
                f"--preset tiny" + (f" --steps {c.steps}" if c.steps != 1 else "") + \
                (" --inference" if c.inference else "")
        return {"command": f"labkit run {flags} --out DIR", "argv": r.command}


def capture_default(c: Capture, dest: Path) -> dict:
    cfg = RunConfig(schedule=c.schedule, pp_size=c.nproc, n_microbatches=c.microbatches, split="manual",
                    preset="tiny", steps=c.steps, inference=c.inference)
    env = dict(os.environ)
    env.pop("TORCH_LOGS_FORMAT", None)
    env.update(TORCH_LOGS="+pp", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("LABKIT_RUN_DIR", None)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pplog-capture-") as tmp:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(c.nproc)]
        shown = f"TORCH_LOGS=+pp torchrun --standalone --nproc-per-node {c.nproc}"
        if c.tee:
            argv += ["--log-dir", str(Path(tmp) / "logs"), "--tee", "3"]
            shown += " --log-dir LOGS --tee 3"
            if c.tee == "rank":
                env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"
                shown = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:' " + shown
        cfg.to_json(Path(tmp) / "config.json")
        args = ["--config", str(Path(tmp) / "config.json"), "--out", tmp]
        argv += ["-m", "labkit.jobs.train", *args]
        shown += " -m labkit.jobs.train --config DIR/config.json --out DIR > combined.log 2>&1"
        combined = Path(tmp) / "combined.log"
        with open(combined, "wb") as out:
            proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=env, timeout=600, cwd=tmp)
        if proc.returncode != 0:
            tail = combined.read_text(errors="replace").splitlines()[-30:]
            raise RuntimeError(f"{c.name}: torchrun exited {proc.returncode}\n" + "\n".join(tail))
        _store(combined, dest / "combined.log")
        shutil.copyfile(Path(tmp) / "result.json", dest / "result.json")
    return {"command": shown, "argv": argv}


def write_readme(vdir: Path) -> None:
    rows = []
    for cj in sorted(vdir.glob("*/capture.json")):
        info = json.loads(cj.read_text())
        files = sorted(p for p in cj.parent.rglob("*") if p.is_file())
        size = sum(p.stat().st_size for p in files)
        rows.append(f"| `{cj.parent.name}` | {info['format']} | {info['date']} | {size / 1024:.1f} kB | "
                    f"`{info['command']}` |")
    first = json.loads(next(vdir.glob("*/capture.json")).read_text()) if rows else {}
    text = f"""# Real pipelining logs, torch {vdir.name}

Captured with `python scripts/capture_fixtures.py` (torch {first.get('torch', '?')}, Python
{first.get('python', '?')}, {first.get('machine', '?')}, CPU ranks on gloo, the `tiny` preset, manual split). Nothing
here is hand-written: every log is what the ranks printed with `TORCH_LOGS=+pp`. Each folder holds
`result.json` (what the reference script planned and checked), `capture.json` (how it was made) and
either torchrun's per-rank `logs/run/attempt_0/<rank>/stderr.log` (labkit format, microsecond
epoch stamps) or one interleaved `combined.log` (torch's default format, whole-millisecond local
time, `[rankN]:` prefixes). Logs above 16 kB are stored gzipped (`.gz`), as labkit.logs reads them. Names are `[<variant>_]<Schedule>-p<ranks>-m<microbatches>`: a plain
name is one training step in the kit's format; `default_` is torch's default format (`default_tee_`:
through torchrun's `--tee` echo), `steps2_` two steps, `inference_` forward only. Used by
`tests/test_pplog.py`, `tests/test_theory.py` and `tests/test_timeline_cli.py` (`labkit timeline FILE`).

| fixture | format | captured | size | command |
|---|---|---|---|---|
""" + "\n".join(rows) + "\n"
    (vdir / "README.md").write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "pplogs"), help="fixtures root")
    p.add_argument("--only", nargs="*", default=None, help="fixture names to (re)capture")
    p.add_argument("--list", action="store_true")
    p.add_argument("--force", action="store_true", help="replace fixtures that exist")
    p.add_argument("--retries", type=int, default=2, help="new tries for a job that fails")
    a = p.parse_args(argv)
    caps = plan()
    if a.list:
        for c in caps:
            print(c.name)
        return 0
    if a.only:
        unknown = set(a.only) - {c.name for c in caps}
        if unknown:
            p.error(f"unknown fixture(s) {sorted(unknown)}; see --list")
        caps = [c for c in caps if c.name in a.only]
    version = torch_version().split("+")[0]
    vdir = Path(a.out) / version
    for c in caps:
        dest = vdir / c.name
        if dest.exists():
            if not a.force:
                print(f"[capture] {c.name}: exists, skipped (--force replaces it)")
                continue
            shutil.rmtree(dest)
        for attempt in range(1, a.retries + 2):
            print(f"[capture] {c.name} ..." + (f" (attempt {attempt})" if attempt > 1 else ""), flush=True)
            try:
                info = capture_labkit(c, dest) if c.fmt == "labkit" else capture_default(c, dest)
                break
            except Exception as e:  # a job ended from outside (a shared machine) is worth another try
                shutil.rmtree(dest, ignore_errors=True)
                if attempt > a.retries:
                    raise
                print(f"[capture] {c.name} failed: {str(e).splitlines()[0]}; retrying", flush=True)
            except BaseException:
                shutil.rmtree(dest, ignore_errors=True)
                raise
        info.update(name=c.name, format=c.fmt, schedule=c.schedule, nproc=c.nproc, microbatches=c.microbatches,
                    steps=c.steps, inference=c.inference, tee=c.tee, torch=torch_version(), python=platform.python_version(),
                    machine=f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
                    date=_dt.date.today().isoformat())
        info["argv"] = [re.sub(r"\S*pplog-capture-[^/\s]+", "TMP", x.replace(str(REPO), "<repo>"))
                        .replace(sys.executable, "python") for x in map(str, info["argv"])]
        (dest / "capture.json").write_text(json.dumps(info, indent=2) + "\n")
    if vdir.exists():
        write_readme(vdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
