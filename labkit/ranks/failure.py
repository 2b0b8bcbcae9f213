"""How a cell's failure is told: `RanksError` (what failed, on which rank, what was kept), the
hints read off the failed ranks' schedules (a wrong stage_index, different n_microbatches), and, for a
cell that hung or left ranks blocked, where each rank was in pipeline terms (`pipeline_terms`: the step,
the action, the microbatch, the peer; the cause; `labkit.timeline.stuck`). Used by the pool
(`labkit.ranks.pool`); taught in notebook 09."""

from __future__ import annotations

import re
from pathlib import Path

_KIT = str(Path(__file__).resolve().parent.parent)  # labkit/: the rank runner's and the kit's own frames


class RanksError(RuntimeError):
    """A cell that failed on some rank. `failed`: {rank: traceback}; `blocked`: {rank: stack} of ranks
    that never finished; `restarted`: the pool was restarted (namespaces lost); `results`: what the
    ranks that finished returned."""

    def __init__(self, message: str, cell: int | None = None, failed: dict | None = None,
                 blocked: dict | None = None, restarted: bool = False, results: dict | None = None):
        super().__init__(message)
        self.cell, self.failed, self.blocked = cell, failed or {}, blocked or {}
        self.restarted, self.results = restarted, results or {}

    def _render_traceback_(self):
        # IPython shows this instead of a traceback through the kit's own frames: the message
        # already holds the rank's traceback, which is the one that matters.
        return [f"{type(self).__name__}: {self}"]


def _indent(text: str, pad: str = "    ") -> str:
    return "\n".join(pad + l for l in text.rstrip().splitlines())


def failed_start(job, reason: str, nproc: int, start_timeout: float) -> tuple[str, bool]:
    """A pool start that failed (`job`, a `labkit.ranks.job.Job`), ended: (what it says: why, the command, the run
    directory, launcher.log's and rank 0's last lines and, for a start that timed out, where each rank that never
    joined was; whether every rank was alive inside torch's `init_process_group`, `hung_in_init`)."""
    tail = job.tail(0) if job.rank_log(0) else "(rank 0 wrote no log)"
    launcher = job.launcher_tail()  # before stopping: then it only shows torchrun being ended
    late = job.proc.poll() is None  # timed out: where each rank that never joined was, from its stacks
    job.stop(dump_stacks=late)
    where = job.unjoined_stacks() if late else ""
    shown = f"Where the ranks that never joined were:\n{_indent(where)}\n" if where else ""
    return (f"The pool's {nproc} ranks did not start: {reason}\nCommand: {' '.join(job.command)}\n"
            f"Run directory: {job.run_dir}\nLast lines of launcher.log:\n{_indent(launcher)}\n"
            f"Last lines of rank 0's log:\n{_indent(tail)}\n{shown}Check `labkit doctor`; on a slow machine pass "
            f"start_timeout= (now {start_timeout:g} s)."), hung_in_init(where, nproc)


def hung_in_init(where: str, nproc: int) -> bool:
    """A start that timed out with every rank that never joined alive inside torch's `init_process_group` (`where`:
    `Job.unjoined_stacks`): the process group's set-up never finished, which a fresh launch gets past."""
    blocks = re.split(r"^rank \d+:", where, flags=re.M)[1:]
    return 0 < len(blocks) <= nproc and all(" in init_process_group" in b for b in blocks)


def _in_distributed(stack: str | None) -> bool:
    """The innermost frame of a rank's stack (as `rank.main_stack` gives it) is torch.distributed's."""
    files = [l for l in (stack or "").splitlines() if l.strip().startswith('File "')]
    return bool(files) and "torch/distributed/" in files[-1].replace("\\", "/")


def _pipeline_hint(facts: dict) -> str | None:
    """The mistake that the failed ranks' schedules show side by side (`rank._schedule_facts`), or None."""
    facts = {r: f for r, f in sorted(facts.items()) if f}
    if len(facts) < 2:
        return None
    holders: dict[int, list[int]] = {}
    for r, f in facts.items():
        for index, _, _ in f["stages"]:
            holders.setdefault(index, []).append(r)
    hints = [f"stage {i} was built on {_names(rs)}: each rank must build its own stages (a wrong stage_index? "
             f"With one stage per rank it is `rank`: PipelineStage(module, rank, world_size, device))."
             for i, rs in sorted(holders.items()) if len(rs) > 1]
    ms = {r: f["n_microbatches"] for r, f in facts.items()}
    if len(set(ms.values())) > 1:
        hints.append("the ranks' schedules were built with different n_microbatches ("
                     + ", ".join(f"rank {r}: {m}" for r, m in ms.items())
                     + "): every rank must build its schedule with the same n_microbatches.")
    sizes = {r: {s[1] for s in f["stages"]} for r, f in facts.items()}
    if len({frozenset(v) for v in sizes.values()}) > 1:
        hints.append("the ranks' stages were built with different num_stages: every rank must pass the same one.")
    return ("Likely mistake: " + " ".join(hints)) if hints else None


def _names(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def cell_ends(cell, stacks: dict, nproc: int) -> dict:
    """{rank: `labkit.timeline.stuck.RankEnd`}: how each rank of the pool left a cell that hung or failed.
    `stacks` {rank: the stack the pool took of a rank still in the cell (`rank.main_stack`, or a
    faulthandler dump)}; a rank whose cell raised: its traceback (a KeyboardInterrupt's says where it was
    stopped); one that ended the cell, "finished"; one not sent it, "idle"; one whose process ended, "exited"."""
    from ..launching.diagnose import _CONSEQUENCE, _library_frame, parse_frames, traceback_frames
    from ..timeline.stuck import RankEnd

    def user(frames):  # the learner's frame: a cell's line or their own file, not torch's nor the kit's
        return next((f for f in frames if not _library_frame(f[0]) and not str(f[0]).startswith(_KIT)), None)

    ends = {}
    for r in range(nproc):
        if r in stacks:
            text = stacks[r] or ""
            frames = (parse_frames(text)  # a faulthandler dump: innermost first, `line 3 in f`
                      or traceback_frames("Traceback (most recent call last):\n" + text)[0])
            ends[r] = RankEnd("stalled", frames, user(frames))
        elif r in cell.failures:
            msg = cell.failures[r]
            frames, error = traceback_frames(msg.get("error", ""))
            ends[r] = (RankEnd("stalled", frames, user(frames)) if msg.get("interrupted") else
                       RankEnd("raised", frames, user(frames), error, bool(_CONSEQUENCE.search(error))))
        elif r in cell.dead:
            ends[r] = RankEnd("exited")
        elif r in cell.results:
            ends[r] = RankEnd("finished")
        elif r not in cell.targets:
            ends[r] = RankEnd("idle")
    return ends


def pipeline_terms(cell_dir, cell, stacks: dict, nproc: int) -> list[str]:
    """Where each rank was in the cell, in pipeline terms (`labkit.timeline.stuck.where_stuck_in_cell`, from
    the cell's own PP logs and `cell_ends`), as lines of the error; none when no rank pipelined in the cell,
    and a line saying why when it cannot be read: the explanation never hides the error itself."""
    from ..timeline.stuck import where_stuck_in_cell

    try:
        stuck = where_stuck_in_cell(cell_dir, cell_ends(cell, stacks, nproc))
    except Exception as e:  # noqa: BLE001 - the cell's error must still be raised
        return [f"(labkit could not say where the ranks were in pipeline terms: {type(e).__name__}: {e})"]
    return [stuck.text()] if stuck.pipelined else []
