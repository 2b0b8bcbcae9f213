"""A pytest plugin (registered as `pytest11` in pyproject.toml, so pytest loads it wherever the kit is
installed): under nbval, a notebook cell marked `# NEEDS_TORCH 2.15` teaches what that torch release
added. Its saved output comes from such a torch; on an older one (the README's test command also
runs every notebook on torch 2.11) it is skipped, with the reason in the test report. Run by hand
there, the cell itself says what it needs instead of failing (`labkit.versions.has`).

A plugin rather than notebooks/conftest.py: the tests import helpers from tests/conftest.py as
`conftest`, and a second conftest module on the path would shadow it."""

from __future__ import annotations

import re

import pytest

NEEDS_TORCH = re.compile(r"^# NEEDS_TORCH (\d+)\.(\d+)\s*$", re.MULTILINE)


def pytest_collection_modifyitems(config, items):
    marked = [(item, hit) for item in items  # nbval's cell items carry the cell
              if (hit := NEEDS_TORCH.search(getattr(getattr(item, "cell", None), "source", "") or ""))]
    if not marked:
        return  # nothing to decide: torch is not even imported
    from labkit import versions

    have = versions.installed()
    for item, hit in marked:
        if have < (int(hit[1]), int(hit[2])):
            item.add_marker(pytest.mark.skip(
                reason=f"needs torch >= {hit[1]}.{hit[2]} (this is {versions.text(have)}): what that release added"))
