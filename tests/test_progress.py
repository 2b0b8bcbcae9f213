"""The kit's progress bar, drawn by tqdm.auto: the same text on a terminal as the kit's own bar drew
(`<title> [####----] 2/3 running 1.2s`), tqdm's widget in Jupyter with the kit's colours and the one-line text a saved
notebook or handout shows (`[progress bar: <title>]`), and the `on_update` callback."""

from __future__ import annotations

import io
import re
import sys

import pytest

from labkit.core import progress
from labkit.core.progress import Progress

ELAPSED = re.compile(r" +\d+\.\ds$")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def drawn(buf: io.StringIO) -> list[str]:
    """The successive states of the terminal's line (each draw starts with a carriage return)."""
    return [part.rstrip(" \n") for part in buf.getvalue().split("\r") if part.strip()]


def without_time(text: str) -> str:
    return ELAPSED.sub("", text)


def test_the_bar_is_tqdm_autos():
    from tqdm.auto import tqdm

    assert issubclass(progress.bar_class(), tqdm)


def test_terminal_text_is_the_kits_layout(monkeypatch):
    buf = Terminal()
    monkeypatch.setattr(sys, "stderr", buf)
    seen = []
    with Progress("GPipe x2", total=3, on_update=lambda d, t: seen.append((d, t))) as p:
        p.update(1, force=True)
        p.update(2, force=True)
    lines = drawn(buf)
    assert [without_time(x) for x in lines[-3:]] == [
        "GPipe x2 [################--------] 2/3 running", "GPipe x2 [################--------] 2/3 done",
        "GPipe x2 [################--------] 2/3 done"]
    assert ELAPSED.search(lines[-1])   # the seconds, as `  1.2s`
    assert "GPipe x2 [########----------------] 1/3 running" in map(without_time, lines)
    assert buf.getvalue().endswith("\n") and seen == [(1, 3), (2, 3)]


def test_a_launch_learns_its_total_and_ends_failed(monkeypatch):
    buf = Terminal()
    monkeypatch.setattr(sys, "stderr", buf)
    p = Progress("launch")
    p.update(force=True)
    assert without_time(drawn(buf)[-1]) == "launch running"
    p.update(1, 4, force=True)
    assert without_time(drawn(buf)[-1]) == "launch [######------------------] 1/4 running"
    p.close("failed")
    assert without_time(drawn(buf)[-1]) == "launch [######------------------] 1/4 failed"
    p.close("failed")   # closing twice draws nothing more
    assert buf.getvalue().count("\n") == 1


def test_nothing_is_drawn_without_a_terminal_or_when_disabled(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    with Progress("quiet", total=2) as p:
        p.update(2, force=True)
    seen = []
    with Progress("off", total=2, enabled=False, on_update=lambda d, t: seen.append((d, t))) as p:
        p.update(1, force=True)
    assert buf.getvalue() == "" and p.bar is None and seen == [(1, 2)]


def test_in_jupyter_it_is_tqdms_widget_with_the_kits_text_and_colours(monkeypatch, capsys):
    pytest.importorskip("ipywidgets")
    import tqdm.notebook

    monkeypatch.setattr(progress, "bar_class", lambda: progress.kit_bar(tqdm.notebook.tqdm))
    p = Progress("sweep x3", total=3)
    shown = capsys.readouterr().out   # outside a kernel IPython's display() prints the text form
    box = p.bar.container
    left, bar, right = box.children
    assert isinstance(box, tqdm.notebook.TqdmHBox) and repr(box) == "[progress bar: sweep x3]"
    assert shown.strip() == "[progress bar: sweep x3]"
    assert (bar.bar_style, bar.max, bar.value) == ("info", 3, 0)
    p.update(2, force=True)
    text = (left.value + right.value).replace("\u2007", " ")
    assert bar.value == 2 and without_time(text.strip()) == "sweep x3  2/3 running"
    p.close("done")
    assert bar.bar_style == "success" and "2/3 done" in right.value.replace("\u2007", " ")
    q = Progress("launch")
    qbar = q.bar.container.children[1]
    q.update(1, 4, force=True)
    assert (qbar.max, qbar.value) == (4, 1)
    q.close("timeout")
    assert qbar.bar_style == "danger" and repr(q.bar or qbar) and capsys.readouterr().out.strip() == "[progress bar: launch]"


@pytest.mark.launches
def test_a_kernel_saves_the_bar_as_one_short_line(tmp_path):
    """In a real kernel, tqdm.auto picks its widget; what a saved notebook (and a handout) keeps as
    text is `[progress bar: <title>]`, beside the widget's view."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from labkit.core.progress import Progress, bar_class\n"
        "print(any(c.__module__ == 'tqdm.notebook' for c in bar_class().__mro__))\n"
        "with Progress('GPipe x2', total=2) as p:\n    p.update(2)")]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    assert outputs[0]["text"].strip() == "True", outputs   # tqdm.auto chose the widget
    views = [o for o in outputs if o.get("output_type") == "display_data"]
    assert len(views) == 1 and views[0]["data"]["text/plain"] == "[progress bar: GPipe x2]", outputs
    assert "application/vnd.jupyter.widget-view+json" in views[0]["data"]
