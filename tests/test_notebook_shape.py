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
