"""Parts 1-3: the reference job's suite (`--suite`, every config in turn on one rank), watched from a
thread; a config that hangs past its part's deadline is stopped (its stack dumped first) and the job
launched again for what is left. Each config writes its result.json into its own folder of --out."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .common import FAIL, MIN_JOB_S, PASS, PENDING, SKIPPED, Check, first_line
from .spans import conclude_spans

POLL_S = 0.25


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
        failed.error = (f"the job failed while running this config: {run.error or run.status}. "
                        f"Run directory: {run.run_dir}")
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
    """Conclude each part of `keys` still pending (with `only_complete`, only once all its configs are
    done): part 3 from its profiled run, the others from their configs' results."""
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
    """Part 1 or 2: pass when every config matches the unsplit model, skipped when none ran, else fail
    (what failed, what did not run); one row a config as its figures."""
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
