"""Every notebook's shape (issue 42, item 5: lighter notebooks): it opens with its title and what you
will do and have at the end in at most 6 lines (then "Prerequisites" and a collapsed `<details>`
block may follow), and it has a Summary. Reads the notebooks' JSON only: no kernel, no process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
MAX_OPENING_LINES = 6

TITLE = re.compile(r"^# \S")
OPENING_ENDS = re.compile(r"^\s*(?:#+\s*)?(?:\*\*|__)?Prerequisites\b|^\s*<details\b", re.IGNORECASE)
SUMMARY = re.compile(r"^#{1,6}\s+(?:\d+\.\s*)?Summary\b", re.IGNORECASE | re.MULTILINE)


def _markdown(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def opening_lines(text: str) -> tuple[str, list[str]]:
    """The title of an opening cell and its non-empty lines after the title, up to "Prerequisites" or
    a `<details>` block."""
    lines = [line for line in text.splitlines() if line.strip()]
    title, rest = (lines[0], lines[1:]) if lines else ("", [])
    before = []
    for line in rest:
        if OPENING_ENDS.match(line):
            break
        before.append(line)
    return title, before


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_opening_says_what_you_will_do_in_six_lines(notebook):
    md = _markdown(notebook)
    assert md, f"{notebook.name}: no markdown cell"
    title, before = opening_lines(md[0])
    assert TITLE.match(title), f"{notebook.name}: the first markdown cell starts with {title!r}, not a '# ' title"
    assert 0 < len(before) <= MAX_OPENING_LINES, (
        f"{notebook.name}: the opening has {len(before)} lines before 'Prerequisites' or a <details> block "
        f"(at most {MAX_OPENING_LINES}: what you will do, what you will have at the end); move the rest into "
        f"a collapsed <details><summary>More context</summary> ... </details> block:\n  " + "\n  ".join(before))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_has_a_summary(notebook):
    assert any(SUMMARY.search(text) for text in _markdown(notebook)), (
        f"{notebook.name}: no markdown cell with a 'Summary' heading (e.g. '## Summary')")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_details_blocks_are_closed(notebook):
    for i, text in enumerate(_markdown(notebook)):
        opened, closed = len(re.findall(r"<details\b", text)), len(re.findall(r"</details>", text))
        assert opened == closed, f"{notebook.name}: markdown cell {i} opens {opened} <details> and closes {closed}"


def test_the_opening_check_stops_at_prerequisites_and_details():
    text = ("# 99 · Title\n\n**What you will do:** a\nb\n**What you will have at the end:** c\n\n"
            "**Prerequisites**: none\n\n<details><summary>More context</summary>\n\nx\ny\nz\nw\n\n</details>")
    assert opening_lines(text) == ("# 99 · Title", ["**What you will do:** a", "b", "**What you will have at the end:** c"])
    assert opening_lines("# T\n\na\n\n<details><summary>More</summary>\n\nb\n</details>")[1] == ["a"]
    assert len(opening_lines("# T\n" + "line\n" * 7 + "**Prerequisites**")[1]) == 7


# Issue 59, item 5: notebooks 06b, 11 and 14 read as questions answered. Each numbered section ("## N. ...")
# asks one question in its heading and answers it first ("**Answer:** ..."), in at most ANSWER_LINES lines
# of prose before its first code cell (fine print goes after the demonstration, or into a <details>
# block); each code cell's stored text is at most OUTPUT_LINES lines of at most OUTPUT_WIDTH characters
# (`labkit.notebook.wrapped` wraps the kit's long sentences).
ANSWERED = [p for p in NOTEBOOKS if p.stem.split("_")[0] in ("06b", "09c", "11", "14")]
ANSWER_LINES, OUTPUT_LINES, OUTPUT_WIDTH = 12, 20, 160
SECTION = re.compile(r"^## +\d+\. +(.*)$", re.MULTILINE)
DETAILS = re.compile(r"<details\b.*?</details>", re.DOTALL)


def sections(cells: list[dict]) -> list[tuple[str, str, list[dict]]]:
    """Each numbered section: its heading, the prose from the heading to its first code cell, its cells."""
    out = []
    for c in cells:
        text = "".join(c["source"])
        m = SECTION.search(text) if c["cell_type"] == "markdown" else None
        if m:
            out.append((m.group(1).strip(), text[m.end():], [c]))
        elif out:
            heading, prose, body = out[-1]
            if c["cell_type"] == "markdown" and all(b["cell_type"] == "markdown" for b in body):
                prose += "\n" + text
            out[-1] = (heading, prose, body + [c])
    return out


def stored_text(cell: dict) -> str:
    """A code cell's stored text: streams, and text/plain results that are not a figure's."""
    parts = []
    for o in cell.get("outputs", []):
        if "text" in o:
            parts.append("".join(o["text"]))
        elif "data" in o and "text/plain" in o["data"] and not any(k.startswith("image/") for k in o["data"]):
            parts.append("".join(o["data"]["text/plain"]))
    return "".join(parts)


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text(encoding="utf-8"))["cells"]


@pytest.mark.parametrize("notebook", ANSWERED, ids=[p.stem for p in ANSWERED])
def test_each_section_asks_one_question_and_answers_it_first(notebook):
    found = sections(_cells(notebook))
    assert len(found) >= 3, f"{notebook.name}: {len(found)} numbered sections ('## N. A question?')"
    for heading, prose, _ in found:
        assert heading.endswith("?") and heading.count("?") == 1, (
            f"{notebook.name}: section '{heading}' is not one question: its heading asks what the section answers")
        lines = [ln for ln in DETAILS.sub("", prose).splitlines() if ln.strip()]
        assert lines and lines[0].startswith("**Answer:**"), (
            f"{notebook.name}: section '{heading}' does not answer first: its first line after the heading "
            f"is {lines[:1]}, not '**Answer:** ...'")
        assert len(lines) <= ANSWER_LINES, (
            f"{notebook.name}: section '{heading}' has {len(lines)} lines of prose before its first code cell "
            f"(at most {ANSWER_LINES}: the answer, then the demonstration; move the fine print after it or into "
            "a <details> block)")


@pytest.mark.parametrize("notebook", ANSWERED, ids=[p.stem for p in ANSWERED])
def test_each_stored_output_is_short_enough_to_read(notebook):
    for i, cell in enumerate(_cells(notebook)):
        lines = stored_text(cell).splitlines() if cell["cell_type"] == "code" else []
        assert len(lines) <= OUTPUT_LINES, (
            f"{notebook.name}: cell {i} stored {len(lines)} lines of output (at most {OUTPUT_LINES}): print "
            "the figure the lesson needs, or a table of it")
        wide = [ln for ln in lines if len(ln) > OUTPUT_WIDTH]
        assert not wide, (f"{notebook.name}: cell {i} stored a line of {len(wide[0])} characters (at most "
                          f"{OUTPUT_WIDTH}): print it through labkit.notebook.wrapped")


def test_the_section_reader_finds_prose_and_outputs():
    md = lambda s: {"cell_type": "markdown", "source": [s]}
    code = {"cell_type": "code", "source": ["x"], "outputs": [
        {"name": "stdout", "text": ["a\n", "b\n"]}, {"data": {"image/png": "..", "text/plain": ["<Figure>"]}}]}
    found = sections([md("# T"), md("## 1. Why?\n\n**Answer:** so."), md("more"), code, md("after")])
    assert [(h, p.split()) for h, p, _ in found] == [("Why?", ["**Answer:**", "so.", "more"])]
    assert len(found[0][2]) == 4 and stored_text(code) == "a\nb\n"


# Issue 65, item 3: the dense notebooks made light. 06b, 09b and 14 have at most MAX_SECTIONS numbered
# sections and MAX_WORDS words of prose (markdown cells, fenced code left out); the fine print lives in the
# docs pages they link, and every notebook links the one glossary of the check's words (docs/glossary.md).
LIGHT = [p for p in NOTEBOOKS if p.stem.split("_")[0] in ("06b", "09b", "09c", "14")]
MAX_SECTIONS, MAX_WORDS = 9, 3000
FENCED = re.compile(r"```.*?```", re.DOTALL)


def prose_words(cells: list[dict]) -> int:
    return sum(len(FENCED.sub("", "".join(c["source"])).split()) for c in cells if c["cell_type"] == "markdown")


@pytest.mark.parametrize("notebook", LIGHT, ids=[p.stem for p in LIGHT])
def test_a_dense_notebook_stays_light(notebook):
    cells = _cells(notebook)
    n = len(SECTION.findall("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")))
    assert 3 <= n <= MAX_SECTIONS, f"{notebook.name}: {n} numbered sections (at most {MAX_SECTIONS})"
    words = prose_words(cells)
    assert words <= MAX_WORDS, (f"{notebook.name}: {words} words of prose (at most {MAX_WORDS}): move the fine print "
                                "to the docs page it links")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_notebook_links_the_glossary(notebook):
    text = "\n".join("".join(c["source"]) for c in _cells(notebook) if c["cell_type"] == "markdown")
    assert "docs/glossary.md" in text, f"{notebook.name}: no link to the glossary of the check's words (docs/glossary.md)"


def test_prose_words_leave_code_out():
    md = lambda s: {"cell_type": "markdown", "source": [s]}
    assert prose_words([md("one two\n```python\nx = 1 + 2\n```\nthree"), {"cell_type": "code", "source": ["a b"]}]) == 3
