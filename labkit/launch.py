"""Launching real torchrun jobs from a notebook cell or a terminal, and keeping everything they leave.

`launch()` runs ANY torchrun script; `run()` runs the kit's reference script for a `RunConfig`.
Both start `sys.executable -m torch.distributed.run` (the notebook's own environment) as a child
in its own session, with torchrun writing every rank's stdout/stderr to files in a new run
directory (`--log-dir`, `--redirects 3`). The calling thread tails those files, so output streams
into the cell live, prefixed by rank, and no pipe can fill up and block a rank.

A run directory holds: `command.json` / `command.txt` (the exact argv), `config.json`,
`launcher.log` (torchrun's own output), `logs/<id>/attempt_0/<rank>/{stdout,stderr}.log` (with the
pipelining logger at DEBUG in stderr), `result.json` (written by the script), and `run.json`
(status, return code, wall time, failing rank). Taught in notebook 00.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from .config import ConfigError, RunConfig
from .progress import Progress, in_notebook
from .clean import OWNER_VAR, RUN_DIR_VAR, clean, describe, kill_all, owner_token
from .rendezvous import BACKEND_NAME

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_SCRIPT = REPO_ROOT / "scripts" / "train_pipeline.py"
DEFAULT_RUNS_ROOT = "runs"
# The pipelining logger at DEBUG, with microsecond timestamps (Python's default gives whole ms).
PP_LOG_FORMAT = "%(created).6f %(levelname).1s %(name)s %(filename)s:%(lineno)d] %(message)s"
PROGRESS_RE = re.compile(r"\[labkit\] progress (\d+)/(\d+)")
TAIL_LINES = 30
DEFAULT_TIMEOUT_S = float(os.environ.get("LABKIT_TIMEOUT", "900"))  # a hung lab job ends within 15 minutes


class LaunchError(RuntimeError):
    """A job that failed: names the rank, the command and the tail of that rank's log."""

    def __init__(self, message: str, run: "Run"):
        super().__init__(message)
        self.run = run


@dataclass
class Run:
    """What a launch left behind. `result` is the script's result.json (None if it wrote none)."""

    run_dir: Path
    command: list[str]
    nproc: int
    status: str = "running"  # ok | failed | interrupted | timeout
    returncode: int | None = None
    wall_time_s: float = 0.0
    result: dict | None = None
    failed_rank: int | None = None
    error: str | None = None
    rank_exitcodes: dict = field(default_factory=dict)
    """{rank: exit code} for the ranks torchrun reported as failed."""

    @property
    def job_exitcode(self) -> int:
        """The failing rank's own exit code (torchrun itself always exits 1); 0 when all went well."""
        if self.returncode == 0:
            return 0
        code = self.rank_exitcodes.get(self.failed_rank)
        return code if isinstance(code, int) and code > 0 else (self.returncode or 1)

    def rank_dir(self, rank: int) -> Path | None:
        """torchrun's per-rank log folder (`logs/<id>/attempt_<n>/<rank>`), newest attempt."""
        hits = sorted(self.run_dir.glob(f"logs/*/attempt_*/{rank}"))
        return hits[-1] if hits else None

    def log_path(self, rank: int, stream: str = "stderr") -> Path | None:
        d = self.rank_dir(rank)
        return d / f"{stream}.log" if d else None

    def log(self, rank: int, stream: str = "stderr") -> str:
        p = self.log_path(rank, stream)
        return p.read_text(errors="replace") if p and p.exists() else ""

    def tail(self, rank: int, n: int = TAIL_LINES) -> str:
        """Last `n` lines of a rank's stdout and stderr together (what an error message shows)."""
        lines = []
        for stream in ("stdout", "stderr"):
            lines += [f"{stream}: {l}" for l in self.log(rank, stream).splitlines()]
        return "\n".join(lines[-n:])

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def summary(self) -> dict:
        """Deterministic facts about the run (no times, paths or pids): safe to print in a tested notebook."""
        r = self.result or {}
        keys = ("schedule", "pp_size", "n_stages", "n_microbatches", "split", "reference_match")
        return {"status": self.status, "returncode": self.returncode, **{k: r[k] for k in keys if k in r}}

    def to_dict(self) -> dict:
        return {
            "run_dir": str(self.run_dir), "command": self.command, "nproc": self.nproc,
            "status": self.status, "returncode": self.returncode, "wall_time_s": self.wall_time_s,
            "failed_rank": self.failed_rank, "error": self.error,
            "rank_exitcodes": {str(k): v for k, v in self.rank_exitcodes.items()},
        }

    def __repr__(self) -> str:
        return f"Run(status={self.status!r}, returncode={self.returncode}, wall_time_s={self.wall_time_s:.1f}, run_dir='{self.run_dir}')"


# ---------------------------------------------------------------------------------------------
# run directories


def new_run_dir(out: str | os.PathLike | None = None, name: str = "run", runs_root: str | os.PathLike | None = None) -> Path:
    """A fresh run directory. An explicit `out` must not exist yet (or be empty): runs are never overwritten."""
    if out is not None:
        d = Path(out)
        if d.exists() and (not d.is_dir() or any(d.iterdir())):
            raise ConfigError(f"Run directory {d} already exists and is not empty: runs are never overwritten. "
                              f"Pass a new --out path, or delete the old run first.")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"Cannot create run directory {d}: {e.strerror}. Pass an --out path you can write to.") from None
        if not os.access(d, os.W_OK):
            raise ConfigError(f"Run directory {d} is not writable. Pass an --out path you can write to.")
        return d
    root = Path(runs_root or os.environ.get("LABKIT_RUNS", DEFAULT_RUNS_ROOT))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:40] or "run"
    for _ in range(100):
        d = root / f"{stamp}-{safe}-{uuid.uuid4().hex[:6]}"
        try:
            d.mkdir(parents=True)  # exist_ok=False: two launches can never share a directory
            return d
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"Cannot create a run directory under {root}: {e.strerror}. Set runs_root= "
                              f"(or $LABKIT_RUNS) to a folder you can write to.") from None
    raise RuntimeError(f"could not create a unique run directory under {root}")


# ---------------------------------------------------------------------------------------------
# the command


def torchrun_command(script: str | os.PathLike, script_args: list[str], nproc: int, run_dir: Path,
                     nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None) -> list[str]:
    """argv for torchrun (never a shell string). Single node: an OS-chosen port, never a fixed 29500."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        if os.environ.get("LABKIT_RDZV") == "standalone":  # escape hatch: torchrun's own (all interfaces)
            cmd += ["--standalone", "--nnodes", "1"]
        else:  # loopback-only stores on an OS-chosen port (labkit.rendezvous)
            cmd += ["--nnodes", "1", "--rdzv-backend", BACKEND_NAME, "--rdzv-endpoint", "127.0.0.1:0",
                    "--rdzv-id", f"labkit-{run_dir.name}", "--local-addr", "127.0.0.1"]
    else:
        if not rdzv_endpoint:
            raise ConfigError("A multi-node job needs a rendezvous endpoint HOST:PORT reachable from every node.")
        # static, not c10d: c10d ignores --node-rank and numbers nodes by the order it sorts them in, so
        # global rank 0 (and its result.json) could land on any node. Static honours --node-rank: node 0
        # hosts the store at the endpoint and holds ranks 0..nproc-1.
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "static",
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id or f"labkit-{rdzv_endpoint}"]
    cmd += ["--nproc-per-node", str(nproc), "--max-restarts", "0",
            "--log-dir", str(run_dir / "logs"), "--redirects", "3", str(script), *script_args]
    return cmd


def job_env(run_dir: Path, extra: dict | None = None, pp_logs: bool = True, single_node: bool = True) -> dict:
    env = dict(os.environ)
    if single_node and sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's listeners on loopback only
    env["PYTHONUNBUFFERED"] = "1"  # rank output reaches the files (and the cell) line by line
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT dumps every thread's stack into the rank's stderr.log
    env[RUN_DIR_VAR] = str(run_dir.resolve())  # marks the kit's processes (labkit clean) and tells scripts where to write
    env[OWNER_VAR] = owner_token()  # who launched it: when that process dies, its ranks are orphans
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun would pick anyway, without its warning
    if pp_logs:
        env["TORCH_LOGS"] = "+pp"
        env["TORCH_LOGS_FORMAT"] = PP_LOG_FORMAT
    # Make the kit importable in the ranks even when it is not pip-installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def _die_with_parent() -> None:
    """In the torchrun child: get SIGTERM if the launching process dies (a kernel killed hard)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# live output


class _Tail:
    """Follows one growing file and yields complete new lines."""

    def __init__(self, path: Path, prefix: str):
        self.path, self.prefix, self.pos, self.buf = path, prefix, 0, b""
        self.in_pp_record = False  # inside a multi-line pipelining log record

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        if final and self.buf:
            lines.append(self.buf)
            self.buf = b""
        return [l.decode(errors="replace") for l in lines]


def _is_pp_log(line: str) -> bool:
    return "torch.distributed.pipelining" in line or "torch/distributed/pipelining" in line


# Where a new record begins (so the continuation lines of a multi-line pipelining record, such as
# the tracer's printed graph, can be told apart): a log header in labkit's or torch's default
# format, a traceback, a Python warning, or the kit's own lines.
_RECORD_START = re.compile(r"^(\d{9,}\.\d+ [A-Z] |(\[rank\d+\]:)*[VDIWEC]\d{4} |Traceback |\S+\.py:\d+: \w*Warning|\[labkit\]|\[rank)")


class _Streamer:
    def __init__(self, run_dir: Path, nproc: int, stream: str, progress: Progress | None, echo=None):
        self.run_dir, self.nproc, self.stream, self.progress = run_dir, nproc, stream, progress
        self.echo = echo or (lambda line: print(line, flush=True))
        self.tails: dict[Path, _Tail] = {}
        self.pp_lines = 0

    def _discover(self) -> None:
        p = self.run_dir / "launcher.log"
        if p not in self.tails and self.stream == "all":  # torchrun's own chatter; errors reach LaunchError
            self.tails[p] = _Tail(p, "[launcher] ")
        for rank in range(self.nproc):
            for s in ("stdout", "stderr"):
                for f in self.run_dir.glob(f"logs/*/attempt_*/{rank}/{s}.log"):
                    if f not in self.tails:
                        self.tails[f] = _Tail(f, f"[rank{rank}] " if s == "stdout" else f"[rank{rank}:err] ")

    def poll(self, final: bool = False) -> None:
        self._discover()
        for tail in self.tails.values():
            for line in tail.read(final):
                m = PROGRESS_RE.search(line)
                if m and self.progress is not None:
                    self.progress.update(int(m.group(1)), int(m.group(2)))
                    if self.progress.enabled and (in_notebook() or sys.stderr.isatty()):
                        continue  # the bar shows it
                if _RECORD_START.match(line):
                    tail.in_pp_record = _is_pp_log(line)
                if tail.in_pp_record:
                    self.pp_lines += 1
                    if self.stream != "all":
                        continue
                if self.stream != "none":
                    self.echo(tail.prefix + line)
        if self.progress is not None:
            self.progress.tick()


# ---------------------------------------------------------------------------------------------
# stopping and reporting


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def _stop(proc: subprocess.Popen, known: dict, grace: float = 5.0, dump_stacks: bool = False) -> None:
    """End torchrun and every worker it started (workers live in their own sessions)."""
    import psutil

    workers = list({w.pid: w for w in list(known.values()) + _descendants(proc.pid)}.values())
    if dump_stacks and proc.poll() is None:
        # Freeze the agent first: once one rank dies of its SIGABRT, torchrun would kill the others
        # in the middle of writing their stacks.
        proc.send_signal(signal.SIGSTOP)
        for w in workers:
            try:
                w.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER=1: stacks of all threads -> stderr.log
            except psutil.Error:
                pass
        psutil.wait_procs(workers, timeout=5)  # SIGABRT is fatal once the stacks are written
        proc.send_signal(signal.SIGCONT)
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)  # torchrun forwards SIGTERM to its workers
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    kill_all(workers, grace)


def _rank_errors(run_dir: Path) -> dict[int, dict]:
    """torchrun's per-rank error.json files (written by @record when a rank raises)."""
    out = {}
    for f in run_dir.glob("logs/*/attempt_*/*/error.json"):
        try:
            data = json.loads(f.read_text())
            out[int(f.parent.name)] = data.get("message", data)
        except (ValueError, OSError):
            continue
    return out


def _failed_ranks_from_launcher(text: str) -> dict[int, int]:
    """{rank: exitcode} from torchrun's failure summary."""
    found = {}
    for m in re.finditer(r"rank\s*:\s*(\d+)[^\n]*\n(?:[^\n]*\n){0,3}?\s*exitcode\s*:\s*(-?\d+)", text):
        found[int(m.group(1))] = int(m.group(2))
    return found


# Errors that only echo another rank's crash (the peer hung up): never the root cause if another exists.
_CONSEQUENCE = re.compile(r"Connection closed by peer|remote worker crashing|Connection reset by peer|Broken pipe|"
                          r"NCCL communicator was aborted|SignalException|Socket Timeout", re.I)


def _root_cause_from_launcher(text: str) -> int | None:
    m = re.search(r"Root Cause[^\n]*\n(?:[^\n]*\n){0,4}?\s*rank\s*:\s*(\d+)", text)
    return int(m.group(1)) if m else None


def _first_failure(run: Run) -> tuple[int | None, str]:
    """The rank that failed first, and its last error line: its own exception beats a peer's echo of it."""
    errors = _rank_errors(run.run_dir)
    launcher = (run.run_dir / "launcher.log").read_text(errors="replace") if (run.run_dir / "launcher.log").exists() else ""
    codes = _failed_ranks_from_launcher(launcher)
    root = _root_cause_from_launcher(launcher)

    def text(r) -> str:
        e = errors[r]
        if isinstance(e, dict):
            return str(e.get("message") or e.get("extraInfo", {}).get("py_callstack") or e)
        return str(e)

    def stamp(r) -> int:
        e = errors[r]
        ts = e.get("extraInfo", {}).get("timestamp", "0") if isinstance(e, dict) else "0"
        return int(ts) if str(ts).isdigit() else 0

    if errors:
        rank = min(errors, key=lambda r: (bool(_CONSEQUENCE.search(text(r))), r != root, stamp(r), r))
        lines = [l for l in text(rank).strip().splitlines() if l.strip()]
        return rank, lines[-1].strip() if lines else "raised an exception"
    if codes:
        rank = root if root in codes else min((r for r, c in codes.items() if c != -15), default=min(codes))
        return rank, f"exited with code {codes[rank]}"
    return None, "torchrun failed before any rank reported (see launcher.log)"


_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')


def _stack_report(run: Run) -> dict[int, str]:
    """From each rank's faulthandler dump: its innermost frame, and the innermost frame outside libraries."""
    where = {}
    dumps = []
    for rank in range(run.nproc):
        text = run.log(rank, "stderr")
        i = text.rfind("Fatal Python error")
        if i < 0:
            where[rank] = "no stack dump (the rank had already exited)"
            continue
        dump = text[i:]
        dumps.append(f"=== rank {rank} ===\n{dump}")
        current = dump[dump.find("Current thread"):] if "Current thread" in dump else dump
        frames = [m.groups() for m in map(_FRAME.match, current.splitlines()) if m]
        if not frames:
            where[rank] = "stack dump has no Python frames"
            continue
        inner = frames[0]
        user = next((f for f in frames if "site-packages" not in f[0] and "/lib/python" not in f[0]), inner)
        where[rank] = f"{user[0]}:{user[1]} in {user[2]}" + (
            f" (innermost: {Path(inner[0]).name}:{inner[1]} in {inner[2]})" if user != inner else "")
    if dumps:
        (run.run_dir / "stacks.txt").write_text("\n".join(dumps))
    return where


def _finish(run: Run, started: float) -> None:
    run.wall_time_s = time.monotonic() - started
    rp = run.run_dir / "result.json"
    if rp.exists():
        try:
            run.result = json.loads(rp.read_text())
        except ValueError:
            run.result = None
    (run.run_dir / "run.json").write_text(json.dumps(run.to_dict(), indent=2))


def _error_message(run: Run, headline: str) -> str:
    cmd = shlex.join(run.command)
    parts = [headline, f"Command: {cmd}", f"Run directory: {run.run_dir}"]
    if run.failed_rank is not None:
        parts.append(f"Last lines of rank {run.failed_rank}'s log ({run.rank_dir(run.failed_rank)}):")
        parts.append(run.tail(run.failed_rank) or "(empty)")
    elif run.status == "timeout":
        parts.append("Every rank's stack: stacks.txt in the run directory.")
    else:
        parts.append("Last lines of launcher.log:")
        launcher = run.run_dir / "launcher.log"
        parts.append("\n".join(launcher.read_text(errors="replace").splitlines()[-TAIL_LINES:]) if launcher.exists() else "(empty)")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# checks made before anything starts


def validate_nodes(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> None:
    for name, v, lo in (("nnodes", nnodes, 1), ("node_rank", node_rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name} must be a whole number >= {lo}, got {v!r}.")
    if node_rank >= nnodes:
        raise ConfigError(f"node_rank {node_rank} must be below nnodes {nnodes} (nodes are numbered from 0).")
    if nnodes > 1 and not rdzv_endpoint:
        raise ConfigError("A multi-node job needs --rdzv-endpoint HOST:PORT (the first node's address, reachable "
                          "from every node); run the same command on each node with its own --node-rank.")
    if rdzv_endpoint is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--rdzv-endpoint must look like HOST:PORT (e.g. node001:29400), got {rdzv_endpoint!r}.")


def preflight_device(device: str, nproc: int) -> None:
    """`--device cuda` needs a GPU per local rank (NCCL refuses two ranks on one GPU): say so before launching."""
    if device != "cuda":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < nproc:
        raise ConfigError(
            f"--device cuda with {nproc} ranks on this node needs {nproc} GPUs, but {gpus} are visible "
            f"(NCCL refuses two ranks on one GPU). Use --nproc {max(gpus, 1)} with a multi-stage schedule "
            f"(all stages on one rank), or --device cpu.")


# ---------------------------------------------------------------------------------------------
# public API


def launch(script: str | os.PathLike, args: list[str] | tuple = (), *, nproc: int = 2, out=None,
           runs_root=None, name: str | None = None, env: dict | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
           stream: str = "output", progress: bool = True, check: bool = True, pp_logs: bool = True,
           nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
           config: dict | None = None, stop_event=None, echo=None, on_progress=None) -> Run:
    """Run `script` under torchrun with `nproc` ranks and return a `Run`.

    stream: "output" (rank stdout/stderr live, pipelining DEBUG lines only to the files), "all", or "none".
    timeout: seconds before the job is ended (every rank's stack is dumped first into its stderr.log
      and stacks.txt); default $LABKIT_TIMEOUT or 900; 0 or None: no deadline.
    check: raise `LaunchError` (rank, command, log tail) when the job fails.
    nnodes, node_rank, rdzv_endpoint, rdzv_id: a multi-node job (torchrun's static rendezvous: node_rank
      0 hosts it at rdzv_endpoint and holds global rank 0); run the same call on every node with its own node_rank.
    stop_event: a `threading.Event`; setting it ends the job like an interrupt (status "interrupted",
      no exception): for a Stop button when the launch runs in a background thread.
    echo: called with each live output line instead of print (e.g. an ipywidgets Output's append).
    on_progress: called as on_progress(done, total) when the script reports progress.
    """
    script = Path(script)
    if not script.is_file():
        raise ConfigError(f"Script {script} does not exist. Pass the path of a Python file torchrun can run.")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc must be a whole number >= 1, got {nproc!r}.")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
        raise ConfigError(f"timeout must be a positive number of seconds (0 or None: no deadline), got {timeout!r}.")
    timeout = timeout or None
    validate_nodes(nnodes, node_rank, rdzv_endpoint)
    if stream not in ("output", "all", "none"):
        raise ConfigError(f"stream must be 'output', 'all' or 'none', got {stream!r}.")
    ended = clean(all_jobs=False)  # orphans of an earlier kernel that died hard
    if ended:
        print(f"[labkit] before launching: {describe(ended)}", flush=True)
    run_dir = new_run_dir(out, name or script.stem, runs_root)
    cmd = torchrun_command(script, [str(a) for a in args], nproc, run_dir, nnodes, node_rank, rdzv_endpoint, rdzv_id)
    (run_dir / "command.json").write_text(json.dumps({"argv": cmd, "cwd": os.getcwd()}, indent=2))
    (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    (run_dir / "config.json").write_text(json.dumps(config or {"script": str(script), "args": list(map(str, args)),
                                                               "nproc": nproc}, indent=2))
    run = Run(run_dir=run_dir, command=cmd, nproc=nproc)
    bar = Progress(name or script.stem, enabled=progress, on_update=on_progress)
    streamer = _Streamer(run_dir, nproc, stream, bar, echo)
    started = time.monotonic()
    with open(run_dir / "launcher.log", "wb") as launcher_log:
        proc = subprocess.Popen(cmd, stdout=launcher_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=job_env(run_dir, env, pp_logs, nnodes == 1 and rdzv_endpoint is None), preexec_fn=_die_with_parent)
    known: dict = {}
    next_scan = 0.0
    try:
        while proc.poll() is None:
            streamer.poll()
            now = time.monotonic()
            if now >= next_scan:  # the ranks, to end them if torchrun goes; a /proc walk, so not every tick
                for c in _descendants(proc.pid):
                    known.setdefault(c.pid, c)
                next_scan = now + (0.1 if now - started < 2 else 0.5)
            if timeout is not None and time.monotonic() - started > timeout:
                _stop(proc, known, dump_stacks=True)
                run.status = "timeout"
                break
            if stop_event is not None and stop_event.is_set():
                _stop(proc, known)
                run.status = "interrupted"
                run.error = "stopped on request (stop_event); every rank was stopped"
                break
            try:  # wakes the moment torchrun exits, not at the next tick
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        _stop(proc, known)
        run.status = "interrupted"
        run.returncode = proc.returncode
        streamer.poll(final=True)
        run.error = "interrupted by the user (KeyboardInterrupt); every rank was stopped"
        _finish(run, started)
        bar.close("interrupted")
        print(f"[labkit] interrupted: every rank stopped; logs kept in {run_dir}", file=sys.stderr, flush=True)
        raise
    finally:
        if proc.poll() is None:  # any other exception: leave nothing running
            _stop(proc, known)
    run.returncode = proc.returncode
    # Workers exit before torchrun; make sure none lingers (e.g. torchrun itself was killed).
    _stop(proc, known, grace=2.0)
    streamer.poll(final=True)
    if run.status == "running":
        run.status = "ok" if proc.returncode == 0 else "failed"
    if run.status == "timeout":
        where = _stack_report(run)
        run.error = (f"The job did not finish within the {timeout:g} s deadline and was stopped. Where each rank "
                     f"was (full stacks in stacks.txt and each rank's stderr.log):\n"
                     + "\n".join(f"  rank {r}: {w}" for r, w in where.items())
                     + "\nRaise the deadline with timeout= (--timeout) if the job is just slow.")
    elif run.status == "failed":
        run.failed_rank, reason = _first_failure(run)
        run.rank_exitcodes = _failed_ranks_from_launcher((run_dir / "launcher.log").read_text(errors="replace"))
        who = f"Rank {run.failed_rank}" if run.failed_rank is not None else "The job"
        run.error = f"{who} failed: {reason}"
    _finish(run, started)
    bar.close(run.status)
    if streamer.pp_lines and stream == "output":
        streamer.echo(f"[labkit] {streamer.pp_lines} pipelining log lines saved in the rank logs (stream='all' shows them)")
    if run.status != "ok" and check and run.status != "interrupted":
        raise LaunchError(_error_message(run, run.error or "the job failed"), run)
    return run


def run(cfg: RunConfig | None = None, *, out=None, runs_root=None, check: bool = True, stream: str = "output",
        progress: bool = True, timeout: float | None = DEFAULT_TIMEOUT_S, env: dict | None = None,
        nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
        stop_event=None, echo=None, on_progress=None, profile: bool = False, **overrides) -> Run:
    """Run the reference script (`scripts/train_pipeline.py`) for a config: `labkit.run(schedule="1F1B")`.

    `check=True` raises `LaunchError` when the job fails or the pipelined step does not match the
    unsplit model; with `check=False` look at `run.status` and `run.result` instead.
    """
    if cfg is None:
        cfg = RunConfig(**overrides)
    elif overrides:
        cfg = RunConfig.from_dict({**cfg.to_dict(), **overrides})
    validate_nodes(nnodes, node_rank, rdzv_endpoint)
    if cfg.pp_size % nnodes:
        raise ConfigError(f"pp_size {cfg.pp_size} is not divisible by nnodes {nnodes}: every node runs the same "
                          f"number of ranks. Use a pp_size that is a multiple of {nnodes}.")
    nproc = cfg.pp_size // nnodes
    preflight_device(cfg.device, nproc)
    name = f"{cfg.schedule}-{cfg.split}-p{cfg.pp_size}-m{cfg.n_microbatches}"
    r = launch(REFERENCE_SCRIPT, cfg.script_args() + (["--profile"] if profile else []), nproc=nproc, out=out, runs_root=runs_root,
               name=name, env=env, timeout=timeout, stream=stream, progress=progress, check=False,
               config=cfg.to_dict(), nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
               rdzv_id=rdzv_id, stop_event=stop_event, echo=echo, on_progress=on_progress)
    if check and not r.ok and r.status != "interrupted":
        if r.result is not None and r.result.get("reference_match") is False and r.failed_rank in (0, None):
            raise LaunchError(_error_message(r, f"The pipelined step does not match the unsplit model: "
                                                f"{r.result.get('failure')}"), r)
        raise LaunchError(_error_message(r, r.error or "the job failed"), r)
    return r
