"""Progress display for launches and sweeps: a widget bar in Jupyter, a text bar in a terminal.

Pure bookkeeping lives in `ProgressState` (tested without a notebook); `Progress` only draws it.
"""

from __future__ import annotations

import sys
import time
from functools import lru_cache
from dataclasses import dataclass, field


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widgets can render)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and ip.__class__.__name__ == "ZMQInteractiveShell"


@dataclass
class ProgressState:
    title: str
    total: int | None = None
    done: int = 0
    status: str = "running"
    started: float = field(default_factory=time.monotonic)

    def text(self) -> str:
        elapsed = time.monotonic() - self.started
        if self.total:
            width = 24
            filled = int(width * min(self.done, self.total) / self.total)
            bar = "#" * filled + "-" * (width - filled)
            return f"{self.title} [{bar}] {self.done}/{self.total} {self.status} {elapsed:5.1f}s"
        return f"{self.title} {self.status} {elapsed:5.1f}s"


@lru_cache(maxsize=1)
def _bar_box():
    """An HBox whose text form is one short line (what a saved notebook or handout shows without widgets)."""
    import ipywidgets as w

    class ProgressBox(w.HBox):
        def __repr__(self) -> str:
            return f"[progress bar: {getattr(self, 'title', '')}]"

    return ProgressBox


class Progress:
    """`with Progress("GPipe x2", total=3) as p: p.update(1)`; draws nothing when `enabled=False`."""

    def __init__(self, title: str, total: int | None = None, enabled: bool = True, on_update=None):
        self.state = ProgressState(title, total)
        self.enabled = enabled
        self.on_update = on_update  # on_update(done, total): e.g. a widget's own progress bar
        self._widget = None
        self._last_draw = 0.0
        self._tty = False
        if not enabled:
            return
        if in_notebook():
            try:
                import ipywidgets as w
                from IPython.display import display

                self._bar = w.IntProgress(value=0, min=0, max=total or 1, description="",
                                          bar_style="info", layout=w.Layout(width="40%"))
                self._label = w.Label(self.state.text())
                self._widget = _bar_box()([self._bar, self._label])
                self._widget.title = title
                display(self._widget)
            except ImportError:
                self._widget = None
        else:
            self._tty = sys.stderr.isatty()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *_):
        self.close("failed" if exc_type else "done")

    def update(self, done: int | None = None, total: int | None = None, force: bool = False) -> None:
        if total is not None:
            self.state.total = total
        if done is not None:
            self.state.done = done
        if self.on_update is not None:
            self.on_update(self.state.done, self.state.total)
        self._draw(force)

    def tick(self) -> None:
        """Refresh the elapsed time (called from polling loops, drawn at most ~4 times a second)."""
        self._draw(False)

    def close(self, status: str = "done") -> None:
        self.state.status = status
        self._draw(True)
        if self._tty and self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _draw(self, force: bool) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.25:
            return
        self._last_draw = now
        if self._widget is not None:
            self._bar.max = self.state.total or 1
            self._bar.value = min(self.state.done, self._bar.max)
            styles = {"done": "success", "ok": "success", "running": "info"}
            self._bar.bar_style = styles.get(self.state.status, "danger")
            self._label.value = self.state.text()
        elif self._tty:
            sys.stderr.write("\r" + self.state.text())
            sys.stderr.flush()
