"""One torchrun launch of a live pool, seen from the kernel: start it, talk to its ranks, end it.

Owns the processes and sockets of a pool: the torchrun agent (started in its own session with a
parent-death signal, so a kernel killed hard takes it along), the listener the ranks connect to,
one reader thread per rank that turns frames into `(rank, message)` items on one queue (`None` as
the message: that rank hung up), and stopping everything so that no process is left. A `Ranks`
pool keeps one `Job` at a time; `restart()` replaces it. Taught in notebook 01 (live ranks).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from ..launching.clean import kill_all
from ..launching.command import command_text, job_env, torchrun_command
from ..launching.warm import warm_command
from ..launching.diagnose import _root_cause_from_launcher, current_thread, launcher_text, other_threads
from ..launching.stop import descendants, die_with_parent, stop_job
from . import channel

RANK_MODULE = "labkit.ranks.rank"
TAIL_LINES = 20


class StartError(RuntimeError):
    pass


class Job:
    def __init__(self, run_dir: Path, nproc: int, device: str, pg_timeout_s: float, generation: int):
        self.run_dir, self.nproc, self.device, self.generation = run_dir, nproc, device, generation
        self.pg_timeout_s = pg_timeout_s
        self.queue: queue.Queue = queue.Queue()
        self.conns: dict[int, socket.socket] = {}
        self.hello: dict[int, dict] = {}
        self.proc: subprocess.Popen | None = None
        self.listener: channel.Listener | None = None
        self.log_dir: Path | None = None  # torchrun's logs/<id>/attempt_0 of this launch
        self.closing = False
        self._lock = threading.Lock()
        self._before: set = set()
        self.command: list[str] = []

    # ---- starting

    def start(self, timeout: float) -> None:
        self.listener = channel.Listener()
        cmd = torchrun_command(RANK_MODULE, [], self.nproc, self.run_dir, module=True)
        env = job_env(self.run_dir, {**self.listener.env(), channel.DEVICE_VAR: self.device,
                                     channel.PG_TIMEOUT_VAR: str(self.pg_timeout_s)}, pp_logs=True, nproc=self.nproc)
        self.command = cmd
        (self.run_dir / "command.txt").write_text(command_text(cmd, env))  # the secret is never shown
        (self.run_dir / "command.json").write_text(json.dumps({"argv": cmd, "cwd": os.getcwd()}, indent=2))
        self._before = set((self.run_dir / "logs").glob("*"))
        with open(self.run_dir / "launcher.log", "ab") as log:
            log.write(f"--- start {self.generation} ---\n".encode())
            log.flush()
            self.proc = subprocess.Popen(warm_command(cmd), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL,
                                         env=env, preexec_fn=die_with_parent)
        threading.Thread(target=self._accept, name="labkit-ranks-accept", daemon=True).start()
        deadline = time.monotonic() + timeout
        while len(self.hello) < self.nproc:
            if self.proc.poll() is not None:
                raise StartError(f"torchrun exited with code {self.proc.returncode} before every rank joined.")
            if time.monotonic() > deadline:
                raise StartError(f"only {len(self.hello)} of {self.nproc} ranks joined within {timeout:g} s.")
            try:
                rank, msg = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg is not None and msg.get("t") == "hello":
                self.hello[rank] = msg

    def _accept(self) -> None:
        sock = self.listener.sock
        while not self.closing:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # the listener was closed
            threading.Thread(target=self._serve, args=(conn,), name="labkit-ranks-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Authenticate, register by the rank the hello names, then forward every frame to the queue."""
        if not channel.authenticate(conn, self.listener.secret):
            conn.close()  # no secret, a wrong one, or too slow: refused, nothing read from it
            return
        try:
            first = channel.recv_msg(conn)
        except Exception:
            first = None
        rank = first.get("rank") if isinstance(first, dict) and first.get("t") == "hello" else None
        with self._lock:
            if not isinstance(rank, int) or not 0 <= rank < self.nproc or rank in self.conns or self.closing:
                conn.close()
                return
            self.conns[rank] = conn
        self.queue.put((rank, first))
        while True:
            try:
                msg = channel.recv_msg(conn)
            except Exception:  # a broken frame: treat the rank as gone (the pool restarts)
                msg = None
            self.queue.put((rank, msg))
            if msg is None:
                return

    # ---- talking

    def send(self, rank: int, msg: dict) -> bool:
        try:
            channel.send_msg(self.conns[rank], msg)
            return True
        except (OSError, KeyError):
            return False

    def get(self, timeout: float):
        try:
            return self.queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def pid(self, rank: int) -> int | None:
        return self.hello.get(rank, {}).get("pid")

    def signal(self, ranks, sig: int) -> None:
        for r in ranks:
            pid = self.pid(r)
            if pid:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def alive(self, rank: int) -> bool:
        import psutil

        pid = self.pid(rank)
        try:
            return bool(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    # ---- logs

    def rank_log(self, rank: int, stream: str = "stderr") -> Path | None:
        if self.log_dir is None:
            new = [p for p in (self.run_dir / "logs").glob("*") if p not in self._before]
            hits = sorted(new, key=lambda p: p.stat().st_mtime)
            if not hits:
                return None
            self.log_dir = hits[-1] / "attempt_0"
        return self.log_dir / str(rank) / f"{stream}.log"

    def root_cause(self, wait: float = 5.0) -> int | None:
        """The rank torchrun's agent saw fail first (its failure summary in launcher.log, written as it
        ends the job; waited for up to `wait` s): the hang-ups of the other ranks, which the agent ends
        at once, can reach the kernel first."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return None
        return _root_cause_from_launcher(launcher_text(self.run_dir).rpartition(f"--- start {self.generation} ---")[2])

    def tail(self, rank: int, n: int = TAIL_LINES) -> str:
        lines = []
        for stream in ("stdout", "stderr"):
            p = self.rank_log(rank, stream)
            if p is not None and p.exists():
                lines += [f"{stream}: {l}" for l in p.read_text(errors="replace").splitlines()
                          if "torch.distributed.pipelining" not in l]
        return "\n".join(lines[-n:]) or "(empty)"

    def launcher_tail(self, n: int = TAIL_LINES) -> str:
        return "\n".join(launcher_text(self.run_dir).splitlines()[-n:]) or "(empty)"

    def faulthandler_stack(self, rank: int, wait: float = 0.5) -> str:
        """The fallback when a rank's reader thread cannot answer: faulthandler writes every thread's
        stack to the rank's stderr.log on SIGUSR1 (registered by the rank at start)."""
        p = self.rank_log(rank)
        if p is None or not p.exists() or not self.pid(rank):
            return "(no stack: the rank's log is missing)"
        size = p.stat().st_size
        self.signal([rank], signal.SIGUSR1)
        time.sleep(wait)
        with open(p, "rb") as f:
            f.seek(size)
            text = f.read().decode(errors="replace").strip()
        if not text:
            return "(no stack: the rank did not answer SIGUSR1 either)"
        # Keep the thread that runs the cell, from the innermost frame down to the cell's own frames.
        blocks = [b.strip("\n") for b in re.split(r"\n\s*\n", text)]
        block = next((b for b in blocks if '"<cell ' in b), blocks[-1])
        lines = block.splitlines()
        cells = [i for i, l in enumerate(lines) if '"<cell ' in l]
        if cells:
            lines = lines[:cells[-1] + 1]
        return "(from faulthandler: the rank could not answer, e.g. C code holding the GIL)\n" + "\n".join(lines)

    def unjoined_stacks(self, n: int = TAIL_LINES) -> str:
        """Where each rank that never joined was when the job was ended with its stacks dumped (`stop(dump_stacks=
        True)`): the interrupted thread of its faulthandler dump (innermost frame first) and the innermost frame of
        each of its other threads, else the tail of its log."""
        out = []
        for r in (r for r in range(self.nproc) if r not in self.hello):
            p = self.rank_log(r)
            if p is None or not p.exists():
                out.append(f"rank {r}: not started (torchrun's agent had not started it: see launcher.log)")
                continue
            text = p.read_text(errors="replace")
            i = text.rfind("Fatal Python error")
            where = current_thread(text[i:]) if i >= 0 else self.tail(r, n)
            others = other_threads(text[i:]) if i >= 0 else []
            out.append(f"rank {r}:\n" + "\n".join((where.strip().splitlines()[:n] or ["(no log)"]) + others))
        return "\n".join(out) or "(every rank joined)"

    # ---- ending

    def stop(self, grace: float = 3.0, dump_stacks: bool = False) -> None:
        """Ask every rank to exit, then make sure the agent and every rank are gone (dump_stacks: each rank's
        stacks written to its stderr.log first, `stop_job`'s)."""
        import psutil

        self.closing = True
        for r in list(self.conns):
            self.send(r, {"t": "exit"})
        known = {}
        for r in range(self.nproc):
            try:
                if self.pid(r):
                    known[self.pid(r)] = psutil.Process(self.pid(r))
            except psutil.Error:
                pass
        if self.proc is not None:
            for c in descendants(self.proc.pid):
                known.setdefault(c.pid, c)
            if len(self.conns) == self.nproc:  # every rank was told to exit: torchrun ends by itself
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
            # ends the agent, then every rank it knew of
            stop_job(self.proc, known, grace=grace, dump_stacks=dump_stacks)
        else:
            kill_all(list(known.values()), grace)
        for conn in list(self.conns.values()):
            channel.shutdown(conn)
        if self.listener is not None:
            self.listener.close()
