"""`dev.py test`'s count of the processes that import torch (ranks, torchrun agents, kernels, scripts).

dev.py puts this folder on the tests' PYTHONPATH and names a file in PPLAB_TORCH_IMPORTS; every
Python process started under the tests (the kit's launcher keeps this folder behind its own
`labkit/spans/boot`, whose sitecustomize runs this one after it) appends one line to that file when
it first imports torch: its role, its pid, the test that started it (PYTEST_CURRENT_TEST, inherited)
and its command. `scripts/dev.py` sums the lines per leg. A process started with a scrubbed
environment (no PYTHONPATH) is not counted. Standard library only; a finder that finds nothing.
"""

import importlib.abc
import os
import sys

_LOG = os.environ.get("PPLAB_TORCH_IMPORTS")


def command() -> list:
    """This process's command line as started (/proc/self/cmdline): while `python -m X` imports X's
    package, sys.argv is still ['-m', ...], without X."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return [sys.executable, *sys.argv]


def program(cmd: list) -> str:
    """The module (`-m X`), `-c`, or the script's file name a Python command line runs."""
    i = 1
    while i < len(cmd):
        a = cmd[i]
        if a == "-m" and i + 1 < len(cmd):
            return cmd[i + 1]
        if a.startswith("-m") and len(a) > 2:
            return a[2:]
        if a == "-c" or a.startswith("-c"):
            return "-c"
        if a in ("-W", "-X"):
            i += 2
            continue
        if not a.startswith("-"):
            return os.path.basename(a)
        i += 1
    return os.path.basename(cmd[0]) if cmd else "?"


def role(cmd: list, environ) -> str:
    """What kind of process this is: rank, agent (torchrun's), kernel, pytest or script."""
    prog = program(cmd)
    if environ.get("TORCHELASTIC_RUN_ID") or ("LOCAL_RANK" in environ and "RANK" in environ):
        return "rank"
    if prog in ("torch.distributed.run", "torchrun", "labkit.launching.warm"):  # the last forks its ranks warm
        return "agent"
    if prog.startswith("ipykernel"):
        return "kernel"
    if prog in ("pytest", "py.test", "__main__.py") and "pytest" in " ".join(cmd[:3]) or \
            (prog == "-c" and ("xdist" in " ".join(cmd) or "execnet" in " ".join(cmd))):
        return "pytest"
    return "script"


class _Count(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not self.done:
            self.done = True  # not removed from sys.meta_path: that would skip the next finder
            try:
                test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
                cmd = command()
                line = " ".join(cmd)[:300].replace("\t", " ").replace("\n", " ")
                with open(_LOG, "a") as f:
                    f.write(f"{role(cmd, os.environ)}\t{os.getpid()}\t{test}\t{line}\n")
            except Exception:  # never break a process over the count
                pass
        return None


if _LOG:
    sys.meta_path.insert(0, _Count())

# chain to the sitecustomize this one shadows (a distribution's, a venv's), as labkit/spans/boot does
_here = os.path.dirname(os.path.abspath(__file__))
try:
    import importlib.machinery
    import importlib.util

    _mine = [i for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == _here]
    _after = sys.path[_mine[0] + 1:] if _mine else []  # only what comes after: never a sitecustomize before this one
    _spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _after)
    if _spec is not None and _spec.loader is not None:
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
except Exception:
    pass
