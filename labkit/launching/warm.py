"""Ranks started warm: torchrun's own launcher, from a process that has already imported torch.

`python -m labkit.launching.warm <torchrun's arguments>` is torchrun with one difference: before its
elastic agent starts the ranks, this process imports torch and `torch.distributed.pipelining` (and
the kit's job module), and the agent starts each rank as a FORK of it (start method "fork", a
function entrypoint: `torch.distributed.launcher.api.elastic_launch`), so no rank imports torch
again. Everything else is torchrun's: its argument parser and `config_from_args`, the rendezvous (the
kit's loopback backend; static for multi-node), restarts, the log directory and redirects, error
files, exit codes. Each rank then runs the kit's job module or the user's script as `__main__`
(runpy), with sys.argv as torchrun would give it; what a fresh process would do at its start is done
in the rank: the signal handlers are Python's defaults again (not the agent's), the spans recorder
opens its own rank's file, exit handlers registered before the fork are dropped and the rank's own
run at its end. CUDA is never initialised here (importing torch does
not): each rank sets up its own device. `command.txt` ends with the plain torchrun command (the
same script and arguments, for a learner to copy), after comment lines that say what differs: this
launcher and the environment the kit added (labkit.launching.command.command_text).

`LABKIT_START_METHOD`: "fork" (the default), "forkserver" (a server process that preloads the same
modules) or "spawn" (what torchrun does with a function: every rank imports torch again). Measured
side by side in bench/RESULTS.md ("labkit/launching/warm.py").

May import: labkit.core, labkit.spans (record). Runs in the agent and, forked, in every rank."""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import sys

START_VAR = "LABKIT_START_METHOD"
START_METHODS = ("fork", "forkserver", "spawn")
PRELOAD = ("torch", "torch.distributed.pipelining")


def warm_command(torchrun_argv: list[str]) -> list[str]:
    """The argv that starts `torchrun_argv` (`python -m torch.distributed.run ...`) warm."""
    i = torchrun_argv.index("torch.distributed.run")
    return [*torchrun_argv[:i], __name__, *torchrun_argv[i + 1:]]


def start_method() -> str:
    method = os.environ.get(START_VAR, "fork")
    if method not in START_METHODS:
        raise SystemExit(f"{START_VAR}={method!r}: use one of {', '.join(START_METHODS)}")
    return method


def rank_main(module: bool, entry: str, args: list[str]) -> None:
    """One rank (the agent's function entrypoint): `entry` run as `__main__` with `args`, as
    `python [-m] entry args...` would run it in a fresh process."""
    from ..core import processes

    processes.INHERITED_FDS = processes.open_fds()  # the agent's sockets among them: never this rank's to end
    atexit._clear()  # the agent's handlers are not this rank's
    _fresh_signals()
    _own_spans()
    sys.argv = [entry, *args]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(entry)))
    try:
        if module:
            runpy.run_module(entry, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(entry, run_name="__main__")
    except SystemExit as e:  # a clean exit returns (the agent waits for a return value); any other code stays
        if e.code not in (None, 0):
            raise
    except BaseException as e:
        _print_traceback(e)
        raise
    finally:
        atexit._run_exitfuncs()


def _print_traceback(e: BaseException) -> None:
    """The traceback into the rank's own stderr, as Python prints it for a script (from the script's
    frame): the agent's redirect of stderr ends before multiprocessing would print it."""
    import traceback

    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>", runpy.__file__):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)
    sys.stderr.flush()


def _fresh_signals() -> None:
    """The signal handlers a fresh Python process starts with: the agent's (torch's elastic agent turns
    SIGTERM, SIGINT, SIGHUP and SIGQUIT into an exception) would keep a rank alive through the
    SIGTERM that is meant to end it."""
    import signal

    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _own_spans() -> None:
    """The spans recorder the agent installed (it imported the pipelining) recorded as rank 0 into
    the agent's file: this rank opens its own (labkit.spans.record)."""
    record = sys.modules.get("labkit.spans.record")
    if record is not None and record.RECORDER is not None:
        record.RECORDER = None
        record.install()


def _preload(module: bool, entry: str) -> None:
    """torch, its pipelining and, for the kit's own job module, what that module imports (the module
    itself is forgotten again: runpy runs it afresh as `__main__`, and warns about one imported)."""
    for name in PRELOAD:
        importlib.import_module(name)
    if module and entry.startswith("labkit."):
        importlib.import_module(entry)
        del sys.modules[entry]


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_launch)(argv)


def _launch(argv: list[str] | None) -> None:
    import torch.multiprocessing as mp
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from ..versions import clean_exit_is_done

    clean_exit_is_done()  # a rank may end by os._exit(0), as the kit's jobs do
    args = parse_args(argv)
    config, _, _ = config_from_args(args)
    config.start_method = start_method()
    if config.start_method == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    if config.start_method != "spawn":
        _preload(args.module, args.training_script)
    elastic_launch(config, rank_main)(args.module, args.training_script, list(args.training_script_args))


if __name__ == "__main__":
    main()
