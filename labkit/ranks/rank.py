"""The rank side of a live pool: `python -m labkit.ranks.rank`, started by torchrun for `labkit.Ranks`.

Owns what one rank does between cells: join the process group, connect to the kernel's socket,
then run every cell it is sent in one namespace that lives as long as the rank (`rank`,
`world_size`, `device`, `dist`, `torch` are there from the start). The main thread runs cells; a
daemon thread reads the socket, answers "stacks" requests (where the main thread is, for a hung
cell) and ends the process the moment the kernel goes away (EOF), so a killed kernel leaves no
rank behind. While a cell runs, sys.stdout/sys.stderr send every chunk to the kernel and still
write to the rank's own log file, and a FileHandler writes torch's pipelining logs of that cell
to `cells/<NNN>/rank<r>.log` (there only: not to the rank's stderr.log too, one write a record; the
records made between cells stay in stderr.log). Taught in notebook 01 (live ranks).
"""

from __future__ import annotations

import ast
import faulthandler
import linecache
import logging
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

from . import channel

PP_LOGGER = "torch.distributed.pipelining"
# A line written at the top of a cell's log when the cell stepped a schedule built in an earlier
# cell: it names the schedule (torch logs "Using ..." only when a schedule is built) and marks
# where the cell began (the first action of a completion-logged schedule starts there).
MARKER_SOURCE = "labkit_ranks_cell_start:0]"


class _State:
    cell: int | None = None  # the cell whose output goes to the kernel now
    in_cell = False          # SIGINT raises KeyboardInterrupt only inside a cell
    main_sending = False     # ... and never in the middle of a frame the main thread is writing
    pending_interrupt = False
    schedule: str | None = None  # the last "Using <Schedule>" torch logged on this rank


STATE = _State()


def _on_sigint(signum, frame):
    # Installed explicitly: a process started in the background by a non-interactive shell inherits
    # SIGINT ignored (POSIX keeps it so; Python then installs no KeyboardInterrupt handler).
    if not STATE.in_cell:
        return
    if STATE.main_sending:
        STATE.pending_interrupt = True
        return
    raise KeyboardInterrupt


class Link:
    """The authenticated socket, shared by the main thread (output, results) and the reader (stacks)."""

    def __init__(self, sock):
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, msg) -> None:
        main = threading.current_thread() is threading.main_thread()
        with self.lock:
            if main:
                STATE.main_sending = True
            try:
                channel.send_msg(self.sock, msg)
            except OSError:
                os._exit(0)  # the kernel is gone: nothing left to do
            finally:
                if main:
                    STATE.main_sending = False
        if main and STATE.pending_interrupt and STATE.in_cell:
            STATE.pending_interrupt = False
            raise KeyboardInterrupt


class Tee:
    """sys.stdout / sys.stderr of a rank: every chunk to the rank's own stream (its log file) and,
    while a cell runs, to the kernel too. Installed once for the rank's life (after torch is imported,
    so torch's own log handler keeps the real stderr): a logging handler or thread that a cell
    made and that holds on to sys.stderr keeps reaching the cells that come after it."""

    def __init__(self, inner, name: str, link: Link):
        self.inner, self.name, self.link = inner, name, link

    def write(self, s) -> int:
        n = self.inner.write(s)
        cell = STATE.cell
        if s and cell is not None:
            self.link.send({"t": "out", "cell": cell, "stream": self.name, "text": str(s)})
        return n if n is not None else len(s)

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):  # encoding, fileno, buffer...: the real stream's
        return getattr(self.inner, name)


class _FormattedOnce(logging.Formatter):
    """A format whose text a record keeps: torch's handler (bound to the rank's stderr) and the cell's file
    write pipelining records with the same format (PP_LOG_FORMAT): a record both write is formatted once."""

    def format(self, record) -> str:
        got = record.__dict__.get("_labkit_text")
        if got is not None and got[0] == self._fmt:
            return got[1]
        text = super().format(record)
        record._labkit_text = (self._fmt, text)
        return text


class _NotInCell(logging.Filter):
    """On the rank's stderr handlers: a pipelining record made while a cell runs is the cell's log's alone
    (`run_cell` writes it there, flushed record by record), so it is written once, not twice, in every step
    of the cell (scripts/benches/observer.py: the live ranks' cost). Every other record passes."""

    def filter(self, record) -> bool:
        return STATE.cell is None or not record.name.startswith(PP_LOGGER)


class _ScheduleSeen(logging.Handler):
    """Remembers the schedule class torch announces ("Using ScheduleGPipe") when a schedule is built."""

    def emit(self, record) -> None:
        msg = record.getMessage()
        if msg.startswith("Using "):
            STATE.schedule = msg[6:].strip()


def main_stack() -> str:
    """Where the main thread is now, from the first frame of the cell (the runner's own frames left out)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "(no main thread)"
    lines = traceback.format_stack(frame)
    cell = [i for i, l in enumerate(lines) if '"<cell ' in l]
    if not cell:
        return "idle (not running a cell)\n" if not STATE.in_cell else "".join(lines)
    return "".join(lines[cell[0]:])


def _reader(link: Link, inbox: queue.Queue) -> None:
    while True:
        try:
            msg = channel.recv_msg(link.sock)
        except OSError:
            msg = None
        if msg is None or msg.get("t") == "exit":
            # EOF: the kernel died or closed the pool. Skip the interpreter's teardown: a rank
            # blocked in a collective could otherwise hang there.
            for s in (sys.__stdout__, sys.__stderr__):
                try:
                    s.flush()
                except Exception:
                    pass
            os._exit(0)
        if msg.get("t") == "stacks":
            link.send({"t": "stacks", "id": msg.get("id"), "text": main_stack()})
        elif msg.get("t") == "release":
            link.send({"t": "released", "id": msg.get("id"), "closed": release_connections()})
        else:
            inbox.put(msg)


def _schedule_facts(e: BaseException) -> dict | None:
    """The schedule a failed cell was stepping (found in its traceback), as the kernel compares it
    across ranks to name the mistake (the same stage_index on two ranks, different n_microbatches)."""
    from ..versions import is_schedule, schedule_state

    found, tb = None, e.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if is_schedule(obj):
            found = obj
        tb = tb.tb_next
    if found is None:
        return None
    try:
        n_microbatches, stages = schedule_state(found)
        return {"schedule": type(found).__name__, "n_microbatches": n_microbatches,
                "stages": [[int(s.stage_index), int(s.num_stages), str(s.device)] for s in stages]}
    except Exception:
        return None


def release_connections() -> int:
    """End this rank's side of every gloo connection (its TCP sockets to the other ranks; the store's
    stays): a send, recv or collective that waits on one then fails at once with gloo's "Connection
    closed" error, in the main thread, so a cell stuck waiting for ranks that left it ends as an
    ordinary exception and the namespace lives on. The process group is unusable afterwards:
    `regroup` makes a new one. Called from the reader thread (the main thread may be blocked)."""
    import socket

    import psutil

    from ..core.processes import INHERITED_FDS  # a warm rank's copies of the agent's sockets

    store_port = int(os.environ.get("MASTER_PORT", "0"))
    me = psutil.Process()
    conns = me.net_connections(kind="tcp") if hasattr(me, "net_connections") else me.connections(kind="tcp")
    closed = 0
    for c in conns:
        if not c.raddr or c.fd < 0 or c.raddr.port == store_port or c.laddr.port == store_port or c.fd in INHERITED_FDS:
            continue  # listening sockets, the store (the new group meets there), the agent's own
        try:
            with socket.socket(fileno=os.dup(c.fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
    return closed


def regroup(gen: int) -> dict:
    """A new default process group (same ranks, same backend) after `release_connections`: met through
    the job's store under a prefix of its own, so nothing of the old group's rendezvous is read again.
    Groups made from the old one (new_group, a DeviceMesh) are gone and must be made again."""
    import torch.distributed as dist

    try:
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        try:
            dist.destroy_process_group()
        except Exception:
            pass  # a group whose connections were ended may refuse a clean teardown: it is dropped anyway
        from datetime import timedelta

        timeout = timedelta(seconds=float(os.environ.get(channel.PG_TIMEOUT_VAR, "600")))
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=dist.PrefixStore(f"labkit_regroup_{gen}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        return {"t": "regrouped", "gen": gen, "ok": True}
    except Exception as e:
        return {"t": "regrouped", "gen": gen, "ok": False, "error": f"{type(e).__name__}: {e}"}


def _run_code(code: str, filename: str, ns: dict):
    """exec the cell; the value of a last bare expression is returned, as IPython shows `Out[n]`."""
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), ns)
    return eval(compile(last, filename, "eval"), ns) if last is not None else None


def _format_error(e: BaseException) -> str:
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # the runner's frames say nothing about the cell
    return "".join(traceback.format_exception(type(e), e, tb))


def _mark_schedule(path: str, started: float) -> None:
    """If the cell logged pipelining actions but no "Using ..." line, put the remembered one first."""
    if not STATE.schedule or not os.path.exists(path):
        return
    with open(path) as f:
        text = f.read()
    if not text or re.search(r"\] Using \S+$", text, re.M):
        return
    head = f"{started:.6f} I {PP_LOGGER}.labkit {MARKER_SOURCE} Using {STATE.schedule}\n"
    with open(path, "w") as f:
        f.write(head + text)


def _cell_spans(path: Path, n: int):
    """The spans recorder (labkit.spans), writing this cell's steps to the cell's own file (cell `n`: where a
    compiled stage that falls back has run eagerly since)."""
    from ..spans.record import install

    rec = install()
    rec.use_file(path, f"cell {n}")
    return rec


def run_cell(msg: dict, ns: dict, link: Link) -> dict:
    from ..logs.parse import PP_LOG_FORMAT  # not the launcher's side: this code runs inside a rank

    n, code, log_path = msg["cell"], msg["code"], msg["log"]
    filename = f"<cell {n}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # tracebacks show the lines
    handler = logging.FileHandler(log_path, delay=True)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(_FormattedOnce(PP_LOG_FORMAT))
    pp = logging.getLogger(PP_LOGGER)
    pp.addHandler(handler)
    spans = _cell_spans(Path(log_path).parent / "spans" / f"rank{Path(log_path).stem[4:]}.jsonl", n)
    STATE.cell = n
    started = time.time()
    try:
        try:
            STATE.in_cell = True
            value = _run_code(code, filename, ns)
            STATE.in_cell = False
            reply = {"t": "done", "cell": n, "ok": True, "value": value}
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: the rank lives on
            STATE.in_cell = False
            reply = {"t": "done", "cell": n, "ok": False, "error": _format_error(e), "exc_type": type(e).__name__,
                     "interrupted": isinstance(e, KeyboardInterrupt), "pipeline": _schedule_facts(e)}
    except KeyboardInterrupt:  # landed between the cell's end and the flag being cleared
        STATE.in_cell = False
        reply = {"t": "done", "cell": n, "ok": False, "error": "KeyboardInterrupt\n", "exc_type": "KeyboardInterrupt",
                 "interrupted": True}
    finally:
        STATE.in_cell = False
        STATE.pending_interrupt = False
        STATE.cell = None
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        pp.removeHandler(handler)
        handler.close()
        if spans is not None:
            spans.use_file(None)  # this cell's spans are written; nothing later lands in its file
    _mark_schedule(log_path, started)
    if reply["ok"]:
        value = reply["value"]
        device_type = getattr(getattr(value, "device", None), "type", "cpu")
        if type(value).__module__.startswith("torch") and device_type != "cpu":
            value = value.detach().cpu()  # the kernel may have no GPU
        reply["value"] = channel.wrap(value)
    reply["schedule"] = STATE.schedule
    return reply


def main() -> None:
    signal.signal(signal.SIGINT, _on_sigint)
    if hasattr(signal, "SIGUSR1"):  # the kernel's fallback when the reader thread cannot answer
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    # Out of os.environ: what a cell starts (or prints) never sees the secret.
    path = os.environ.pop(channel.SOCKET_VAR, None)
    secret = os.environ.pop(channel.SECRET_VAR, None)
    if not path or not secret:
        sys.exit("labkit.ranks.rank is started by labkit.Ranks (it needs the pool's socket and secret).")
    link = Link(channel.connect(path, secret))
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(link, inbox), name="labkit-ranks-reader", daemon=True).start()

    import torch
    import torch.distributed as dist

    from ..worker.distributed import init_distributed

    # The kernel's quiet warnings (labkit.notebook.helpers.setup): torch's FutureWarnings (pipeline() emits some)
    # would otherwise land in cell outputs, and differ from one torch version to the next.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    logging.getLogger(PP_LOGGER).addHandler(_level(_ScheduleSeen(), logging.INFO))
    _pin_log_handlers()
    sys.stdout, sys.stderr = Tee(sys.stdout, "stdout", link), Tee(sys.stderr, "stderr", link)
    info = init_distributed(os.environ.get(channel.DEVICE_VAR, "auto"),
                            float(os.environ.get(channel.PG_TIMEOUT_VAR, "600")))
    ns = {"__name__": "__main__", "__builtins__": __builtins__, "rank": info.rank, "world_size": info.world_size,
          "local_rank": info.local_rank, "device": info.device, "dist": dist, "torch": torch}
    link.send({"t": "hello", "rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
               "pid": os.getpid(), "device": str(info.device), "backend": info.backend, "torch": torch.__version__})
    while True:
        try:
            msg = inbox.get()
            if msg.get("t") == "exec":
                link.send(run_cell(msg, ns, link))
            elif msg.get("t") == "regroup":
                link.send(regroup(int(msg.get("gen", 0))))
        except KeyboardInterrupt:  # a late SIGINT between cells: nothing to stop
            continue


def _pin_log_handlers() -> None:
    """Keep torch's own log records (TORCH_LOGS=+pp) in the rank's stderr file, out of the cells' output.

    torch 2.15 logs through a handler that looks `sys.stderr` up at every record (2.13's kept the
    stream it was made with), so once sys.stderr is the cell's Tee every pipelining DEBUG line would
    land in the notebook. Each such handler is swapped for one bound to the real stderr."""
    import torch.distributed.pipelining  # noqa: F401  (torch sets TORCH_LOGS' handlers up on import)

    loggers = [lg for name, lg in list(logging.Logger.manager.loggerDict.items())
               if name.startswith("torch") and isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in list(lg.handlers):
            if isinstance(h, logging.FileHandler) or getattr(h, "stream", None) is not sys.stderr:
                continue
            pinned = logging.StreamHandler(sys.__stderr__)
            pinned.setLevel(h.level)
            plain = type(h.formatter) is logging.Formatter and h.formatter.datefmt is None
            pinned.setFormatter(_FormattedOnce(h.formatter._fmt) if plain else h.formatter)
            for f in h.filters:
                pinned.addFilter(f)
            pinned.addFilter(_NotInCell())
            lg.removeHandler(h)
            lg.addHandler(pinned)


def _level(h: logging.Handler, level: int) -> logging.Handler:
    h.setLevel(level)
    return h


if __name__ == "__main__":
    main()
