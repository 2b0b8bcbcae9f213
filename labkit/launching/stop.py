"""Process control for launched jobs: parent-death signals, finding a job's ranks, ending them all.

torchrun starts every worker in its own session, so ending the agent alone can orphan the ranks:
`stop_job` ends the agent and every rank it started, `die_with_parent` (the agent) and
`set_parent_death_signal` (each rank) make them exit when whoever started them dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from .clean import kill_all
from ..core.processes import set_parent_death_signal


def die_with_parent() -> None:
    """preexec_fn for the torchrun agent: its own session (Jupyter's interrupt reaches it only through
    the kit), and SIGTERM if the launching process dies (a kernel killed hard)."""
    os.setsid()
    set_parent_death_signal(signal.SIGTERM)


def descendants(pid: int) -> list:
    """Every process below `pid` (psutil.Process objects). Linux: read from /proc/<pid>/task/<tid>/children,
    which costs a few reads per process of the job, where psutil's walk reads every process on the
    machine (the launcher asks while the ranks start: on 2 cores that competes with them)."""
    import psutil

    try:
        pids = _proc_children(pid)
    except OSError:  # no /proc children files (not Linux, or a kernel without them)
        try:
            return psutil.Process(pid).children(recursive=True)
        except Exception:
            return []
    out = []
    for p in pids:
        try:
            out.append(psutil.Process(p))
        except psutil.Error:
            pass
    return out


def _proc_children(pid: int) -> list[int]:
    """Descendants of `pid` from /proc (breadth first); OSError where the kernel does not list children."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:  # gone meanwhile
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except FileNotFoundError:
                if os.path.exists(f"/proc/{p}/task/{t}"):
                    raise OSError(f"/proc/{p}/task/{t}/children is not available") from None
                continue  # the thread or the process ended meanwhile
            found += kids
            todo += kids
    return found


def stop_job(proc: subprocess.Popen, known: dict, grace: float = 5.0, dump_stacks: bool = False) -> None:
    """End torchrun and every worker it started (workers live in their own sessions).

    dump_stacks: first each rank's stacks written (PYTHONFAULTHANDLER=1 writes all threads' stacks to its
    stderr.log on SIGABRT), all ranks frozen first (`dump_all`), so no rank's dump shows what a peer's death
    did to it and no rank is killed halfway through its dump (the agent is frozen too)."""
    import psutil

    workers = list({w.pid: w for w in list(known.values()) + descendants(proc.pid)}.values())
    if dump_stacks and proc.poll() is None:
        proc.send_signal(signal.SIGSTOP)
        dump_all(workers)
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


def dump_all(workers: list, settle: float = 1.0) -> None:
    """Every worker's stacks as they are now (SIGABRT: faulthandler dumps them, then the worker dies).

    Sent one after another, the first worker to die would close its connections and a later one, still
    blocked in a collective with it, could fail and unwind out of the user's code before its own SIGABRT
    landed (its dump then shows the kit's runner, not where it was stuck). So every worker is frozen first
    (SIGSTOP, up to `settle` s for all to read stopped), then each is sent SIGABRT aimed at its main thread
    (`_tgkill`: a process-wide signal pending in a frozen process goes to whichever of its threads wakes
    first, and faulthandler marks that one "Current thread"), then all are continued: each main thread takes
    its SIGABRT before it runs anything else. Where a signal cannot be aimed at a thread (no tgkill: not
    Linux), each worker is sent SIGABRT as it runs, one after another, as before."""
    import time

    import psutil

    tgkill = _tgkill()
    if tgkill is None:
        _each(workers, signal.SIGABRT)
        return
    _each(workers, signal.SIGSTOP)
    deadline = time.monotonic() + settle
    for w in workers:
        while time.monotonic() < deadline:
            try:
                if w.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    break
            except psutil.Error:
                break
            time.sleep(0.005)
    for w in workers:
        try:
            if w.is_running():  # not ended (its pid could be another process's by now)
                tgkill(w.pid, w.pid, signal.SIGABRT)  # the main thread's id is the process id
        except psutil.Error:
            pass
    _each(workers, signal.SIGCONT)


def _each(workers: list, sig: int) -> None:
    import psutil

    for w in workers:
        try:
            w.send_signal(sig)
        except psutil.Error:
            pass


_TGKILL_SYSCALL = {"x86_64": 234, "aarch64": 131}  # where glibc is older than 2.30 (no tgkill function)


def _tgkill():
    """Linux's tgkill(tgid, tid, sig) (a signal to one thread of a process, here its main thread), from the C
    library (glibc 2.30+) or as a raw system call (x86_64, aarch64); None where there is neither."""
    import ctypes
    import platform

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if hasattr(libc, "tgkill"):
        return libc.tgkill
    number = _TGKILL_SYSCALL.get(platform.machine())
    if number is None or not hasattr(libc, "syscall"):
        return None
    return lambda tgid, tid, sig: libc.syscall(number, tgid, tid, sig)
