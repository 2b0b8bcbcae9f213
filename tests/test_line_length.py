"""Lines of labkit/ fit in MAX_LINE characters: a reader sees a whole line beside another file.

Wrap by hand where one is longer (a string split in two, a call's arguments on two lines), keeping the
code's meaning; no formatter rewrites whole files here."""

from pathlib import Path

import labkit

PKG = Path(labkit.__file__).parent

MAX_LINE = 120


def long_lines(root: Path = PKG, limit: int = MAX_LINE) -> list[str]:
    """`path:line (N characters)` of every line of a .py file under `root` longer than `limit`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > limit:
                found.append(f"{path.relative_to(root.parent)}:{number} ({len(line)} characters)")
    return found


def test_long_lines_finds_a_long_line(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n" + "y = '" + "a" * 120 + "'\n")
    assert long_lines(tmp_path / "pkg") == ["pkg/m.py:2 (126 characters)"]


def test_no_line_in_labkit_is_longer_than_max_line():
    found = long_lines()
    assert not found, (f"{len(found)} lines of labkit/ are longer than {MAX_LINE} characters; wrap them by hand:\n"
                       + "\n".join(found))
