"""Finding and ending processes the kit left behind (`labkit clean`, and a sweep before each launch).

Every process a launch starts carries `LABKIT_RUN_DIR` (its run directory) and `LABKIT_OWNER`
("<pid>:<start time>" of the process that called launch, e.g. a Jupyter kernel) in its
environment. A kit process is an *orphan* when its owner is gone (a kernel killed hard) and it
is still running: the next launch ends orphans, and `labkit clean` does too (`--all` also ends
jobs whose owner is alive). Nothing without those variables is ever touched.
"""

from __future__ import annotations
import os
from dataclasses import dataclass
import psutil
from ..core.processes import OWNER_VAR, RUN_DIR_VAR, owner_alive


@dataclass
class KitProcess:
    pid: int
    name: str
    run_dir: str
    owner: str
    orphan: bool


def kit_processes() -> list[KitProcess]:
    """Every live process started by a kit launch on this machine (readable by this user)."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "name"]):
        if p.pid == me:
            continue
        try:
            env = p.environ()
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.Error, OSError):
            continue
        run_dir = env.get(RUN_DIR_VAR)
        if not run_dir:
            continue
        owner = env.get(OWNER_VAR, "")
        # No owner recorded: we cannot know, so it is never treated as an orphan (only --all ends it).
        orphan = bool(owner) and not owner_alive(owner)
        found.append(KitProcess(p.pid, p.info["name"] or "?", run_dir, owner, orphan=orphan))
    return found


def clean(all_jobs: bool = False, grace: float = 3.0) -> list[KitProcess]:
    """End orphaned kit processes (all kit processes with `all_jobs`); return what was ended."""
    targets = [k for k in kit_processes() if all_jobs or k.orphan]
    procs = []
    for k in targets:
        try:
            p = psutil.Process(k.pid)
            p.terminate()
            procs.append(p)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace)
    kill_all(alive, grace)
    return targets


def kill_all(procs: list, grace: float = 3.0) -> None:
    """SIGKILL each process that is still there, and reap what we can."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=grace)


def describe(ended: list[KitProcess]) -> str:
    if not ended:
        return "nothing of the kit's was left running"
    lines = [f"ended {len(ended)} process(es):"]
    lines += [f"  pid {k.pid} {k.name} ({'orphan' if k.orphan else 'running job'}) run {k.run_dir}" for k in ended]
    return "\n".join(lines)
