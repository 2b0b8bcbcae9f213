"""A cell's output from every rank: live while it runs, in rank order once it ends.

Owns how rank output reaches the notebook. Lines are prefixed by rank (`[rank0] ...`) and go to
the kernel's stdout or stderr as they came on the rank.

In a Jupyter kernel the live lines go to a display that is blanked when the cell ends, and the
cell's output is then printed once more, grouped by rank in rank order, so a saved notebook (and
nbval, which compares it) sees the same text every run however the ranks interleaved. Why not
`clear_output()`: nbval 0.11 ignores clear_output messages (its handler is commented out in
nbval/plugin.py), so it would compare the live lines plus the grouped ones against the saved
grouped ones and fail. It records a display's first content and ignores later updates, so a
display that starts blank and ends blank compares equal. Outside Jupyter (a terminal, plain
Python, pytest) lines are printed live and nothing is repeated. Taught in notebook 01.
"""

from __future__ import annotations

import sys
import time

from ..core.progress import in_notebook

LIVE_MODES = ("auto", "print", "notebook", "none")  # "none": kept for `text()`, shown nowhere (scripts, benches)
LIVE_LINES = 200  # the live display shows the newest lines; the grouped print at the end has all
UPDATE_EVERY_S = 0.1


class _Blank:
    """What the live display holds when the cell is not running: nothing (text/plain "")."""

    def __init__(self, text: str = ""):
        self.text = text

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.text}


class CellOutput:
    """Collects `write(rank, stream, text)` chunks into prefixed lines; `finish()` ends the cell."""

    def __init__(self, live: str = "auto"):
        self.mode = ("notebook" if in_notebook() else "print") if live == "auto" else live
        self.lines: dict[tuple[int, str], list[str]] = {}
        self.partial: dict[tuple[int, str], str] = {}
        self.order: list[tuple[str, str]] = []  # (stream, prefixed line), as they arrived
        self._finished = False
        self._handle = None
        self._last = 0.0
        self._dirty = False

    def write(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        data = self.partial.pop(key, "") + text
        *done, rest = data.split("\n")
        if rest:
            self.partial[key] = rest
        for line in done:
            self._line(rank, stream, line)
        self._refresh()

    def _line(self, rank: int, stream: str, line: str) -> None:
        text = f"[rank{rank}] {line}"
        self.lines.setdefault((rank, stream), []).append(text)
        if self.mode == "print":
            print(text, file=sys.stdout if stream == "stdout" else sys.stderr, flush=True)
        elif self.mode == "notebook":
            self.order.append((stream, text))
            self._dirty = True
            if self._handle is None and not self._finished:  # made at the first line: silent cells show nothing
                from IPython.display import display

                self._handle = display(_Blank(), display_id=True)

    def _refresh(self, force: bool = False) -> None:
        if self._handle is None or not self._dirty:
            return
        now = time.monotonic()
        if force or now - self._last >= UPDATE_EVERY_S:
            self._handle.update(_Blank("\n".join(t for _, t in self.order[-LIVE_LINES:])))
            self._last, self._dirty = now, False

    def tick(self) -> None:
        """Show lines held back by the update throttle (called while the kernel waits)."""
        self._refresh()

    def text(self, stream: str = "stdout") -> str:
        """Everything the cell printed on `stream`, grouped by rank in rank order."""
        return "".join(l + "\n" for (r, s) in sorted(self.lines) if s == stream for l in self.lines[(r, s)])

    def finish(self) -> None:
        for (rank, stream), rest in sorted(self.partial.items()):
            self._line(rank, stream, rest)
        self.partial.clear()
        self._finished = True
        if self.mode != "notebook":
            return
        if self._handle is not None:
            self._handle.update(_Blank())
            self._handle = None
        for stream, target in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            text = self.text(stream)
            if text:
                target.write(text)
                target.flush()
