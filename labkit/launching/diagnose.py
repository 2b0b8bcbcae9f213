"""Why a job failed: which rank failed first and with what, where each rank was at a deadline.

Reads what torchrun leaves (per-rank error.json from @record, the launcher's failure summary) and
the faulthandler dumps in the rank logs. Also the one parser of Python stack frames, `parse_frames`
(`labkit.notebook.helpers.stack_frames` shows a hung job's stacks with it, notebook 09), and of a
traceback's (`traceback_frames`). `rank_ends` says how each rank ended; `where_stuck` reads that
with the ranks' PP logs into pipeline terms (`labkit.timeline.stuck`).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.shown import shown

if TYPE_CHECKING:  # a Run's methods ask this module (Run.where_stuck): it names Run for annotations only
    from .rundir import Run

TAIL_LINES = 30  # the lines of a log an error message shows (`Run.tail`)

# A frame line of a faulthandler dump: `  File "x.py", line 12 in f`.
FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')

# Errors that only echo another rank's crash (the peer hung up): never the root cause if another exists.
_CONSEQUENCE = re.compile(r"Connection closed by peer|remote worker crashing|Connection reset by peer|Broken pipe|"
                          r"NCCL communicator was aborted|SignalException|Socket Timeout", re.I)


# A frame line of a traceback: `  File "x.py", line 12, in f`.
TRACEBACK_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+), in (\S+)')
TRACEBACK = "Traceback (most recent call last):"


def parse_frames(text: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of every frame line in a faulthandler dump, innermost first."""
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in map(FRAME.match, text.splitlines()) if m]


def traceback_frames(text: str) -> tuple[list[tuple[str, int, str]], str]:
    """(frames innermost first, the error line) of the last traceback in `text` (a rank's stderr.log)."""
    i = text.rfind(TRACEBACK)
    if i < 0:
        return [], ""
    lines = text[i:].splitlines()[1:]
    frames = [(m.group(1), int(m.group(2)), m.group(3)) for m in map(TRACEBACK_FRAME.match, lines) if m]
    error = next((l.strip() for l in lines if l.strip() and not l.startswith((" ", "\t"))), "")
    return frames[::-1], error


def other_threads(dump: str) -> list[str]:
    """Each thread of a faulthandler dump but the interrupted one, as its innermost frame ("thread 0x...:
    File ... in ..."): what else ran in a rank that is stuck (a reader, a watcher, torch's own)."""
    out = []
    for m in re.finditer(r"^Thread (0x[0-9a-f]+) \(most recent call first\):\n((?:[ \t]+\S.*(?:\n|$))*)", dump, re.M):
        frames = m.group(2).strip().splitlines()
        out.append(f"thread {m.group(1)}: {frames[0].strip() if frames else '(no Python frame)'}")
    return out


def current_thread(dump: str) -> str:
    """The part of a faulthandler dump about the thread that was interrupted (the main thread of a
    rank stuck in a collective), without the other threads printed after it."""
    i = dump.find("Current thread")
    if i < 0:
        return dump
    j = dump.find("\nThread 0x", i)
    return dump[i:] if j < 0 else dump[i:j]


def rank_errors(run_dir: Path) -> dict[int, dict]:
    """torchrun's per-rank error.json files (written by @record when a rank raises)."""
    out = {}
    for f in run_dir.glob("logs/*/attempt_*/*/error.json"):
        try:
            data = json.loads(f.read_text())
            out[int(f.parent.name)] = data.get("message", data)
        except (ValueError, OSError):
            continue
    return out


def failed_ranks_from_launcher(text: str) -> dict[int, int]:
    """{rank: exitcode} from torchrun's failure summary."""
    found = {}
    for m in re.finditer(r"rank\s*:\s*(\d+)[^\n]*\n(?:[^\n]*\n){0,3}?\s*exitcode\s*:\s*(-?\d+)", text):
        found[int(m.group(1))] = int(m.group(2))
    return found


def _root_cause_from_launcher(text: str) -> int | None:
    m = re.search(r"Root Cause[^\n]*\n(?:[^\n]*\n){0,4}?\s*rank\s*:\s*(\d+)", text)
    return int(m.group(1)) if m else None


def launcher_text(run_dir: Path) -> str:
    p = run_dir / "launcher.log"
    return p.read_text(errors="replace") if p.exists() else ""


def first_failure(run: Run) -> tuple[int | None, str]:
    """The rank that failed first, and its last error line: its own exception beats a peer's echo of it."""
    errors = rank_errors(run.run_dir)
    launcher = launcher_text(run.run_dir)
    codes = failed_ranks_from_launcher(launcher)
    root = _root_cause_from_launcher(launcher)

    def text(r) -> str:
        e = errors[r]
        if isinstance(e, dict):
            return str(e.get("message") or e.get("extraInfo", {}).get("py_callstack") or e)
        return str(e)

    def stamp(r) -> int:
        e = errors[r]
        ts = e.get("extraInfo", {}).get("timestamp", "0") if isinstance(e, dict) else "0"
        return int(ts) if str(ts).isdigit() else 0

    if errors:
        rank = min(errors, key=lambda r: (bool(_CONSEQUENCE.search(text(r))), r != root, stamp(r), r))
        lines = [l for l in text(rank).strip().splitlines() if l.strip()]
        return rank, lines[-1].strip() if lines else "raised an exception"
    if codes:
        rank = root if root in codes else min((r for r, c in codes.items() if c != -15), default=min(codes))
        return rank, f"exited with code {codes[rank]}"
    return None, "torchrun failed before any rank reported (see launcher.log)"


_SPANS_DIR = str(Path(__file__).resolve().parent.parent / "spans")  # the kit's wrappers around torch's calls


def _library_frame(path: str) -> bool:
    """Frames a learner did not write: installed packages, the standard library, and the kit's span
    recorder (it wraps torch's pipelining calls, so it sits on every hung rank's stack)."""
    return "site-packages" in path or "/lib/python" in path or path.startswith(_SPANS_DIR)


def _user_frame(frames: list) -> tuple | None:
    return next((f for f in frames if not _library_frame(f[0])), None)


def rank_ends(run: Run) -> dict:
    """{rank: `labkit.timeline.stuck.RankEnd`}: each rank's stack (its faulthandler dump, else its
    traceback) and how it ended, from its stderr.log and torchrun's failure summary."""
    from ..timeline.stuck import RankEnd

    codes = run.rank_exitcodes or failed_ranks_from_launcher(launcher_text(run.run_dir))
    ends = {}
    for rank in range(run.nproc):
        text = run.log(rank, "stderr")
        i = text.rfind("Fatal Python error")
        if i >= 0:
            frames = parse_frames(current_thread(text[i:]))
            ends[rank] = RankEnd("stalled", frames, _user_frame(frames))
            continue
        frames, error = traceback_frames(text)
        if frames:
            ends[rank] = RankEnd("raised", frames, _user_frame(frames), error, bool(_CONSEQUENCE.search(error)),
                                 codes.get(rank))
        elif run.status == "interrupted":  # stopped with the job, no stack dumped
            ends[rank] = RankEnd("stopped")
        elif run.rank_dir(rank) is not None:  # it ran, and ended without a traceback
            ends[rank] = RankEnd("exited", exitcode=codes.get(rank, 0 if run.status == "failed" else None))
    return ends


def where_stuck(run: Run):
    """Where each rank was when the job stopped or failed, in pipeline terms (`labkit.timeline.stuck.Stuck`)."""
    from ..timeline.stuck import where_stuck as explain

    return explain(run.run_dir, rank_ends(run))


def stack_report(run: Run) -> dict[int, str]:
    """From each rank's faulthandler dump: its innermost frame, and the innermost frame outside libraries.
    Writes every dump into the run directory's stacks.txt."""
    where = {}
    dumps = []
    for rank in range(run.nproc):
        text = run.log(rank, "stderr")
        i = text.rfind("Fatal Python error")
        if i < 0:
            where[rank] = "no stack dump (the rank had already exited)"
            continue
        dump = text[i:]
        dumps.append(f"=== rank {rank} ===\n{dump}")
        frames = parse_frames(current_thread(dump))
        if not frames:
            where[rank] = "stack dump has no Python frames"
            continue
        inner = frames[0]
        user = next((f for f in frames if not _library_frame(f[0])), inner)
        where[rank] = f"{user[0]}:{user[1]} in {user[2]}" + (
            f" (innermost: {Path(inner[0]).name}:{inner[1]} in {inner[2]})" if user != inner else "")
    if dumps:
        (run.run_dir / "stacks.txt").write_text("\n".join(dumps))
    return where


TEARDOWN_ABORT = "terminate called without an active exception"
TEARDOWN_HINT = (
    "Hint: this rank aborted while Python was shutting down, after its script's last line: a torch "
    "teardown race (a gloo collective's thread still calling into Python at exit; seen with DTensor / "
    "tensor parallelism on torch 2.14 and 2.15). End the script with dist.destroy_process_group() and then "
    "labkit.worker.distributed.exit_now(0), as the kit's own jobs do.")


def error_message(run: Run, headline: str) -> str:
    """The headline, the exact command, and the tail of the failing rank's log (or of launcher.log),
    with this machine's folders cut (`labkit.core.shown`: python, <site-packages>/, paths from the
    current folder); command.txt and the logs in the run directory keep the exact paths."""
    parts = [headline, f"Command: {shlex.join(run.command)}", f"Run directory: {run.run_dir}"]
    if run.failed_rank is not None:
        parts.append(f"Last lines of rank {run.failed_rank}'s log ({run.rank_dir(run.failed_rank)}):")
        tail = run.tail(run.failed_rank) or "(empty)"
        parts.append(tail)
        if TEARDOWN_ABORT in run.log(run.failed_rank, "stderr"):  # the abort's stack dump may push it out of the tail
            parts.append(TEARDOWN_HINT)
    elif run.status == "timeout":
        parts.append("Every rank's stack: stacks.txt in the run directory.")
    else:
        parts.append("Last lines of launcher.log:")
        text = launcher_text(run.run_dir)
        parts.append("\n".join(text.splitlines()[-TAIL_LINES:]) if text else "(empty)")
    return shown("\n".join(parts))
