"""Launching real torchrun jobs from a notebook cell or a terminal, and keeping everything they leave.

`launch()` runs ANY torchrun script (or a module with `module=True`); `run()` runs the kit's
reference job (`python -m labkit.jobs.train`) for a `RunConfig`, which the job reads back from the
run directory's config.json. Both start `sys.executable -m torch.distributed.run` (the notebook's
own environment) as a child in its own session; the calling thread tails the rank logs so output
streams into the cell live. The parts live in `labkit.launching`: rundir, command, stream,
processes, diagnose. Taught in notebook 00.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .clean import clean, describe
from ..core.errors import ConfigError
from ..config.run import RunConfig
from .command import (
    DEFAULT_TIMEOUT_S,
    PP_LOG_FORMAT,
    command_text,
    job_env,
    preflight_device,
    preflight_torch,
    torchrun_command,
    validate_nodes,
)
from .diagnose import _CONSEQUENCE, error_message, failed_ranks_from_launcher, first_failure, stack_report, \
    where_stuck
from .stop import descendants, die_with_parent, stop_job
from .warm import warm_command
from .rundir import LaunchError, Run, new_run_dir
from .stream import STREAMS, Streamer
from ..core.progress import Progress

CHECK_FAILED = 3  # the reference job's exit code when its step does not match the unsplit model

REFERENCE_JOB = "labkit.jobs.train"

__all__ = ["DEFAULT_TIMEOUT_S", "LaunchError", "LaunchSpec", "PP_LOG_FORMAT", "REFERENCE_JOB", "Run", "launch",
           "launch_spec", "run"]


def _check_entry(script, module: bool) -> str:
    if module:
        name = str(script)
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(f"Module {name!r} cannot be imported here. Pass a module of an installed package "
                              f"(e.g. labkit.jobs.train), or a script path without module=True.")
        return name
    if not Path(script).is_file():
        raise ConfigError(f"Script {script} does not exist. Pass the path of a Python file torchrun can run.")
    return str(script)


@dataclass
class LaunchSpec:
    """One torchrun job as `launch()` takes it, validated on creation; each field is the `launch()`
    keyword of the same name (`entry` is its checked `script`)."""

    entry: str
    """The script's path, or with `module` the module's name."""
    args: list[str] = field(default_factory=list)
    """The script's command-line arguments."""
    nproc: int = 2
    """Ranks per node."""
    module: bool = False
    out: Any = None
    """The run directory (default: a new one under runs_root)."""
    runs_root: Any = None
    name: str | None = None
    """The run directory's label (default: the script's or module's name)."""
    env: dict | None = None
    timeout: float | None = DEFAULT_TIMEOUT_S
    """Seconds before the job is ended; None: no deadline (0 becomes None)."""
    stall: float | None = None
    """Seconds without new output from any rank, once every rank has written some, before the job is
    ended as hung (as at the deadline); None: never (0 becomes None)."""
    stream: str = "output"
    progress: bool = True
    check: bool = True
    pp_logs: bool = True
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    config: dict | None = None
    stop_event: Any = None
    echo: Callable | None = None
    on_progress: Callable | None = None

    def __post_init__(self) -> None:
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise ConfigError(f"nproc must be a whole number >= 1, got {self.nproc!r}.")
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0):
            raise ConfigError(f"timeout must be a positive number of seconds (0 or None: no deadline), got {t!r}.")
        self.timeout = t or None
        st = self.stall
        if st is not None and (isinstance(st, bool) or not isinstance(st, (int, float)) or st < 0):
            raise ConfigError(f"stall must be a positive number of seconds (0 or None: never), got {st!r}.")
        self.stall = st or None
        validate_nodes(self.nnodes, self.node_rank, self.rdzv_endpoint)
        if self.stream not in STREAMS:
            raise ConfigError(f"stream must be 'output', 'all' or 'none', got {self.stream!r}.")

    @property
    def label(self) -> str:
        return self.name or (self.entry.rsplit(".", 1)[-1] if self.module else Path(self.entry).stem)

    @property
    def single_node(self) -> bool:
        return self.nnodes == 1 and self.rdzv_endpoint is None


def launch(script: str | os.PathLike, args: list[str] | tuple = (), *, nproc: int = 2, out=None,
           runs_root=None, name: str | None = None, env: dict | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
           stream: str = "output", progress: bool = True, check: bool = True, pp_logs: bool = True,
           nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
           config: dict | None = None, stop_event=None, echo=None, on_progress=None, module: bool = False,
           stall: float | None = None) -> Run:
    """Run `script` under torchrun with `nproc` ranks and return a `Run`.

    module: `script` names a module (`python -m script`), e.g. "labkit.jobs.train".
    stream: "output" (rank stdout/stderr live, pipelining DEBUG lines only to the files), "all", or "none".
    timeout: seconds before the job is ended (every rank's stack is dumped first into its stderr.log
      and stacks.txt); default $LABKIT_TIMEOUT or 900; 0 or None: no deadline.
    stall: seconds without new output from any rank, counted once every rank has written some, before
      the job is ended as hung, like at the deadline (stacks dumped, status "timeout"). Unlike the
      deadline it does not count the start-up, which a busy machine makes slow; None: never.
    check: raise `LaunchError` (rank, command, log tail) when the job fails.
    nnodes, node_rank, rdzv_endpoint, rdzv_id: a multi-node job (torchrun's static rendezvous: node_rank
      0 hosts it at rdzv_endpoint and holds global rank 0); run the same call on every node with its own node_rank.
    config: written to the run directory's config.json (the kit's jobs read their RunConfig there).
    stop_event: a `threading.Event`; setting it ends the job like an interrupt (status "interrupted",
      no exception): for a Stop button when the launch runs in a background thread.
    echo: called with each live output line instead of print (e.g. an ipywidgets Output's append).
    on_progress: called as on_progress(done, total) when the script reports progress.
    """
    spec = LaunchSpec(_check_entry(script, module), [str(a) for a in args], nproc=nproc, module=module, out=out,
                      runs_root=runs_root, name=name, env=env, timeout=timeout, stall=stall, stream=stream,
                      progress=progress,
                      check=check, pp_logs=pp_logs, nnodes=nnodes, node_rank=node_rank,
                      rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, config=config, stop_event=stop_event,
                      echo=echo, on_progress=on_progress)
    return launch_spec(spec)


def launch_spec(spec: LaunchSpec) -> Run:
    """`launch()` for a `LaunchSpec`: prepare the run directory, start torchrun, watch it, conclude."""
    run = _prepare(spec)
    bar = Progress(spec.label, enabled=spec.progress, on_update=spec.on_progress)
    streamer = Streamer(run.run_dir, spec.nproc, spec.stream, bar, spec.echo)
    started = time.monotonic()
    proc = _start(spec, run)
    known = _watch(spec, run, proc, streamer, bar, started)
    _conclude(spec, run, proc, known, streamer)
    run.finish(started)
    bar.close(run.status)
    streamer.close()
    if run.status != "ok" and spec.check and run.status != "interrupted":
        raise LaunchError(error_message(run, run.error or "the job failed"), run)
    return run


def _prepare(spec: LaunchSpec) -> Run:
    """A new run directory holding the command (command.json, command.txt) and config.json."""
    run_dir = new_run_dir(spec.out, spec.label, spec.runs_root)
    cmd = torchrun_command(spec.entry, spec.args, spec.nproc, run_dir, spec.nnodes, spec.node_rank,
                           spec.rdzv_endpoint, spec.rdzv_id, module=spec.module)
    (run_dir / "command.json").write_text(json.dumps({"argv": cmd, "cwd": os.getcwd()}, indent=2))
    env = job_env(run_dir, spec.env, spec.pp_logs, spec.single_node, spec.nproc)
    (run_dir / "command.txt").write_text(command_text(cmd, env))
    (run_dir / "config.json").write_text(json.dumps(spec.config or {"script": spec.entry, "args": spec.args,
                                                                    "nproc": spec.nproc}, indent=2))
    return Run(run_dir=run_dir, command=cmd, nproc=spec.nproc)


def _start(spec: LaunchSpec, run: Run) -> subprocess.Popen:
    """torchrun, a child in its own session, its own output into launcher.log."""
    with open(run.run_dir / "launcher.log", "wb") as launcher_log:
        return subprocess.Popen(warm_command(run.command), stdout=launcher_log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                env=job_env(run.run_dir, spec.env, spec.pp_logs, spec.single_node, spec.nproc),
                                preexec_fn=die_with_parent)


def _watch(spec: LaunchSpec, run: Run, proc: subprocess.Popen, streamer: Streamer, bar: Progress,
           started: float) -> dict:
    """Stream the rank logs until torchrun exits, the deadline passes or stop_event is set; leave
    nothing running on any exception (KeyboardInterrupt: every rank stopped, then re-raised).
    Returns the job's processes seen ({pid: process})."""
    exited = _ExitWaiter(proc)
    known: dict = {}
    try:
        # Orphans of an earlier kernel that died hard: ended while torchrun starts (this job's processes
        # have a live owner, this one, so they are never among them): a /proc walk that need not delay it
        ended = clean(all_jobs=False)
        if ended:
            print(f"[labkit] ended what an earlier launch left running: {describe(ended)}", flush=True)
        _follow(spec, run, proc, streamer, known, exited, started)
    except KeyboardInterrupt:
        stop_job(proc, known)
        run.status = "interrupted"
        run.returncode = proc.returncode
        streamer.poll(final=True)
        run.error = "interrupted by the user (KeyboardInterrupt); every rank was stopped"
        run.finish(started)
        bar.close("interrupted")
        print(f"[labkit] interrupted: every rank stopped; logs kept in {run.run_dir}", file=sys.stderr, flush=True)
        raise
    finally:
        if proc.poll() is None:  # any other exception: leave nothing running
            stop_job(proc, known)
        exited.close()
    return known


def _follow(spec: LaunchSpec, run: Run, proc: subprocess.Popen, streamer: Streamer, known: dict,
            exited: "_ExitWaiter", started: float) -> None:
    """The watch loop: stream, note the ranks (`known`), stop the job at its deadline or on request."""
    next_scan = 0.0
    while proc.poll() is None:
        streamer.poll()
        now = time.monotonic()
        if now >= next_scan:  # the ranks, to end them if torchrun goes; a /proc walk, so not every tick
            for c in descendants(proc.pid):
                known.setdefault(c.pid, c)
            next_scan = now + (0.1 if now - started < 2 else 0.5)
        if spec.timeout is not None and time.monotonic() - started > spec.timeout:
            stop_job(proc, known, dump_stacks=True)
            run.status = "timeout"
            return
        silent = streamer.silent_for() if spec.stall is not None else None
        if silent is not None and silent > spec.stall:
            stop_job(proc, known, dump_stacks=True)
            run.status = "timeout"
            run.error = (f"No rank wrote anything for {spec.stall:g} s (stall=), after every rank had written "
                         "something")
            return
        if spec.stop_event is not None and spec.stop_event.is_set():
            stop_job(proc, known)
            run.status = "interrupted"
            run.error = "stopped on request (stop_event); every rank was stopped"
            return
        exited(0.1)  # wakes the moment torchrun exits, not at the next tick


def _conclude(spec: LaunchSpec, run: Run, proc: subprocess.Popen, known: dict, streamer: Streamer) -> None:
    """After torchrun: no rank left behind, the last output read, the status and what went wrong."""
    run.returncode = proc.returncode
    stop_job(proc, known, grace=2.0)  # workers exit before torchrun; make sure none lingers
    streamer.poll(final=True)
    if run.status == "running":
        run.status = "ok" if proc.returncode == 0 else "failed"
    if run.status == "timeout":
        where = stack_report(run)
        stuck, terms = _pipeline_terms(run)
        stalled = run.error is not None  # set by _follow: the stall, not the deadline, ended it
        slow = stuck is not None and not stuck.hung and any(s.doing == "compute" for s in stuck.ranks.values())
        head = (f"{run.error}: it was stopped" + (", but no rank was waiting for another (slow, not hung)" if slow
                                                  else " as hung") if stalled
                else f"The job did not finish within the {spec.timeout:g} s deadline and was stopped")
        run.error = (f"{head}. Where each rank was (full stacks in stacks.txt and each rank's stderr.log):\n"
                     + "\n".join(f"  rank {r}: {w}" for r, w in where.items()) + terms
                     + ("\nRaise stall= (--stall) if the job just works a long time between two outputs."
                        if stalled else "\nRaise the deadline with timeout= (--timeout) if the job is just slow."))
    elif run.status == "failed":
        run.failed_rank, reason = first_failure(run)
        run.rank_exitcodes = failed_ranks_from_launcher((run.run_dir / "launcher.log").read_text(errors="replace"))
        who = f"Rank {run.failed_rank}" if run.failed_rank is not None else "The job"
        run.error = f"{who} failed: {reason}"
        if _CONSEQUENCE.search(reason):  # a peer went away: which one left first, and what this rank waited for
            run.error += _pipeline_terms(run)[1]


def _pipeline_terms(run: Run) -> tuple:
    """(the `Stuck` reading, its text on new lines) of where the ranks were; (None, a line saying why) when
    it cannot be read: the explanation never hides the error itself."""
    try:
        stuck = where_stuck(run)
    except Exception as e:  # noqa: BLE001 - the launch error must still be raised
        return None, f"\n(labkit could not say where the ranks were in pipeline terms: {type(e).__name__}: {e})"
    return stuck, ("\n" + stuck.text()) if stuck.pipelined else ""


class _ExitWaiter:
    """`waiter(timeout)` returns when `proc` exits or after `timeout` s. Linux: a pidfd, readable the
    moment the process ends; elsewhere Popen.wait, whose polling sleeps up to 50 ms between looks."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.fd = proc, None
        try:
            self.fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # Python < 3.9, a kernel < 5.3, not Linux
            pass

    def __call__(self, timeout: float) -> None:
        if self.fd is not None:
            select.select([self.fd], [], [], timeout)
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def run(cfg: RunConfig | None = None, *, out=None, runs_root=None, check: bool = True, stream: str = "output",
        progress: bool = True, timeout: float | None = DEFAULT_TIMEOUT_S, env: dict | None = None,
        nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
        stop_event=None, echo=None, on_progress=None, job_args: list[str] | tuple = (), pp_logs: bool = True,
        stall: float | None = None, **overrides) -> Run:
    """Run the reference job (`labkit.jobs.train`) for a config: `labkit.run(schedule="1F1B")`.

    Keyword arguments that are RunConfig fields override `cfg` (e.g. `profile=True`). The config
    travels in the run directory's config.json. `check=True` raises `LaunchError` when the job
    fails or the pipelined step does not match the unsplit model; with `check=False` look at
    `run.status` and `run.result` instead. `job_args`: extra flags for the job (e.g. ["--log-ab"]);
    `pp_logs=False`: no TORCH_LOGS=+pp (the capture benchmark's control).
    """
    if cfg is None:
        cfg = RunConfig(**overrides)
    elif overrides:
        cfg = RunConfig.from_dict({**cfg.to_dict(), **overrides})
    validate_nodes(nnodes, node_rank, rdzv_endpoint)
    if cfg.pp_size % nnodes:
        raise ConfigError(f"pp_size {cfg.pp_size} is not divisible by nnodes {nnodes}: every node runs the same "
                          f"number of ranks. Use a pp_size that is a multiple of {nnodes}.")
    if cfg.composed and nnodes > 1:
        raise ConfigError("--dp-size / --tp-size / --fsdp run on one node here; multi-node meshes are not wired "
                          "into labkit run yet (notebook 10 shows the placement).")
    nproc = cfg.world_size // nnodes
    preflight_device(cfg.device, nproc)
    preflight_torch()
    name = f"{cfg.schedule}-{cfg.split}-p{cfg.pp_size}-m{cfg.n_microbatches}" + (
        f"-dp{cfg.dp_size}-tp{cfg.tp_size}{'-fsdp' if cfg.fsdp else ''}" if cfg.composed else "")
    r = launch(REFERENCE_JOB, list(job_args), nproc=nproc, out=out, runs_root=runs_root, module=True, pp_logs=pp_logs,
               name=name, env=env, timeout=timeout, stall=stall, stream=stream, progress=progress, check=False,
               config=cfg.to_dict(), nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
               rdzv_id=rdzv_id, stop_event=stop_event, echo=echo, on_progress=on_progress)
    if check and not r.ok and r.status != "interrupted":
        if reference_mismatch(r):
            raise LaunchError(error_message(r, f"The pipelined step does not match the unsplit model: "
                                               f"{r.result.get('failure')}"), r)
        raise LaunchError(error_message(r, r.error or "the job failed"), r)
    return r


def reference_mismatch(r: Run) -> bool:
    """Did the job fail because its step did not match the unsplit model (and nothing else)? Rank 0's
    result.json says so, and rank 0 failed first, or every rank that failed exited with the job's
    "check failed" code: which of them torchrun saw first is a matter of scheduling (on a busy
    machine rank 1 often wins)."""
    if r.result is None or r.result.get("reference_match") is not False:
        return False
    return r.failed_rank in (0, None) or bool(r.rank_exitcodes) and set(r.rank_exitcodes.values()) == {CHECK_FAILED}
