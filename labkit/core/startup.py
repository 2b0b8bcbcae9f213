"""A process's start-up: torch's heavy imports run with Python's cyclic collector paused.

Importing torch, then its pipelining (dynamo, sympy and DTensor come with it), creates about 500,000
long-lived objects, and the collector, running while they are created, walks them again and again
(the CPU this saves: bench/RESULTS.md, the start-up rows and "labkit/core/startup.py").

`pause_heavy_imports()` wraps the loaders of `HEAVY` so that each runs with the collector paused; when
one ends, what it made is frozen (`gc.freeze`: kept for the process's life, never walked again, which
is how long these modules live anyway) and the collector resumes for the script's own work. The
price: the few cycles of garbage those imports leave are kept too. Every process the launcher starts
calls it (the ranks' sitecustomize, `labkit.spans.boot`: torchrun's agent and every rank, a user's
own script too), and so does `import labkit` before torch (a notebook's kernel, the `labkit`
command). `LABKIT_GC_PAUSE=0` turns it off. Standard library only: it runs before anything is
imported. Paired figures: `scripts/bench.py --only startup`.

May import: nothing of labkit."""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import importlib.util
import os
import sys

HEAVY = ("torch", "torch.distributed.pipelining")
OFF_VAR = "LABKIT_GC_PAUSE"


class PausedImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of each module in `HEAVY` so that it runs with the
    collector paused, and freezes what it made."""

    def __init__(self):
        self.busy: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if name not in HEAVY or name in self.busy:
            return None
        self.busy.add(name)  # the real finders, not this one again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            was_on = gc.isenabled()
            gc.disable()
            try:
                real_exec(module)
            finally:
                if was_on:  # a collector the script turned off stays off
                    gc.freeze()
                    gc.enable()

        spec.loader.exec_module = exec_module
        return spec


def _unfreeze_if_nanobind() -> None:
    """At exit (registered before anything else, so it runs last): triton's nanobind bindings (torch's
    compiler imports triton on CUDA builds) report every object still alive at exit as a leak, on
    stderr; frozen objects are never freed, so they go back to the collector before the teardown."""
    if "triton" in sys.modules:
        gc.unfreeze()


def pause_heavy_imports() -> bool:
    """Install the paused imports in this process, once; False where they are off or too late
    (`LABKIT_GC_PAUSE=0`, or torch already imported)."""
    if os.environ.get(OFF_VAR, "1") == "0" or "torch" in sys.modules:
        return False
    if any(isinstance(f, PausedImport) for f in sys.meta_path):
        return True
    atexit.register(_unfreeze_if_nanobind)
    sys.meta_path.insert(0, PausedImport())
    return True
