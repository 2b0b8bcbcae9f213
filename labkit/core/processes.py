"""What both sides need of processes: the marks a launch leaves in every process's environment
(`LABKIT_RUN_DIR`, `LABKIT_OWNER`), who owns a process, and Linux's parent-death signal. The
launcher (`labkit.launching`) and the code inside a rank (`labkit.worker.distributed`) both use it; it imports
nothing else of the kit."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import psutil

RUN_DIR_VAR = "LABKIT_RUN_DIR"


OWNER_VAR = "LABKIT_OWNER"

INHERITED_FDS: frozenset[int] = frozenset()
"""In a rank started warm (labkit.launching.warm: forked from the agent), the file descriptors it was
born with: the agent's own sockets among them, which the rank must never shut down (a shutdown ends a
connection for every process that shares it; labkit.ranks.rank.release_connections)."""


def open_fds() -> frozenset[int]:
    try:
        return frozenset(int(fd) for fd in os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return frozenset()


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (even by SIGKILL): no orphans.
    Called on both sides: by the launcher for torchrun's agent, and inside every rank
    (`labkit.worker.distributed.init_distributed`)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def owner_token(pid: int | None = None) -> str:
    p = psutil.Process(pid or os.getpid())
    return f"{p.pid}:{p.create_time():.3f}"


def owner_alive(token: str) -> bool:
    try:
        pid, started = token.split(":")
        p = psutil.Process(int(pid))
        return abs(p.create_time() - float(started)) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except (ValueError, psutil.Error):
        return False
