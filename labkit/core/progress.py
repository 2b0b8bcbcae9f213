"""Progress display for launches and sweeps, drawn by `tqdm.auto`: its widget in Jupyter, its text bar
on a terminal (none when stderr is not a terminal).

The kit's bar reads the same on both: `<title> [####------] <done>/<total> <status> <seconds>s` (no bar
and no counts while the total is unknown), ends as `done`/`ok` (green in Jupyter) or how it failed
(red), and a saved notebook or handout shows it as `[progress bar: <title>]`. `ProgressState` is the
bookkeeping; `Progress` hands it to tqdm to draw.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache

WIDTH = 24            # characters of the text bar
ASCII = "-#"          # tqdm's charset: empty, full (whole characters only)
WITH_TOTAL = "{desc} [{bar:%d}] {done}/{total} {status} {elapsed_s:5.1f}s" % WIDTH
WIDGET_WITH_TOTAL = "{desc} {bar} {done}/{total} {status} {elapsed_s:5.1f}s"   # the widget draws the bar
NO_TOTAL = "{desc} {status} {elapsed_s:5.1f}s"
STYLES = {"done": "success", "ok": "success", "running": "info"}   # any other end state: "danger"


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


def bar_class():
    """tqdm.auto's class (the notebook widget in a kernel with ipywidgets, else the terminal bar),
    drawing a `ProgressState`; None without tqdm (no bar is drawn)."""
    try:
        from tqdm.auto import tqdm as auto
    except ImportError:
        return None
    return kit_bar(auto)


@lru_cache(maxsize=None)
def kit_bar(base):
    """tqdm's class `base` (tqdm.notebook's or tqdm.std's) drawing a `ProgressState` in the kit's layout."""
    widget = any(c.__module__ == "tqdm.notebook" for c in base.__mro__)   # tqdm.auto's class in Jupyter too

    class KitBar(base):
        monitor_interval = 0   # no tqdm monitor thread: the kit redraws from its own loops

        def __init__(self, state: ProgressState):
            self.state = state
            super().__init__(total=state.total, desc=state.title, ascii=ASCII, leave=True, mininterval=0,
                             file=sys.stderr, disable=False if widget else None, bar_format=self.layout())

        def layout(self) -> str:
            return (WIDGET_WITH_TOTAL if widget else WITH_TOTAL) if self.state.total else NO_TOTAL

        @property
        def format_dict(self):
            d = super().format_dict
            d.update(done=self.state.done, status=self.state.status, bar_format=self.layout())
            d["elapsed"] = time.monotonic() - self.state.started   # the kit's clock: started with its state
            return d

        @staticmethod
        def status_printer(*args, **kw):
            box = super(KitBar, KitBar).status_printer(*args, **kw)
            if not widget:
                return box
            kit = _kit_box()(children=box.children, layout=box.layout)
            box.close()   # tqdm's own box is never shown
            return kit

        def show(self) -> None:
            """Draw the state now: its counts, total, and (in Jupyter) the bar's colour."""
            total = self.state.total
            if total != self.total:
                self.total = total
                if widget:
                    pbar = self.container.children[1]
                    pbar.max, pbar.layout.width = total or 1, None
            self.n = min(self.state.done, total) if total else self.state.done
            if widget:
                self.container.children[1].bar_style = STYLES.get(self.state.status, "danger")
            self.refresh()

    return KitBar


@lru_cache(maxsize=1)
def _kit_box():
    """tqdm's widget box whose text form is one short line (what a saved notebook or handout shows)."""
    from tqdm.notebook import TqdmHBox

    class ProgressBox(TqdmHBox):
        def __repr__(self, pretty=False) -> str:
            pbar = getattr(self, "pbar", None)
            return f"[progress bar: {pbar.state.title if pbar is not None else ''}]"

    return ProgressBox


class Progress:
    """`with Progress("GPipe x2", total=3) as p: p.update(1)`; draws nothing when `enabled=False`."""

    def __init__(self, title: str, total: int | None = None, enabled: bool = True, on_update=None):
        self.state = ProgressState(title, total)
        self.enabled = enabled
        self.on_update = on_update  # on_update(done, total): e.g. a widget's own progress bar
        self._last_draw = 0.0
        cls = bar_class() if enabled else None
        self.bar = cls(self.state) if cls is not None else None
        if self.bar is not None:
            self.bar.show()

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
        if self.bar is None:
            return
        self.bar.show()
        style = STYLES.get(status, "danger")
        self.bar.close()   # the terminal's line ends; tqdm colours an unfinished widget bar red
        if hasattr(self.bar, "container"):
            self.bar.container.children[1].bar_style = style
        self.bar = None

    def _draw(self, force: bool) -> None:
        now = time.monotonic()
        if self.bar is None or (not force and now - self._last_draw < 0.25):
            return
        self._last_draw = now
        self.bar.show()
