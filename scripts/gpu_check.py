"""The GPU checklist's essentials in ONE call, for the rare, brief, bare GPU machine.

    PYTHONPATH=. python3 scripts/gpu_check.py --out gpu-check            # cuda when there is one
    PYTHONPATH=. python3 scripts/gpu_check.py --out /tmp/c --device cpu  # the same parts on CPU ranks

Runs from a plain checkout with the machine's own python3 and torch: nothing installed (no `pip
install -e .`, no JupyterLab, nbval or OR-Tools, no `labkit` console script). The kit runs through its
Python API (`labkit.launching.launch`, `labkit.Ranks`) and the children find it on PYTHONPATH. Five
parts, each ending with a verdict (pass, fail, or skipped with the reason):

1. every multi-stage schedule x split (manual, tracer) on one rank (`--nproc 1 --stages-per-rank 4`,
   2 for the V-shaped ones), each pipelined step checked against the unsplit model (result.json);
2. the same with the tutorial preset (the official tutorial's sizes; GPU only: about a minute a step
   on 2 CPU cores);
3. the kit's spans (CUDA events on a GPU, the host clock on CPU) beside the profiler's own view of the
   same actions in the same run (the last of 3 steps): the kernels each action launched on a GPU, the
   CPU operators inside it on CPU. Pass: every action on both sides, and each profiler window no longer
   than its span (a span brackets its action's work) for 90% of them; on CPU also the spans' bubble
   fraction within 0.03 of the kit's profiler annotations' (tests/test_spans.py). How far apart they
   are (start and end offsets, durations, bubble fractions) is reported, not judged, on a GPU;
4. live ranks (`labkit.Ranks(nproc=1)`, nccl on a GPU, gloo on CPU): a small pipelined step checked
   against the unsplit model, and its spans;
5. the memory tracker (`labkit.worker.memory.SavedTensorTracker`) against the bytes the step saves by
   construction and, on a GPU, against `torch.cuda.max_memory_allocated`.

Parts 1-3 are ONE torchrun job (the reference job's `--suite`: every config in turn on the same rank),
parts 4-5 one live pool: two launches in all. Each part has a deadline; a config that hangs is stopped
at its part's deadline (its rank's stack is dumped first) and the job is launched again for the parts
after it, so one hang cannot eat the budget. Writes `gpu_check.json` (environment, each part's verdict,
figures and seconds) and `report.md` to --out, after every part. Exit code 0 only if no part failed.
README's "GPU nodes" section points here. Rehearsed on CPU, bare, by tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # this file is <repo>/scripts/gpu_check.py
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BUDGET_S = 450.0           # the whole script, with a margin under the 8 minutes a GPU machine is lent for
MIN_JOB_S = 20.0           # a launch needs at least this much of the budget left (torch's import, CUDA's start)
POLL_S = 0.25
SPAN_BUBBLE_TOLERANCE = 0.03  # spans vs the profiler on CPU, as tests/test_spans.py states it
CONTAINED_SHARE = 0.9         # actions whose profiler window fits in their span (by duration), at least
PASS, FAIL, SKIPPED, PENDING = "pass", "fail", "skipped", "pending"


@dataclass
class Part:
    """One part of the check and its outcome (a line in the report, an entry in gpu_check.json)."""

    key: str
    title: str
    deadline_s: float
    """Seconds this part may take, its share of a job's start-up included."""
    verdict: str = PENDING
    """pass, fail, skipped (why says why), or pending while it has not concluded"""
    why: str = "not run yet"
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0

    def conclude(self, verdict: str, why: str, seconds: float | None = None, **figures) -> None:
        self.verdict, self.why = verdict, why
        self.figures.update(figures)
        if seconds is not None:
            self.seconds = round(seconds, 1)

    def line(self) -> str:
        return f"[gpu_check] {self.key} ({self.title}): {self.verdict.upper()} - {self.why} [{self.seconds:.1f} s]"


def make_parts() -> dict[str, Part]:
    # 350 s of deadlines in all: with the stops (stacks, a pool restart after a hung cell) the worst case
    # stays within BUDGET_S; a run where nothing hangs takes about a minute on 2 CPU cores
    parts = [Part("1_schedules", "every multi-stage schedule x split, one rank", 90.0),
             Part("2_tutorial", "the tutorial preset, every multi-stage schedule x split", 110.0),
             Part("3_spans", "spans beside the profiler's view of the same actions", 50.0),
             Part("4_live_ranks", "live ranks on one rank: a pipelined step", 60.0),
             Part("5_memory", "the memory tracker against the allocator", 40.0)]
    return {p.key: p for p in parts}


# ---- the whole check: environment, budget, output ----------------------------------------------------

class Check:
    """The parts, the output folder, the time budget, and what was launched."""

    def __init__(self, out: Path, device: str, budget_s: float):
        self.out, self.device = out, device
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.budget_s = budget_s
        self.parts = make_parts()
        self.env: dict = {}
        self.jobs: list[dict] = []
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def conclude(self, key: str, verdict: str, why: str, seconds: float | None = None, **figures) -> None:
        part = self.parts[key]
        part.conclude(verdict, why, seconds, **figures)
        print(part.line(), flush=True)
        self.save()

    def not_run(self, keys, why: str) -> None:
        for k in keys:
            if self.parts[k].verdict == PENDING:
                self.conclude(k, SKIPPED, f"did not run: {why}", 0.0)

    @property
    def failed(self) -> bool:
        return any(p.verdict == FAIL for p in self.parts.values())

    def to_json(self) -> dict:
        return {"script": "scripts/gpu_check.py", **self.env, "budget_s": self.budget_s,
                "seconds": round(time.monotonic() - self.started, 1), "ok": not self.failed,
                "launches": {"torchrun_jobs": len(self.jobs), "processes": sum(j["processes"] for j in self.jobs),
                             "jobs": self.jobs},
                "parts": [asdict(p) for p in self.parts.values()]}

    def save(self) -> None:
        with self._lock:
            data = self.to_json()
            (self.out / "gpu_check.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
            (self.out / "report.md").write_text(report_text(data))


def report_text(data: dict) -> str:
    """The human report: environment, one row per part, then each part's figures."""
    lines = [f"# GPU check: {data.get('device_name')} ({data.get('device')})", "",
             f"torch {data.get('torch')}, transformers {data.get('transformers') or 'not installed'}, "
             f"Python {data.get('python')}, commit {data.get('commit') or 'unknown'}; "
             f"{data['seconds']:.0f} s of a {data['budget_s']:.0f} s budget; "
             f"{data['launches']['torchrun_jobs']} torchrun jobs ({data['launches']['processes']} processes). "
             f"Rendezvous: {data.get('rendezvous')}.", "",
             "| part | verdict | seconds | why |", "|---|---|---|---|"]
    for p in data["parts"]:
        lines.append(f"| {p['key']} {p['title']} | **{p['verdict']}** | {p['seconds']:.1f} | {p['why']} |")
    lines += ["", f"Overall: {'no part failed' if data['ok'] else 'SOME PART FAILED'}.", ""]
    for p in data["parts"]:
        if p["figures"]:
            lines += [f"## {p['key']}", "", "```json", json.dumps(p["figures"], indent=1, default=str), "```", ""]
    return "\n".join(lines)


def environment(device: str) -> dict:
    """Versions and the device, read without importing torch on CPU. On a GPU torch is imported (the
    launcher checks a GPU per rank anyway) but no CUDA context is made here: the name comes from
    nvidia-smi, and part 4's rank reports it too."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    env = {"device": device, "python": platform.python_version(), "torch": version("torch"),
           "transformers": version("transformers"), "host": platform.node(), "commit": git_commit(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device == "cuda":
        import torch

        env.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count(),
                   device_name=gpu_name())
    else:
        env.update(device_name=cpu_model(), cpus=os.cpu_count())
    return env


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def gpu_name() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "a CUDA device"
    except (OSError, subprocess.SubprocessError):
        return "a CUDA device"


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def prepare_children(out: Path) -> str:
    """What every process the check starts needs from a plain checkout: the repository on PYTHONPATH
    (absolute: the ranks may start elsewhere), and torchrun's way to the kit's loopback rendezvous.

    torchrun finds `--rdzv-backend labkit-loopback` through the `torchrun.handlers` entry point that an
    installed labkit declares (pyproject.toml). A plain checkout declares none, so this declares the same
    entry point in a metadata folder of the output directory, on PYTHONPATH: the launch is then exactly
    the kit's own, loopback stores included. Returns how the rendezvous is found (for the report)."""
    from importlib.metadata import entry_points

    from labkit.launching.rendezvous import BACKEND_NAME

    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    if any(ep.name == BACKEND_NAME for ep in entry_points(group="torchrun.handlers")):
        how = "the installed kit's torchrun.handlers entry point"
    else:
        plugin = out / "_rendezvous_plugin"
        info = plugin / "labkit_gpu_check_rendezvous-0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: labkit-gpu-check-rendezvous\nVersion: 0\n")
        (info / "entry_points.txt").write_text(
            f"[torchrun.handlers]\n{BACKEND_NAME} = labkit.launching.rendezvous:handler_generator\n")
        paths.append(str(plugin.resolve()))
        how = f"declared for this check in {plugin} (a plain checkout declares no entry point)"
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    return how


# ---- parts 1-3: the reference job's suite ------------------------------------------------------------

@dataclass
class Item:
    """One config of the suite, the part it belongs to, and what became of it."""

    part: str
    label: str
    config: object  # a labkit RunConfig
    out: Path
    result: dict | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


def suite_items(check: Check) -> list[Item]:
    """Part 1: every multi-stage schedule x split, small preset; part 2: the same with the tutorial preset
    (GPU); part 3: one profiled run of three steps."""
    from labkit.config.run import SPLIT_MODES, RunConfig
    from labkit.schedules.table import SCHEDULES

    items = []
    cuda = check.device == "cuda"
    for part, preset in (("1_schedules", "small"), ("2_tutorial", "tutorial")):
        for name, info in SCHEDULES.items():
            if not info.multi:
                continue
            for split in SPLIT_MODES:
                cfg = RunConfig(schedule=name, pp_size=1, stages_per_rank=2 if info.v_shaped else 4, split=split,
                                preset=preset, n_microbatches=4, device=check.device)
                items.append(Item(part, f"{name}/{split}", cfg, check.out / part / f"{name}-{split}"))
    cfg = RunConfig(schedule="Interleaved1F1B", pp_size=1, stages_per_rank=4, preset="tutorial" if cuda else "tiny",
                    n_microbatches=4, steps=3, profile=True, device=check.device)
    items.append(Item("3_spans", "Interleaved1F1B/profiled", cfg, check.out / "3_spans" / "run"))
    if not cuda:  # about a minute a step on 2 CPU cores: the configs are made (validated) but not run
        planned = [it.label for it in items if it.part == "2_tutorial"]
        items = [it for it in items if it.part != "2_tutorial"]
        check.conclude("2_tutorial", SKIPPED, f"GPU only: the tutorial preset (dim 512, batch 32 x seq 500) takes "
                       f"about a minute a step on 2 CPU cores; its {len(planned)} configs were validated, not run",
                       0.0, planned=planned)
    return items


class SuiteWatcher:
    """Watches one suite job from a thread: reads each config's result.json as it lands, concludes a
    part once all its configs are in, and stops the job when the running config's part is past its
    deadline (the rank's stack dumped first, into its stderr.log)."""

    def __init__(self, check: Check, items: list[Item], spent: dict[str, float], on_part_done):
        self.check, self.items, self.spent, self.on_part_done = check, items, spent, on_part_done
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.timed_out: Item | None = None
        self._clock = time.monotonic()  # when the running config's part started in this job
        self._thread = threading.Thread(target=self._loop, name="gpu-check-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self.finished.set()
        self._thread.join()
        self.poll()

    def running(self) -> Item | None:
        return next((it for it in self.items if not it.done), None)

    def _loop(self) -> None:
        while not self.finished.wait(POLL_S):
            self.poll()
            cur = self.running()
            if cur is None or self.stop.is_set():
                continue
            if self.spent.get(cur.part, 0.0) + time.monotonic() - self._clock > self.check.parts[cur.part].deadline_s:
                self.timed_out = cur
                dump_rank_stacks()
                self.stop.set()

    def poll(self) -> None:
        for it in self.items:
            if it.done:
                continue
            f = it.out / "result.json"
            if not f.exists():
                return  # the configs run in order: nothing after the running one is in yet
            try:
                it.result = json.loads(f.read_text())
            except ValueError:
                return  # being written
            print(f"  {it.part} {it.label}: {config_line(it)}", flush=True)
            self._advance(it)

    def charge_running(self) -> None:
        """The job ended while a config ran: its part pays for the time since it started."""
        cur = self.running()
        if cur is not None:
            self.spent[cur.part] = self.spent.get(cur.part, 0.0) + time.monotonic() - self._clock

    def _advance(self, it: Item) -> None:
        """`it` just finished: charge its part, and conclude the part when it was its last config."""
        now = time.monotonic()
        nxt = self.running()
        if nxt is None or nxt.part != it.part:
            self.spent[it.part] = self.spent.get(it.part, 0.0) + now - self._clock
            self._clock = now
            if all(i.done for i in self.items if i.part == it.part):
                self.on_part_done(it.part)


def dump_rank_stacks() -> None:
    """SIGABRT the ranks below this process (not torchrun's agent): PYTHONFAULTHANDLER=1, which the
    launcher sets, writes every thread's stack into the rank's stderr.log before it dies."""
    import psutil

    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "labkit.jobs.train" in cmd and "torch.distributed.run" not in cmd:
                p.send_signal(signal.SIGABRT)
        except psutil.Error:
            pass


def config_line(it: Item) -> str:
    if it.error is not None:
        return it.error.splitlines()[0]
    r = it.result
    verdict = "matches the unsplit model" if r.get("reference_match") else "DOES NOT match the unsplit model"
    return f"{verdict} (max abs diff {r.get('max_abs_diff', float('nan')):.2e}) in {r.get('wall_time_s', 0):.1f} s"


def run_suite(check: Check, items: list[Item]) -> None:
    """Run `items` in as few suite jobs as possible: one, unless a config crashes its job or hangs past
    its part's deadline; then the job is launched again with what is left (a hung part's other configs
    are given up: its deadline is spent). A job that fails before its first config finishes is not
    launched again: the rest would fail the same way."""
    spent: dict[str, float] = {}
    pending = list(items)
    attempt = 0
    while pending:
        if check.left() < MIN_JOB_S:
            for it in pending:
                it.error = it.error or "did not run: the check's time budget was spent"
            conclude_parts(check, {it.part for it in pending}, items, spent)
            return
        attempt += 1
        try:
            run, watcher = launch_suite(check, pending, spent, items, attempt)
        except Exception as e:  # refused before anything started (a module torchrun cannot import, ...)
            for it in pending:
                it.error = f"the suite job could not be launched: {first_line(e)}"
            conclude_parts(check, {it.part for it in pending}, items, spent)
            return
        failed = watcher.running()
        if failed is None:
            return
        if failed is pending[0] and watcher.timed_out is None:
            watcher.charge_running()
            for it in pending:
                it.error = f"the suite job failed before its first config finished: {run.error or run.status}"
            print(f"  {pending[0].error}. Run directory: {run.run_dir}", flush=True)
            conclude_parts(check, {it.part for it in pending}, items, spent)
            return
        settle(check, failed, run, watcher, pending, spent)
        conclude_parts(check, {failed.part}, items, spent, only_complete=True)
        pending = [it for it in pending if not it.done]


def settle(check: Check, failed: Item, run, watcher: "SuiteWatcher", pending: list[Item], spent: dict) -> None:
    """The config a job ended in: stopped at its part's deadline (the part's other configs are given up),
    or crashed (the rest go on in the next job)."""
    if watcher.timed_out is failed:
        deadline = check.parts[failed.part].deadline_s
        failed.error = (f"did not finish within its part's {deadline:g} s deadline; stopped{stack_where(run)}. "
                        f"Run directory: {run.run_dir}")
        spent[failed.part] = deadline
        for it in pending:
            if it.part == failed.part and not it.done:
                it.error = f"did not run: {failed.label} used up the part's deadline"
    else:
        failed.error = f"the job failed while running this config: {run.error or run.status}. Run directory: {run.run_dir}"
        watcher.charge_running()
    print(f"  {failed.part} {failed.label}: {failed.error.splitlines()[0]}", flush=True)


def launch_suite(check: Check, pending: list[Item], spent: dict, items: list[Item], attempt: int):
    """One suite job for the configs `pending`, watched; returns its Run and the watcher."""
    from labkit.launching.launch import REFERENCE_JOB, launch

    spec = check.out / f"suite{attempt}.json"
    spec.write_text(json.dumps([{"config": it.config.to_dict(), "out": str(it.out)} for it in pending], indent=1))
    watcher = SuiteWatcher(check, pending, spent,
                           lambda part: conclude_parts(check, {part}, items, spent, only_complete=True))
    print(f"[gpu_check] suite job {attempt}: {len(pending)} configs on one rank ({check.device})", flush=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        run = launch(REFERENCE_JOB, ["--suite", str(spec)], nproc=1, module=True, out=check.out / f"suite{attempt}",
                     progress=False, stream="none", check=False, timeout=max(check.left(), 1.0),
                     stop_event=watcher.stop)
    finally:
        watcher.join()
    check.jobs.append({"what": f"suite {attempt} (parts {', '.join(sorted({it.part[0] for it in pending}))})",
                       "run_dir": str(run.run_dir), "status": run.status, "seconds": round(time.monotonic() - t0, 1),
                       "processes": 2})
    return run, watcher


def stack_where(run) -> str:
    from labkit.launching.diagnose import stack_report

    try:
        where = stack_report(run).get(0)
    except Exception as e:  # the report is a nicety: never lose the verdict over it
        where = f"no stack ({type(e).__name__}: {e})"
    return f" while at {where} (stacks.txt in the run directory)" if where else ""


def conclude_parts(check: Check, keys, items: list[Item], spent: dict, only_complete: bool = False) -> None:
    for key in sorted(keys):
        mine = [it for it in items if it.part == key]
        if check.parts[key].verdict != PENDING or (only_complete and not all(it.done for it in mine)):
            continue
        seconds = spent.get(key, 0.0)
        if key == "3_spans":
            conclude_spans(check, mine[0], seconds)
        else:
            conclude_configs(check, key, mine, seconds)


def conclude_configs(check: Check, key: str, items: list[Item], seconds: float) -> None:
    rows = []
    for it in items:
        r = it.result or {}
        rows.append({"config": it.label, "stages_per_rank": it.config.stages_per_rank, "preset": it.config.preset,
                     "n_microbatches": it.config.n_microbatches, "reference_match": r.get("reference_match"),
                     "max_abs_diff": r.get("max_abs_diff"), "wall_time_s": r.get("wall_time_s"),
                     "step_time_s": r.get("step_time_s"), "peak_memory_bytes": r.get("peak_memory_bytes"),
                     "peak_memory_kind": r.get("peak_memory_kind"), "error": it.error})
    if all((it.error or "").startswith("did not run") for it in items):
        check.conclude(key, SKIPPED, items[0].error, seconds, configs=rows)
        return
    good = [row for row in rows if row["reference_match"] is True]
    not_run = [row["error"] for row in rows if (row["error"] or "").startswith("did not run")]
    bad = [f"{row['config']}: {row['error'] or mismatch(row)}"
           for row in rows if row["reference_match"] is not True and row["error"] not in not_run]
    why = f"{len(good)}/{len(rows)} match the unsplit model"
    if good and not (bad or not_run):
        why += f" (worst max abs diff {max(row['max_abs_diff'] for row in good):.2e})"
    why += "".join(f"; {b}" for b in bad) + (f"; {len(not_run)} {not_run[0]}" if not_run else "")
    check.conclude(key, FAIL if bad or not_run else PASS, why, seconds, configs=rows)


def mismatch(row: dict) -> str:
    diff = row["max_abs_diff"]
    return f"DOES NOT match the unsplit model (max abs diff {diff:.2e})" if diff is not None else "no result.json"


# ---- part 3: spans beside the profiler -------------------------------------------------------------

def conclude_spans(check: Check, it: Item, seconds: float) -> None:
    if it.result is None:
        check.conclude("3_spans", FAIL, f"no profiled run: {it.error}", seconds)
        return
    try:
        verdict, why, figures = compare_spans(it.out, check.device)
    except Exception as e:  # a reader that fails on this torch's trace is a finding, not a crash of the check
        check.conclude("3_spans", FAIL, f"could not compare: {type(e).__name__}: {e}", seconds, run_dir=str(it.out))
        return
    check.conclude("3_spans", verdict, why, seconds, run_dir=str(it.out), **figures)


def compare_spans(run_dir: Path, device: str) -> tuple[str, str, dict]:
    """The last (warm) step's actions from the kit's spans against the profiler's view of the same actions
    in the same run: on CUDA the kernels each action launched (device times), on CPU the CPU operators
    inside it; the kit's own host-side annotations (`labkit::<stage><kind><mb>`) beside both."""
    from labkit.core.actions import COMPUTE_KINDS
    from labkit.logs.profiler import profile_files
    from labkit.timeline.compare import load_timeline, one_step

    spans = [a for a in one_step(load_timeline(run_dir, "spans")).actions if a.kind in COMPUTE_KINDS]
    traces = profile_files(run_dir)
    if 0 not in traces:
        raise FileNotFoundError(f"no profiler trace in {run_dir}/profile (the run had --profile)")
    trace = json.loads(traces[0].read_text())
    inner = "kernels" if device == "cuda" else "cpu_ops"
    host, windows = profiler_windows(trace, inner)
    vs_inner, vs_host = compare_actions(spans, windows), compare_actions(spans, host)
    figures = {"clock": "spans: CUDA events placed on the host clock" if device == "cuda" else "spans: time.time()",
               "profiler_view": f"the {inner.replace('_', ' ')} inside each labkit:: annotation (first start to last end)",
               f"spans_vs_{inner}": vs_inner, "spans_vs_host_annotations": vs_host}
    problems = []
    if not spans or vs_inner["matched"] != len({key(a) for a in spans}) or vs_inner["matched"] != vs_inner["other_actions"]:
        problems.append(f"{vs_inner['matched']} actions matched of {vs_inner['actions']} spans and "
                        f"{vs_inner['other_actions']} {inner} windows")
    if vs_inner["contained_share"] < CONTAINED_SHARE:
        problems.append(f"only {vs_inner['contained_share']:.0%} of the {inner} windows fit in their span's duration "
                        f"(at least {CONTAINED_SHARE:.0%} expected)")
    host_gap = abs(vs_host["bubble_fraction"]["spans"] - vs_host["bubble_fraction"]["other"])
    if device != "cuda" and host_gap > SPAN_BUBBLE_TOLERANCE:  # on a GPU the annotations time the launches
        problems.append(f"bubble fractions of the spans and of the kit's annotations differ by {host_gap:.3f} "
                        f"(> {SPAN_BUBBLE_TOLERANCE}, tests/test_spans.py's tolerance)")
    summary = (f"{vs_inner['matched']} actions (median {fmt_us(vs_inner['median_action_us'])}); the {inner} "
               f"inside each start {fmt_us(vs_inner['start_offset_us']['median'])} after its span and last "
               f"{fmt_us(vs_inner['duration_diff_us']['median'])} less (medians); bubble fraction: spans "
               f"{vs_inner['bubble_fraction']['spans']:.3f}, {inner} {vs_inner['bubble_fraction']['other']:.3f}, "
               f"host annotations {vs_host['bubble_fraction']['other']:.3f}")
    return (FAIL if problems else PASS), ("; ".join(problems) + " | " if problems else "") + summary, figures


def fmt_us(v: float) -> str:
    return f"{v / 1000:.2f} ms" if abs(v) >= 1000 else f"{v:.0f} us"


def profiler_windows(trace: dict, inner: str):
    """Per `labkit::` annotation of a profiler trace: its host range, and the window of the work inside
    it (`inner`: "kernels" or "cpu_ops", see `kernels_inside` and `cpu_ops_inside`). Times in seconds on
    the trace's own clock, its `baseTimeNanoseconds` added: the host clock the spans use."""
    from labkit.core.actions import Action
    from labkit.logs.messages import decode_action
    from labkit.logs.profiler import ANNOTATION_PREFIX

    base_us = float(trace.get("baseTimeNanoseconds", 0)) / 1e3
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    inside = kernels_inside(events) if inner == "kernels" else cpu_ops_inside(events)

    def action(d, lo, hi):
        return Action(0, d[1], d[2], d[0], (base_us + lo) / 1e6, (base_us + hi) / 1e6)

    host, windows = [], []
    for e in events:
        name = str(e.get("name", ""))
        d = decode_action(name[len(ANNOTATION_PREFIX):]) if (
            e.get("cat") == "user_annotation" and name.startswith(ANNOTATION_PREFIX)) else None
        if d is None:
            continue
        lo, hi = e["ts"], e["ts"] + e["dur"]
        host.append(action(d, lo, hi))
        work = inside(lo, hi)
        if work:
            windows.append(action(d, min(a for a, _ in work), max(b for _, b in work)))
    return host, windows


def kernels_inside(events: list[dict]):
    """(lo, hi) -> the device events (kernels, copies, sets) launched between lo and hi, matched to their
    launch by the profiler's correlation id: a backward's launches come from autograd's device thread,
    inside the annotation's range in time but not on its thread."""
    device: dict = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get("args", {}):
            device.setdefault(e["args"]["correlation"], []).append((e["ts"], e["ts"] + e["dur"]))
    launches = sorted((e["ts"], e["args"]["correlation"]) for e in events
                      if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}))

    def inside(lo: float, hi: float) -> list:
        i, j = bisect_left(launches, (lo,)), bisect_right(launches, (hi, float("inf")))
        return [w for _, c in launches[i:j] for w in device.get(c, [])]

    return inside


def cpu_ops_inside(events: list[dict]):
    """(lo, hi) -> the CPU operators that run entirely between lo and hi."""
    ops = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "cpu_op")

    def inside(lo: float, hi: float) -> list:
        return [(s, t) for s, t in ops[bisect_left(ops, (lo,)):bisect_right(ops, (hi, float("inf")))] if t <= hi]

    return inside


def key(a) -> tuple:
    return (a.stage, a.kind, a.microbatch)


def last_by_key(actions) -> dict:
    """Each (stage, kind, microbatch)'s last occurrence: the last step of a multi-step run."""
    out = {}
    for a in sorted(actions, key=lambda a: a.start):
        out[key(a)] = a
    return out


def compare_actions(spans, other) -> dict:
    """How far `other` (a profiler view) is from the spans, action by action: start and end offsets,
    duration differences (microseconds), the share of actions whose `other` window is no longer than
    the span (within 10 us + 2%: a span brackets its action's work), and each side's bubble fraction."""
    from labkit.core.actions import Timeline

    a, b = last_by_key(spans), last_by_key(other)
    common = sorted(set(a) & set(b))
    us = 1e6
    starts = [(b[k].start - a[k].start) * us for k in common]
    ends = [(b[k].end - a[k].end) * us for k in common]
    shorter = [(a[k].duration - b[k].duration) * us for k in common]
    fits = [b[k].duration <= a[k].duration * 1.02 + 10e-6 for k in common]

    def stats(v):
        return {"median": statistics.median(v), "min": min(v), "max": max(v)} if v else {"median": 0.0, "min": 0.0, "max": 0.0}

    def bubble(acts):
        return Timeline(sorted(acts, key=lambda x: x.start)).metrics()["bubble_fraction"] if acts else float("nan")

    return {"actions": len(a), "other_actions": len(b), "matched": len(common),
            "median_action_us": statistics.median(x.duration * us for x in a.values()) if a else 0.0,
            "start_offset_us": stats(starts), "end_offset_us": stats(ends), "duration_diff_us": stats(shorter),
            "contained_share": sum(fits) / len(fits) if fits else 0.0,
            "bubble_fraction": {"spans": bubble([a[k] for k in common]), "other": bubble([b[k] for k in common])}}


# ---- parts 4-5: live ranks ----------------------------------------------------------------------------

STEP_CELL = """
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from labkit.worker.reference import check_step

torch.manual_seed(0)
full = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)]).to(device)
x, y = torch.randn(8, 32, device=device), torch.randn(8, 32, device=device)
stages = [PipelineStage(full[2 * s:2 * s + 2], s, 2, device) for s in range(2)]  # both stages on this rank
sched = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=nn.functional.mse_loss)
losses = []
sched.step(x, target=y, losses=losses)
check = check_step(full, stages, x, y, losses, 4, nn.functional.mse_loss, device=device)
{"ok": check.ok, "max_abs_diff": check.max_abs_diff, "backend": dist.get_backend(), "device": str(device),
 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
 "torch": torch.__version__, "cuda": torch.version.cuda}
"""

MEMORY_CELL = """
import copy
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleLoopedBFS
from labkit.worker.memory import SavedTensorTracker, saved_activation_bytes

D, B, M = 512, 256, 4
cuda = device.type == "cuda"
torch.manual_seed(0)
full = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(4)]).to(device)
x, y = torch.randn(B, D, device=device), torch.randn(B, D, device=device)


def pipeline(model):
    parts = [model[0:2], model[2:4]]
    stages = [PipelineStage(p, s, 2, device) for s, p in enumerate(parts)]
    return parts, stages, ScheduleLoopedBFS(stages, n_microbatches=M, loss_fn=nn.functional.mse_loss)


def held(events):
    now, peak = {}, 0
    for _, st, b, _ in events:
        now[st] = b
        peak = max(peak, sum(now.values()))
    return sum(now.values()), peak


parts, stages, sched = pipeline(full)
h = parts[0](x).detach().requires_grad_()
# what the step saves by construction: LoopedBFS on one rank runs every forward before any backward,
# so at its peak the rank holds both stages' saved tensors for the whole batch
expected = saved_activation_bytes(parts[0], x) + saved_activation_bytes(parts[1], h)
del h
sched.step(x, target=y, losses=[])  # a warm step: a first step may also run a forward of torch's own
full.zero_grad(set_to_none=True)
tracker = SavedTensorTracker(stages)
if cuda:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
sched.step(x, target=y, losses=[])  # the measured step
if cuda:
    torch.cuda.synchronize(device)
    cuda_peak = torch.cuda.max_memory_allocated(device) - base
left, peak = held(tracker.events)
# what a pipeline's FIRST step leaves held (torch 2.15 keeps its metadata inference's forward alive)
probe_parts, probe_stages, probe_sched = pipeline(copy.deepcopy(full))
probe = SavedTensorTracker(probe_stages)
probe_sched.step(x, target=y, losses=[])
first_left, first_peak = held(probe.events)
{"expected_bytes": expected, "peak_bytes": peak, "held_after_step": left, "events": len(tracker.events),
 "input_bytes": x.numel() * x.element_size(), "grad_bytes": sum(p.numel() * p.element_size() for p in full.parameters()),
 "allocator_readings": sum(e[3] is not None for e in tracker.events),
 "cuda_max_allocated_above_start_bytes": cuda_peak if cuda else None,
 "first_step_peak_bytes": first_peak, "held_after_first_step": first_left,
 "sizes": {"dim": D, "batch": B, "microbatches": M}}
"""


def run_live(check: Check) -> None:
    """Parts 4 and 5 on one live pool of one rank."""
    from labkit.ranks import Ranks

    t0 = time.monotonic()
    deadline = check.parts["4_live_ranks"].deadline_s
    if check.left() < MIN_JOB_S:
        check.not_run(["4_live_ranks", "5_memory"], "the check's time budget was spent")
        return
    try:
        pool = Ranks(nproc=1, device=check.device, out=check.out / "live", live="print",
                     start_timeout=min(deadline, check.left()), timeout=min(deadline, check.left()))
    except Exception as e:
        check.jobs.append({"what": "live pool (parts 4, 5)", "status": "did not start", "processes": 2})
        check.conclude("4_live_ranks", FAIL, f"the pool did not start: {first_line(e)}", time.monotonic() - t0,
                       error=str(e)[-3000:])
        check.not_run(["5_memory"], "the live pool did not start (part 4)")
        return
    try:
        live_step(check, pool, t0)
        live_memory(check, pool)
    finally:
        pool.close()
        check.jobs.append({"what": "live pool (parts 4, 5)", "run_dir": str(pool.run_dir), "status": "closed",
                           "seconds": round(time.monotonic() - t0, 1), "restarts": pool.restarts,
                           "processes": 2 * (pool.restarts + 1)})
        check.save()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def cell_timeout(check: Check, key: str, t0: float) -> float:
    return max(1.0, min(check.parts[key].deadline_s - (time.monotonic() - t0), check.left()))


def live_step(check: Check, pool, t0: float) -> None:
    expected_backend = "nccl" if check.device == "cuda" else "gloo"
    try:
        got = pool.exec(STEP_CELL, timeout=cell_timeout(check, "4_live_ranks", t0))[0]
        counts = {f"{st}{kind}": n for (st, kind), n in sorted(pool.timeline().counts().items())}
    except Exception as e:
        check.conclude("4_live_ranks", FAIL, f"the cell failed: {first_line(e)}", time.monotonic() - t0,
                       error=str(e)[-3000:], backend=pool.status().get("backend"))
        return
    want = {"0F": 4, "0B": 4, "1F": 4, "1B": 4}
    problems = []
    if got["backend"] != expected_backend:
        problems.append(f"backend {got['backend']}, expected {expected_backend}")
    if not got["ok"]:
        problems.append(f"the step DOES NOT match the unsplit model (max abs diff {got['max_abs_diff']:.2e})")
    if counts != want:
        problems.append(f"the cell's spans count {counts}, expected {want}")
    if check.device == "cuda" and got.get("device_name"):
        check.env["device_name"] = got["device_name"]  # torch's name for it, from the rank that used it
    why = "; ".join(problems) or (f"{got['backend']} on {got['device']}: Interleaved1F1B, 2 stages x 4 microbatches "
                                  f"match the unsplit model (max abs diff {got['max_abs_diff']:.2e}); the cell's spans "
                                  f"hold its 16 actions")
    check.conclude("4_live_ranks", FAIL if problems else PASS, why, time.monotonic() - t0, rank=got, span_counts=counts,
                   run_dir=str(pool.run_dir))


def live_memory(check: Check, pool) -> None:
    t0 = time.monotonic()
    if check.left() < MIN_JOB_S / 2:
        check.not_run(["5_memory"], "the check's time budget was spent")
        return
    try:
        m = pool.exec(MEMORY_CELL, timeout=cell_timeout(check, "5_memory", t0))[0]
    except Exception as e:
        check.conclude("5_memory", FAIL, f"the cell failed: {first_line(e)}", time.monotonic() - t0, error=str(e)[-3000:])
        return
    verdict, why = memory_verdict(m, check.device)
    check.conclude("5_memory", verdict, why, time.monotonic() - t0, **m)


def memory_verdict(m: dict, device: str) -> tuple[str, str]:
    """The tracker's peak over a warm step must be the bytes the step saves by construction, and it must
    let all of them go by the step's end; on CUDA the allocator's peak above the step's start must hold
    at least that much."""
    mib = 2 ** 20
    problems = []
    if abs(m["peak_bytes"] - m["expected_bytes"]) > 0.01 * m["expected_bytes"]:
        problems.append(f"tracker peak {m['peak_bytes'] / mib:.2f} MiB, expected {m['expected_bytes'] / mib:.2f} MiB")
    if m["held_after_step"]:
        problems.append(f"{m['held_after_step']} bytes still held after the step")
    text = f"tracker peak {m['peak_bytes'] / mib:.2f} MiB = the step's saved tensors ({m['expected_bytes'] / mib:.2f} MiB)"
    if device == "cuda":  # the batch (the first stage's saved input) was allocated before the step began
        cuda_peak, new = m["cuda_max_allocated_above_start_bytes"], m["peak_bytes"] - m["input_bytes"]
        if cuda_peak < new:
            problems.append(f"max_memory_allocated rose {cuda_peak / mib:.2f} MiB, less than the "
                            f"{new / mib:.2f} MiB the tracker saw allocated during the step")
        if not m["allocator_readings"]:
            problems.append("no event carries torch.cuda.memory_allocated")
        text += (f"; torch.cuda.max_memory_allocated rose {cuda_peak / mib:.2f} MiB: the {new / mib:.2f} MiB "
                 f"the tracker saw allocated in the step ({new / max(cuda_peak, 1):.0%}), gradients "
                 f"({m['grad_bytes'] / mib:.2f} MiB) and temporaries")
    else:
        text += "; the comparison with torch.cuda.max_memory_allocated is GPU-only"
    if m["held_after_first_step"]:
        text += (f"; a pipeline's first step leaves {m['held_after_first_step'] / mib:.2f} MiB held (a forward "
                 f"of torch's own)")
    return (FAIL if problems else PASS), ("; ".join(problems) if problems else text)


# ---- main ----------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json, report.md and every run directory "
                                                "(new or empty)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if torch sees a GPU, else cpu")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for the whole check (default {BUDGET_S:g}); parts left when it is spent say so")
    return p.parse_args(argv)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out).resolve()
    if out.exists() and any(out.iterdir()):
        print(f"gpu_check: --out {out} already holds files: pass a new or empty folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    device = a.device or default_device()
    check = Check(out, device, a.budget)
    check.env = environment(device)
    check.env["rendezvous"] = prepare_children(out)
    print(f"[gpu_check] {check.env['device_name']} ({device}), torch {check.env['torch']}, budget {a.budget:g} s; "
          f"writing {out}", flush=True)
    check.save()
    try:
        run_suite(check, suite_items(check))
        run_live(check)
    except KeyboardInterrupt:
        check.not_run(list(check.parts), "interrupted")
        raise
    finally:
        check.not_run(list(check.parts), "the check ended before this part (see the parts above)")
        check.save()
    data = check.to_json()
    print(f"[gpu_check] {'no part failed' if data['ok'] else 'SOME PART FAILED'} in {data['seconds']:.0f} s; "
          f"{data['launches']['torchrun_jobs']} torchrun jobs ({data['launches']['processes']} processes); "
          f"{out / 'gpu_check.json'}, {out / 'report.md'}", flush=True)
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
