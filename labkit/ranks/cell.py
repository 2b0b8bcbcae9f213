"""One cell in flight on a live pool, seen from the kernel: which ranks are still busy, what came back.

Owns turning the ranks' messages into a cell's state: output chunks go to the cell's `CellOutput`,
"done" messages into results or failures (a failed rank's traceback), a hang-up into `dead`,
"stacks" answers into `stacks`, and the answers to a release (`released`, `regrouped`).
`Ranks.exec` (labkit.ranks.pool) decides what the state means.
Taught in notebook 01 (live ranks).
"""

from __future__ import annotations

import time

from . import channel
from .job import Job
from .output import CellOutput


class Cell:
    """One exec in flight: who is still busy, what came back."""

    def __init__(self, n: int, targets: list[int], job: Job, out: CellOutput):
        self.n, self.targets, self.job, self.out = n, targets, job, out
        self.busy = set(targets)
        self.results: dict = {}
        self.failures: dict[int, dict] = {}
        self.dead: list[int] = []  # in the order they hung up: the first is the likely cause
        self.stacks: dict[int, str] = {}
        self.note = ""
        self.last_done = time.monotonic()  # when a rank last finished the cell (or the cell began)
        self.released: dict[int, int] = {}  # rank: gloo connections it ended (Ranks._release)
        self.regrouped: dict[int, dict] = {}  # rank: its answer to "regroup"

    def handle(self, rank: int, msg) -> None:
        if msg is None:  # the rank hung up: its process ended
            if rank in self.targets and rank not in self.dead:
                self.dead.append(rank)
                self.busy.discard(rank)
            return
        kind = msg.get("t")
        if kind == "out" and msg.get("cell") == self.n:
            self.out.write(rank, msg["stream"], msg["text"])
        elif kind == "done" and msg.get("cell") == self.n:
            self.busy.discard(rank)
            self.last_done = time.monotonic()
            if msg["ok"]:
                self.results[rank] = channel.unwrap(msg.get("value"))
            else:
                self.failures[rank] = msg
        elif kind == "stacks" and msg.get("id") == self.n:
            self.stacks[rank] = msg.get("text", "")
        elif kind == "released" and msg.get("id") == self.n:
            self.released[rank] = msg.get("closed", 0)
        elif kind == "regrouped":
            self.regrouped[rank] = msg

    def pump(self, until: float, done) -> None:
        """Handle messages until `done()` or the monotonic time `until`."""
        while not done():
            left = until - time.monotonic()
            if left <= 0:
                return
            item = self.job.get(min(left, 0.1))
            if item is not None:
                self.handle(*item)
            self.out.tick()

    def failed(self) -> bool:
        return bool(self.failures or self.dead)
