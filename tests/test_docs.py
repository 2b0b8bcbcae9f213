"""README.md stays a five-minute read and docs/ holds the rest: README.md is at most MAX_README_LINES
lines and links every docs/*.md page; every relative link of README.md and docs/*.md reaches a file (and
a heading, where it names an #anchor); each docs page opens with its title and one line saying what it
covers; and the facts of the long README that docs/ was cut from are still somewhere (KEY_PHRASES).

Plain text only: no torch, no labkit, no process."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

MAX_README_LINES = 150

# The two commands, exactly as README's "Two commands" gives them (CI and the tests' docstrings cite them).
TWO_COMMANDS = (
    "python3 scripts/dev.py lab     # set up .venv from the lock and start JupyterLab on notebooks/",
    "python3 scripts/dev.py test    # set up .venv the same way, run the whole test suite, then again on torch 2.11",
)

# A few distinctive phrases of each section of the README before it was cut into docs/: each must
# still be said in README.md or a docs page (moving a section is fine; losing it is not).
KEY_PHRASES = (
    "Runs on a 2-core laptop (CPU ranks, gloo)",  # what PP Lab is
    "`09b_bug_or_float_noise`",  # the notebooks
    "Start with `00_welcome.ipynb`.",  # two commands
    "`PPLAB_VENV`, `PPLAB_OTHER_VENV`",  # disk
    "`PPLAB_TEST_WORKERS`",  # tests: workers
    "`labkit.alone`",  # tests: serial notebooks
    "--under-load",  # tests under load
    "dev.py test --quick",  # the inner loop
    "`scripts/torch_count`",  # what the suite costs
    "**When pip caps torch.**",  # pip caps
    "python3 scripts/dev.py lock --upgrade",  # the lock files
    "**One environment for a workshop.**",
    "ssh -N -L 8890:127.0.0.1:8890",  # a lab on a remote node
    "PPLAB_TORCH=",  # which torch
    "conda env create -f environment.yml",  # conda
    "PYTHONPATH=. python3 scripts/gpu_check.py --out gpu-check",  # GPU nodes
    "python3 scripts/dev.py handouts",  # other commands
    "labkit doctor",  # the command line
    "labkit slurm --nodes 2",
    "**Ranks start warm.**",
    "`LABKIT_START_METHOD`",
    "`labkit.LaunchError`",
    "%ranks start --nproc 2",  # live ranks
    "**Bug or float noise?**",
    "Why not ipyparallel",
    "/proc/self/task/<tid>/schedstat",  # timelines
    "Run directories are never overwritten",  # run directory
    "## The lesson API",  # lesson API (tests/test_lesson_api.py reads its table)
    "`bubble_ratio`",  # glossary
    "config -> launching -> jobs / ranks -> spans / logs -> timeline -> plot",  # layout, layers
    "`scripts/tutorial_as_written.py`",
    "pytorch/pytorch#184361",  # known limits
    "Dropout is 0 in the kit's model",
)

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def prose(text: str) -> str:
    """`text` without fenced code blocks and inline code: links and headings are read from what is left."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file (a repeated one gets -1, -2... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        s = slug(heading)
        found.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return found


def relative_links(path: Path) -> list[str]:
    """The targets of the relative links of a Markdown file (web and mail links left out)."""
    targets = _LINK.findall(prose(path.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: Path) -> list[str]:
    """`target (why)` for each relative link of `path` that reaches no file, or no heading of it."""
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    return broken


def all_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in PAGES)


def test_slug_is_githubs():
    assert slug("Live ranks: write the pipelining code in cells") == "live-ranks-write-the-pipelining-code-in-cells"
    assert slug("Names used everywhere (glossary)") == "names-used-everywhere-glossary"
    assert slug("The `labkit` command, step_by_step") == "the-labkit-command-step_by_step"


def test_broken_links_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "b.md").write_text("# Title\n\n## The lock files\n\n```bash\n# not a heading\n```\n")
    a = tmp_path / "a.md"
    a.write_text("[ok](b.md#the-lock-files) [web](https://example.com) `[code](nowhere.md)`\n"
                 "[gone](c.md) [bad](b.md#not-a-heading) [also bad](b.md#not-a-heading-1) [self](#top)\n\n# Top\n")
    assert broken_links(a) == ["c.md (no such file)", "b.md#not-a-heading (no heading #not-a-heading in b.md)",
                               "b.md#not-a-heading-1 (no heading #not-a-heading-1 in b.md)"]


def test_readme_is_a_five_minute_read():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, (f"README.md has {lines} lines, more than {MAX_README_LINES}: move the "
                                       "detail into a docs/ page and link it")


def test_readme_keeps_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert "\n## Two commands\n" in text
    for line in TWO_COMMANDS:
        assert line in text.splitlines(), f"README.md's 'Two commands' lost: {line}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: broken links: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    unlinked = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert PAGES[1:], "docs/ has no pages"
    assert not unlinked, "README.md does not link: " + ", ".join(unlinked)


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: str(p.relative_to(ROOT)))
def test_each_docs_page_opens_with_its_title_and_what_it_covers(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    assert len(lines) >= 3 and lines[0].startswith("# ") and not lines[1].strip(), (
        f"{page.relative_to(ROOT)}: open with '# Title', a blank line, then one line saying what it covers")
    assert lines[2].strip() and not lines[2].startswith(("#", "|", "-", "`")), (
        f"{page.relative_to(ROOT)}: the line after the title says what the page covers")


def test_no_fact_of_the_old_readme_is_lost():
    text = all_text()
    lost = [phrase for phrase in KEY_PHRASES if phrase not in text]
    assert not lost, "said nowhere in README.md or docs/*.md any more: " + "; ".join(lost)
