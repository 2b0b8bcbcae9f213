"""Spans in every rank the kit starts, a user's own script included, with no change to it.

`labkit.launching.command.job_env` puts this folder first on the ranks' PYTHONPATH and sets
LABKIT_SPANS_DIR; Python runs this file at start-up (the `site` module's sitecustomize hook).
Nothing is imported here beyond the standard library: when the process imports torch's pipelining
schedules, `labkit.spans.record.install()` runs right after them (a post-import hook), so processes
that never pipeline (torchrun's agent) pay nothing. Any other sitecustomize on the path still runs.
It also pauses Python's cyclic collector during torch's heavy imports (`labkit.core.startup`), which
saves about a second of CPU in the agent and in every rank.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGET = "torch.distributed.pipelining.schedules"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of `_TARGET` so that the kit's recorder is
    installed right after that module runs."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            try:
                from labkit.spans.record import install

                install()
            except Exception as e:  # never break the user's script over the kit's instrument
                print(f"[labkit] spans not recorded in this rank: {type(e).__name__}: {e}", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


def _chain() -> None:
    """Run the sitecustomize this one shadows, if any (a distribution's, a venv's)."""
    others = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


try:
    from labkit.core.startup import pause_heavy_imports

    pause_heavy_imports()
except Exception as e:  # never break the user's script over the kit's start-up
    print(f"[labkit] start-up: imports not paused: {type(e).__name__}: {e}", file=sys.stderr)
if os.environ.get("LABKIT_SPANS_DIR") and os.environ.get("LABKIT_SPANS", "1") != "0":
    if "torch.distributed.pipelining.schedules" in sys.modules:  # pragma: no cover (site runs first)
        from labkit.spans.record import install

        install()
    else:
        sys.meta_path.insert(0, _AfterImport())
_chain()
